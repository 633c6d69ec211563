"""GPU acceptance of FP8 rollouts (issue 38, docs/fp8.md) with a real SGLang 0.5.17 server, compute capability
8.9 or 9.x (H100, H200):

    python -m pytest packages/rollout-sglang/tests/test_sglang_fp8_gpu.py -m gpu -s      (scripts/gpu/run.sh fp8)

An engine with ``rollout.precision: fp8`` starts from an FP8 copy of a tiny random model and the trainer's sender (`SGLangWeightSender`, as trainer rank 0 runs it) syncs new bf16 weights by each
transport. After each sync path:

- the bytes and scales the server holds equal core's quantisation of the trainer's weights bit for bit (read
  back with ``/get_weights_by_name``: FP8 and float32 values are exact as JSON floats), and the sync's own
  check (``check_weight_update``: SGLang's ``/weights_checker`` over the pairs) passed;
- a log-prob probe: greedy tokens and their log-probs equal those of an engine started fresh from the same
  weights, so no copy SGLang derives after loading (transposed weights, re-laid scales; verl#7519) was left
  stale by the update; and a sync back to the first weights gives the first log-probs again.

Two models: a tiny Llama whose partitions take 128x128 blocks (DeepGEMM-class shapes), and one with SmolLM2-135M's
partitions in miniature (3 query heads and 1 KV head of 64, so q/k/v are 192/64/64: 128 divides none of them),
served with 64x64 blocks and `--fp8-gemm-backend triton`, the path issue 38's real-model run (fp8-real-model)
takes. The Qwen3-MoE shape runs the same probe with the experts in FP8 and the router gate in bf16, and its routed
experts still come back for routing replay.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_sglang_gpu import (
    ENGINE_ARGS,
    VOCAB,
    engine_param,
    generate_all,
    gpu_config,
    hf_weights,
    make_tiny_llama,
)

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.weights.fp8 import quantize_block
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.fp8 import fp8_format
from slime_rl.rollout_sglang.weights.disk import save_hf_folder
from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

PROBE = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
PROMPTS = [[1, 17 + i, 230, 41 + 3 * i, 512, 9, 77, 300 + i] for i in range(8)]
O_PROJ = "model.layers.0.self_attn.o_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
MOE_SHAPE = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 512,
             "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_layers": 2}


def fp8_config(model: Path, work: Path, **rollout):
    return gpu_config(model, work, precision="fp8", check_weight_update=True, **rollout)


def trained(model: Path, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The model's bf16 weights after 'a step', on the trainer's GPU."""
    return [(n, (t.float() * scale + 0.003).to(t.dtype)) for n, t in hf_weights(model, "cuda:0")]


