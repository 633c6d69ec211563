"""Issue 19 on the GPU: the Megatron trainer's MoE weights (every expert, the router, Qwen2-MoE's gated shared
expert) reach a real SGLang server through the loop's own sync path (`MegatronTrainer.named_weights` ->
`SGLangWeightSender` -> `SGLangEngine`), by CUDA IPC and by disk (NCCL needs a second GPU), and the server then
scores tokens as the trainer does. Checked by log-probs, not by names: SGLang fuses the experts into stacked
tensors its checksums do not cover, so a missed or misplaced expert shows only in what the model computes.
Issue 37 adds GLM-4.5, DeepSeek-V3 and a DeepSeek-V2-Lite-style model (no q down-projection).

    python -m pytest tests/e2e/test_gpu_moe_sync.py -m gpu -s          # stage moe-sync
    python -m pytest tests/e2e/test_gpu_moe_sync.py -m gpu -s -k deepseek

What SGLang 0.5.17 does with DeepSeek's multi-head latent attention (MLA) on a sync, read in its source
(srt/models/deepseek_v2.py, srt/models/deepseek_common/):
- ``DeepseekV3ForCausalLM`` and ``DeepseekV2ForCausalLM`` are one class; its ``load_weights`` runs once per load
  call: ``/update_weights_from_tensor`` (load_format flattened_bucket) calls it once per bucket,
  ``/update_weights_from_disk`` once over the whole folder. Each call ends in ``post_load_weights(weight_names=``
  the names of that call ``)``, which derives ``w_kc``/``w_vc`` (kv_b_proj split per head into its k-nope and v
  parts: the "absorbed" copies the MLA decode path multiplies by) for exactly the layers whose ``kv_b_proj`` came in
  that call, copying into the existing tensors (``bind_or_assign``: CUDA graphs keep their addresses). So no bucket
  split leaves them stale: a layer is re-derived in the call that brings its kv_b_proj, whatever else that bucket
  holds; the sender needs no ordering for them. What a split can break is the other derived weight: with
  ``q_lora_rank`` set, ``q_a_proj`` and ``kv_a_proj_with_mqa`` load into one ``fused_qkv_a_proj_with_mqa`` only when
  both come in one call, and a half that comes alone is dropped without a word; the trainer's buckets keep each pair
  together (trainer_megatron.convert.bucketed), and so does a delta sync's full push (delta_push.full_chunks).
  One derived copy no update refreshes: with decode context parallelism (``--dcp-size`` > 1) and
  ``--dcp-replicate-q-proj``, model_runner.py gathers w_kc and q_b_proj into full-head copies once at start-up
  (``_prepare_replicated_q_proj``) and a sync leaves them stale; the launch never sets either.
- Why log-probs catch stale derived copies where a checksum would not: /weights_checker hashes the model's parameters
  and buffers (kv_b_proj among them); w_kc/w_vc are plain attributes, so a sync that left them behind passes it. With
  ``--attention-backend triton`` (it serves MLA: deepseek_common/attention_backend_handler.py), a prefill with no
  cached prefix runs plain multi-head attention through kv_b_proj, and every decode step runs the absorbed path
  through w_kc/w_vc: of the 32 tokens sampled after each prompt, the first is scored through kv_b_proj and the
  other 31 through the derived copies, and the engine flushes its prefix cache after each sync, so nothing old is
  reused. The test prints and bounds the two apart: a stale w_kc/w_vc keeps the decoded tokens' gap after the sync
  near the gap before it, a stale kv_b_proj the first tokens', a dropped q/kv down-projection both.
- The tiny DeepSeek shapes use DeepSeek-V3's own head dims (q/k 128 + 64 rotary, v 128) and kv_lora_rank 512, so the
  triton decode kernel takes the path real checkpoints take (a 576-wide latent + rotary key).
- SGLang reads ``topk_method``, ``scoring_func`` and ``moe_layer_freq``, which DeepSeek's own config.json files
  carry and transformers' DeepseekV3Config/DeepseekV2Config do not: the tiny folders carry them. SGLang routes every
  DeepSeek MoE layer with its grouped top-k, so V2-Lite's greedy routing is n_group = topk_group = 1 with softmax
  scores, as V2-Lite's own config says. Its shared experts are fused into the routed ones only for 256 or 384
  experts (DeepSeek-V3/R1, Kimi): not here.
- ``--enable-return-routed-experts`` works for DeepSeek (srt/state_capturer/routed_experts.py captures each TopK
  layer's choice; the dense first layer's row stays zero): benchmarks/moe_replay_gap.py --shape deepseek-v3-reduced.
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


NEW_TOKENS = 32


def token_gaps(engine, trainer, prompts: list[list[int]]) -> torch.Tensor:
    """|SGLang - trainer| log-prob of each token SGLang samples (temperature 1) after ``prompts``,
    ``[prompts, NEW_TOKENS]``: column 0 was scored by SGLang's prefill, the others by its decode steps."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def sample_all():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, asyncio.run(sample_all()), strict=True)):
        sample = Sample(index=i, tokens=list(prompt), reward=0.0)
        sample.append_response(out.token_ids, out.log_probs, trained=True)
        samples.append(sample)
    batch = RolloutBatch.from_samples(samples)
    return (batch.rollout_log_probs - trainer.compute_log_probs(batch)).abs().float().cpu().reshape(-1, NEW_TOKENS)


