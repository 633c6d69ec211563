"""On the GPU machine (H200): bf16 training under TP=2 on two GPUs, bf16 log-prob parity with
transformers, offload/onload for colocation, and the MoE grouped experts on CUTLASS's grouped GEMM. Every case runs in fresh processes (one per
rank), so it does not matter what else the pytest process ran. The figures printed here go to
docs/gpu-results.md:

    python -m pytest packages/trainer-megatron/tests/test_megatron_gpu.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import launch, make_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads / 2 KV heads, SwiGLU 4864, tied 151,936 vocab
QWEN25_05B = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tie=True)
CUDA = ["cluster.device=cuda", "model.dtype=bfloat16", "trainer.micro_batch_size=4"]


@pytest.fixture(scope="module")
def qwen_05b(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("qwen05b") / "m", "qwen2", dtype=torch.bfloat16, **QWEN25_05B)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_bf16_tp2_train_steps_match_tp1(qwen_05b, tmp_path):
    spec = dict(model=str(qwen_05b), num_samples=16, vocab=QWEN25_05B["vocab"], ref=True, steps=3,
                prompt=(64, 128), response=(64, 256))
    common = CUDA + ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01", "trainer.lr=1e-5"]
    one = launch(1, {**spec, "overrides": common}, tmp_path)
    two = launch(2, {**spec, "overrides": common + ["parallel.tensor_model_parallel_size=2",
                                                      "cluster.actor_num_gpus_per_node=2"],
                     "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)
    print("\nTP=1 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in one["metrics"]])
    print("TP=2 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in two["metrics"]])
    assert one["roundtrip_exact"] and two["roundtrip_exact"]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert all(torch.isfinite(torch.tensor([b["loss"], b["grad_norm"]])))
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * a["grad_norm"]
    assert two["metrics"][2]["ppo_kl"] != 0
    assert two["resumed_metrics"] == two["metrics"][1:]


def test_bf16_log_probs_match_transformers(qwen_05b, tmp_path):
    out = launch(1, dict(scenario="hf_parity", model=str(qwen_05b), num_samples=8, vocab=QWEN25_05B["vocab"],
                         prompt=(64, 256), response=(64, 512), overrides=CUDA), tmp_path)
    diff = out["abs_diff"]
    print(f"\nbf16 log-prob |megatron - transformers|: mean {diff.mean():.2e}, max {diff.max():.2e}"
          f" over {diff.numel()} tokens")
    assert diff.mean() < 2e-2 and diff.max() < 0.5


def test_offload_frees_the_gpu_and_onload_resumes_training(qwen_05b, tmp_path):
    out = launch(1, dict(scenario="offload", model=str(qwen_05b), num_samples=8, vocab=QWEN25_05B["vocab"],
                         prompt=(32, 64), response=(32, 64), overrides=CUDA, ckpt=str(tmp_path / "ckpt")), tmp_path)
    print(f"\noffload: {out['held'] / 2**30:.2f} GiB held -> {out['offloaded'] / 2**30:.2f} GiB; "
          f"grad norm of the step after onload {out['grad_norm_after_onload']:.4g}")
    assert out["offloaded"] < 0.1 * out["held"]
    assert out["same_log_probs"]
    assert out["grad_norm_after_onload"] > 0 and out["step_changed_log_probs"]
    # a save while offloaded writes the real weights and hands the memory back after
    assert out["saved_log_probs_match"] and out["offloaded_after_save"] < 0.1 * out["held"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_bf16_lora_tp2_matches_tp1_and_keeps_the_base(qwen_05b, tmp_path):
    spec = dict(scenario="lora", model=str(qwen_05b), num_samples=16, vocab=QWEN25_05B["vocab"], steps=3)
    common = CUDA + ["trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=1e-4", "algorithm.use_kl_loss=true",
                     "algorithm.kl_loss_coef=0.01", "trainer.megatron.recompute=true"]
    one = launch(1, {**spec, "overrides": common}, tmp_path)
    two = launch(2, {**spec, "overrides": common + ["parallel.tensor_model_parallel_size=2",
                                                      "cluster.actor_num_gpus_per_node=2"],
                     "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)
    print("\nLoRA TP=1 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in one["metrics"]])
    print("LoRA TP=2 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in two["metrics"]])
    assert one["base_unchanged"] and two["base_unchanged"]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * a["grad_norm"]
    assert one["metrics"][-1]["grad_norm"] > 0 and one["trained_log_probs"] != one["ref_log_probs"]
    assert two["resumed_metrics"] == two["metrics"][1:]


def test_grouped_experts_run_cutlass_grouped_gemm_in_bf16(tmp_path):
    """bf16 on sm90: the MoE layer's experts go through torch._grouped_mm (two calls: fc1, fc2) and
    agree with their per-expert loop (cuBLAS), empty experts included."""
    model = make_hf_model(tmp_path / "moe", "qwen3_moe", dtype=torch.bfloat16, hidden=128, vocab=256)
    counts = [37, 0, 5, 130, 1, 0, 64, 19]
    out = launch(1, dict(scenario="grouped_experts_kernel", model=str(model), counts=counts, overrides=CUDA), tmp_path)
    assert out["fits"] and (out["grouped_mm"]["calls"], out["per_expert"]["calls"]) == (2, 0)
    for name, a, b in zip(["output", "tokens", "probs", "fc1", "fc2"], out["grouped_mm"]["tensors"],
                          out["per_expert"]["tensors"], strict=True):
        scale = b.abs().max().item()
        print(f"{name}: max |grouped - per expert| {(a - b).abs().max().item():.2e} (max |per expert| {scale:.2e})")
        assert scale > 0 and (a - b).abs().max().item() <= 2e-2 * scale, name


def test_packed_varlen_attention_matches_the_per_sequence_path(qwen_05b, tmp_path):
    """bf16, packed micro-batches of RL-like lengths (many short samples, a few long ones): one flash
    varlen call per layer gives the per-sequence SDPA path's log-probs before and after a GRPO step."""
    packed = CUDA + ["trainer.max_tokens_per_gpu=4096", "trainer.lr=1e-5"]
    out = launch(1, dict(scenario="packed_kernels", model=str(qwen_05b), num_samples=48, vocab=QWEN25_05B["vocab"],
                         prompt=(8, 64), response=(2, 700), kernels=["per_sequence", "varlen"], overrides=packed),
                 tmp_path)
    reference, varlen = out["per_sequence"], out["varlen"]
    for when in ("before", "after"):
        diff = torch.cat([(torch.tensor(a) - torch.tensor(b)).abs() for a, b in
                          zip(reference[when], varlen[when], strict=True)])
        print(f"\nlog-probs {when} the step, |varlen - per sequence|: mean {diff.mean():.2e}, max {diff.max():.2e}"
              f" over {diff.numel()} tokens")
        assert diff.mean() < 1e-2 and diff.max() < 0.25
    a, b = reference["metrics"], varlen["metrics"]
    print(f"loss {a['loss']:.5f} vs {b['loss']:.5f}; grad norm {a['grad_norm']:.4f} vs {b['grad_norm']:.4f}")
    assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(1.0, abs(a["loss"]))
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * a["grad_norm"]