def probe(engine: SGLangEngine) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and log-probs of the probe prompts, one request at a time: batch size 1 on both engines,
    so the same weights give the same kernels and the same numbers."""
    outs = [asyncio.run(engine.generate(prompt, PROBE)) for prompt in PROMPTS]
    return [o.token_ids for o in outs], torch.tensor([lp for o in outs for lp in o.log_probs])


def reference_probe(weights, base: Path, work: Path) -> tuple[list[list[int]], torch.Tensor]:
    """The probe of an engine started fresh from ``weights`` (its own FP8 copy made at start)."""
    folder = save_hf_folder([(n, t.cpu()) for n, t in weights], work / "model", base)
    engine = SGLangEngine.from_config(fp8_config(folder, work / "run"))
    try:
        return probe(engine)
    finally:
        asyncio.run(engine.shutdown())


def sync(engine: SGLangEngine, sender: SGLangWeightSender, weights, *, version: int, transport: str) -> None:
    async def run():
        targets = await engine.begin_weight_sync(version, transport=transport)
        half = len(weights) // 2
        sender.send(iter([weights[:half], weights[half:]]), targets, version=version, transport=transport)
        await engine.end_weight_sync(version)

    asyncio.run(run())


def assert_same_probe(got, want, what: str) -> float:
    (tokens, log_probs), (want_tokens, want_log_probs) = got, want
    gap = float((log_probs - want_log_probs).abs().max())
    print(f"[fp8] {what}: max |log-prob - reference| = {gap:.2e}")
    assert tokens == want_tokens, what
    assert gap <= 1e-3, what  # same weights, same kernels: a stale copy moves them by far more
    return gap


def smollm2_partitions(out: Path) -> Path:
    """A random 2-layer Llama with SmolLM2-135M's kind of partitions: 3 query heads and 1 KV head of 64 (q/k/v
    192/64/64), intermediate 384; the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer

    from slime_rl.core.testing import save_model, tiny_config, tiny_model

    tok = AutoTokenizer.from_pretrained(make_tiny_llama(out / "tokenizer-source"))
    config = tiny_config("llama", vocab_size=VOCAB, hidden_size=192, intermediate_size=384, num_layers=2,
                         num_heads=3, num_kv_heads=1, head_dim=64, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return save_model(out / "model", tiny_model(config, seed=0), tok, dtype=torch.bfloat16)


@pytest.fixture(scope="module", params=[128, 64], ids=["block128", "block64"])
def tiny_llama(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(f"tiny-llama-{request.param}")
    model = make_tiny_llama(folder) if request.param == 128 else smollm2_partitions(folder)
    assert fp8_format(model, tp_size=1).block == request.param
    return model


def test_fp8_syncs_are_bit_exact_and_leave_no_stale_copy(tiny_llama, tmp_path):
    cfg = fp8_config(tiny_llama, tmp_path / "run")
    block = fp8_format(tiny_llama, tp_size=1).block
    new, original = trained(tiny_llama, 1.5), hf_weights(tiny_llama, "cuda:0")
    want_new = reference_probe(new, tiny_llama, tmp_path / "reference")
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    try:
        first = probe(engine)
        version = 0
        for transport in ("tensor", "disk"):  # nccl: the same loads, by broadcast (a second GPU; not run yet)
            version += 1
            sync(engine, sender, new, version=version, transport=transport)  # check_weight_update passed
            for name in (O_PROJ, Q_PROJ):
                q, scale = quantize_block(dict(new)[name], block)
                assert torch.equal(engine_param(engine, name), q.float().cpu()[:100]), (transport, name)
            q, scale = quantize_block(dict(new)[O_PROJ], block)
            assert torch.equal(engine_param(engine, f"{O_PROJ}_scale_inv"), scale.cpu()), transport
            assert_same_probe(probe(engine), want_new, f"{block}x{block} blocks, v{version} by {transport}")
            version += 1
            sync(engine, sender, original, version=version, transport=transport)
            assert_same_probe(probe(engine), first, f"v{version} (the first weights again) by {transport}")
    finally:
        sender.restore.writes.wait()
        asyncio.run(engine.shutdown())


def test_fp8_moe_sync_keeps_routing_replay(tmp_path):
    from slime_rl.core.testing import tiny_model_folder

    model = tiny_model_folder(tmp_path / "qwen3-moe", "qwen3_moe", dtype=torch.bfloat16, **MOE_SHAPE)
    args = {**ENGINE_ARGS, "enable_return_routed_experts": True}
    cfg = gpu_config(model, tmp_path / "run", engine_args=args, precision="fp8", check_weight_update=True)
    new = trained(model, 1.5)
    folder = save_hf_folder([(n, t.cpu()) for n, t in new], tmp_path / "ref-model", model)
    reference = SGLangEngine.from_config(gpu_config(folder, tmp_path / "ref", engine_args=args, precision="fp8"))
    try:
        want = probe(reference)
    finally:
        asyncio.run(reference.shutdown())
    engine = SGLangEngine.from_config(cfg)
    sender = SGLangWeightSender(cfg, rank=0)
    try:
        sync(engine, sender, new, version=1, transport="tensor")
        expert = "model.layers.0.mlp.experts.0.down_proj.weight"
        assert dict(new)[expert].shape == (256, 128)
        assert_same_probe(probe(engine), want, "Qwen3-MoE v1 by tensor")
        outs = generate_all(engine, PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True,
                                                               return_routed_experts=True))
        for prompt, out in zip(PROMPTS[:2], outs, strict=True):
            routed = out.routed_experts
            assert routed is not None and len(routed) == len(prompt) + 4 - 1
            assert all(len(layer) == MOE_SHAPE["num_experts_per_tok"] for token in routed for layer in token)
        print(f"[fp8] Qwen3-MoE: routed experts of {len(outs)} requests returned, {len(outs[0].routed_experts)}"
              " tokens each")
    finally:
        sender.restore.writes.wait()
        asyncio.run(engine.shutdown())