def described(gap: torch.Tensor) -> str:
    """The mean gap, and the prefill's and the decode steps' apart (MLA: kv_b_proj's path and w_kc/w_vc's)."""
    return f"{gap.mean():.4f} (first token {gap[:, 0].mean():.4f}, decoded {gap[:, 1:].mean():.4f})"


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
# DeepSeek-V3 (issue 37): MLA with both low-rank projections (q 384, kv 512) and V3's head dims, a dense first layer,
# 16 experts in 4 groups of which 2 are searched (top-4: 2 a group, the ratio V3's 8 / 4 has), a shared expert, the
# correction bias (random: core.testing.tiny_model) and routed scaling. DeepSeek-V2-Lite-style: no q down-projection
# (SGLang's q_proj, nothing fused), softmax greedy routing, two shared experts.
MLA_SHAPE = {"hidden_size": 256, "num_heads": 4, "num_layers": 3, "moe_intermediate_size": 128, "n_routed_experts": 16,
             "num_experts_per_tok": 4, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "moe_layer_freq": 1}
SHAPES = {"qwen3_moe": MOE_SHAPE, "qwen2_moe": dict(MOE_SHAPE, shared_expert_intermediate_size=256),
          "glm4_moe": {"hidden_size": 256, "num_heads": 4, "moe_intermediate_size": 128, "n_routed_experts": 16,
                       "num_experts_per_tok": 4, "n_group": 2, "topk_group": 2, "num_layers": 3},
          "deepseek_v3": dict(MLA_SHAPE, q_lora_rank=384, n_group=4, topk_group=2, n_shared_experts=1,
                              topk_method="noaux_tc", scoring_func="sigmoid"),
          "deepseek_v2": dict(MLA_SHAPE, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                              topk_method="greedy", scoring_func="softmax")}


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
        start = token_gaps(engine, trainer, prompts)
        print(f"\n[moe-sync {family}] same weights on both sides: mean |SGLang - Megatron| {described(start)}")
        assert start.mean() < 0.02
        for version, transport in enumerate(("tensor", "disk"), start=1):
            new_weights(trainer, seed=version)
            before = token_gaps(engine, trainer, prompts)

            async def sync(version=version, transport=transport):
                targets = await engine.begin_weight_sync(version, transport=transport)
                sender.send(trainer.named_weights(BUCKET_BYTES), targets, version=version, transport=transport)
                await engine.end_weight_sync(version)

            asyncio.run(sync())
            after = token_gaps(engine, trainer, prompts)
            print(f"[moe-sync {family}] v{version} by {transport}: mean |SGLang - Megatron| {described(before)}"
                  f" before the sync, {described(after)} after")
            assert before.mean() > 0.2 and after.mean() < 0.03, transport  # bf16 kernels differ (dense: ~0.002)
            # each path on its own (MLA: a stale w_kc/w_vc shows in the decoded tokens, a stale kv_b_proj in the
            # first); the first tokens are 16, so their mean gets more room
            assert after[:, 1:].mean() < 0.03 and after[:, 0].mean() < 0.05, transport
    finally:
        asyncio.run(engine.shutdown())