@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_varlen_chunks_match_causal_varlen(size):
    """Context parallelism's CUDA path on one GPU: each simulated CP rank's query chunks over the gathered K/V
    in one flash varlen call (bottom-right causal: fewer queries than keys) give what one causal varlen call
    over the whole packed sequences gives (CP=1), forward and backward, bf16, GQA, Qwen2.5-1.5B's head shape."""
    from test_megatron_context_parallel import simulated_ranks_attention

    from slime_rl.trainer_megatron import attention

    if attention._varlen_function() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths, heads, kv_heads, dim = [3, 2049, 517, 4000, 96], 12, 2, 128
    t, scale = sum(lengths), dim ** -0.5

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()

    query, key, value = rand(t, heads, dim), rand(t, kv_heads, dim), rand(t, kv_heads, dim)
    grad_out = torch.randn(t, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    whole = attention.varlen_causal(query, key, value, attention.packed_seq_params(lengths), scale)
    chunked = simulated_ranks_attention(query, key, value, lengths, size, scale, use_varlen=True)
    expected = torch.autograd.grad(whole, (query, key, value), grad_out)
    got = torch.autograd.grad(chunked, (query, key, value), grad_out)
    for name, a, b in [("out", chunked, whole), *zip(("dq", "dk", "dv"), got, expected, strict=True)]:
        diff, top = (a.float() - b.float()).abs().max().item(), b.float().abs().max().item()
        print(f"\nCP={size} varlen chunks vs CP=1 varlen, {name}: max |diff| {diff:.2e} (max |CP=1| {top:.2e})")
        assert diff <= 2e-2 * top, name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_bf16_context_parallel_train_steps_match_one_gpu(qwen_05b, tmp_path):
    """CP=2 over NCCL (varlen chunks, K/V all-gather, reduce-scatter backward) against one GPU, bf16, packed."""
    spec = dict(model=str(qwen_05b), num_samples=16, vocab=QWEN25_05B["vocab"], ref=True, steps=3,
                prompt=(64, 128), response=(64, 1024), short_first=[1, 2])
    common = CUDA + ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01", "trainer.lr=1e-5",
                     "trainer.max_tokens_per_gpu=4096"]
    one = launch(1, {**spec, "overrides": common}, tmp_path)
    two = launch(2, {**spec, "overrides": common + ["parallel.context_parallel_size=2",
                                                      "cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    print("\nCP=1 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in one["metrics"]])
    print("CP=2 bf16 (loss, grad_norm):", [(round(m["loss"], 5), round(m["grad_norm"], 4)) for m in two["metrics"]])
    assert two["peers_agree"]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(1.0, abs(a["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * a["grad_norm"]
