"""Issue 19 on the GPU: the Megatron trainer's MoE weights (every expert, the router, Qwen2-MoE's gated shared
expert) reach a real SGLang server through the loop's own sync path (`MegatronTrainer.named_weights` ->
`SGLangWeightSender` -> `SGLangEngine`), by CUDA IPC and by disk (NCCL needs a second GPU), and the server then
scores tokens as the trainer does. Checked by log-probs, not by names: SGLang fuses the experts into stacked
tensors its checksums do not cover, so a missed or misplaced expert shows only in what the model computes.

    python -m pytest tests/e2e/test_gpu_moe_sync.py -m gpu -s
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import load_config
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sample import Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
               "mem_fraction_static": 0.15, "max_total_tokens": 65536}
MOE_SHAPE = {"hidden_size": 256, "num_heads": 4, "moe_intermediate_size": 128, "num_experts": 16,
             "num_experts_per_tok": 4}
BUCKET_BYTES = 1 << 20  # 1 MiB: many buckets, so experts of one layer are split across them


def mean_gap(engine, trainer, prompts: list[list[int]]) -> float:
    """Mean |SGLang - trainer| log-prob over tokens SGLang samples (temperature 1) after ``prompts``."""
    params = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)

    async def sample_all():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, asyncio.run(sample_all()), strict=True)):
        sample = Sample(index=i, tokens=list(prompt), reward=0.0)
        sample.append_response(out.token_ids, out.log_probs, trained=True)
        samples.append(sample)
    batch = RolloutBatch.from_samples(samples)
    return (batch.rollout_log_probs - trainer.compute_log_probs(batch)).abs().mean().item()


@torch.no_grad()
def new_weights(trainer, seed: int) -> None:
    """Fresh random matrices in the trainer (norms kept): what a sync must carry into the server."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for param in trainer.model.parameters():
        if param.dim() >= 2:
            param.copy_(torch.randn(param.shape, generator=gen, device="cuda", dtype=torch.float32) * 0.05)


# GLM-4.5 (issue 37): a dense first layer, 16 experts in 2 groups (both kept: megatron scores a group by its top
# num_experts_per_tok / topk_group = 2 experts, as SGLang does), the shared expert and the correction bias. SGLang
# 0.5.17's Glm4MoeGate keeps a float32 copy of its gate weight from the first forward: a synced router reaches its
# routing only if that copy follows, which the log-probs after the sync show.
SHAPES = {"qwen3_moe": MOE_SHAPE, "qwen2_moe": dict(MOE_SHAPE, shared_expert_intermediate_size=256),
          "glm4_moe": {"hidden_size": 256, "num_heads": 4, "moe_intermediate_size": 128, "n_routed_experts": 16,
                       "num_experts_per_tok": 4, "n_group": 2, "topk_group": 2, "num_layers": 3}}


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_moe_weights_reach_sglang_by_every_transport(family, tmp_path, monkeypatch):
    from slime_rl.core.testing import tiny_model_folder
    from slime_rl.rollout_sglang.engine import SGLangEngine
    from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    model = tiny_model_folder(tmp_path / family, family, dtype=torch.bfloat16, **SHAPES[family])
    cfg = load_config(None, [f"model.path={model}", "model.dtype=bfloat16", "rollout.engine=sglang",
                             f"rollout.sglang.server_args={json.dumps(ENGINE_ARGS)}", "cluster.device=cuda",
                             f"logging.dir={tmp_path / 'run'}", "data.source=none"], check=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    trainer = MegatronTrainer.from_config(cfg)
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (24,), generator=gen).tolist() for _ in range(16)]
    try:
        start = mean_gap(engine, trainer, prompts)
        print(f"\n[moe-sync {family}] same weights on both sides: mean |SGLang - Megatron| {start:.4f}")
        assert start < 0.02
        for version, transport in enumerate(("tensor", "disk"), start=1):
            new_weights(trainer, seed=version)
            before = mean_gap(engine, trainer, prompts)

            async def sync(version=version, transport=transport):
                targets = await engine.begin_weight_sync(version, transport=transport)
                sender.send(trainer.named_weights(BUCKET_BYTES), targets, version=version, transport=transport)
                await engine.end_weight_sync(version)

            asyncio.run(sync())
            after = mean_gap(engine, trainer, prompts)
            print(f"[moe-sync {family}] v{version} by {transport}: mean |SGLang - Megatron| {before:.4f} before "
                  f"the sync, {after:.4f} after")
            assert before > 0.2 and after < 0.03, transport  # bf16 kernels differ (dense: ~0.002)
    finally:
        asyncio.run(engine.shutdown())
