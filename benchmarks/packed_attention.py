"""One layer's causal attention over a packed micro-batch, forward and backward, by each kernel the
trainer can use (trainer_megatron/attention.py) and by flex_attention with a document mask: the
measurement `trainer.megatron.packed_attention: auto` is chosen by.

    python benchmarks/packed_attention.py --device cuda        # the H200: bf16, every kernel
    python benchmarks/packed_attention.py --device cpu --dtype float32 --threads 1

Rows: SmolLM2-135M's heads (9 query / 3 KV of 64) on the real-model run's micro-batch (128 x ~40
tokens) and on a long tail (32 samples of 50-4,000 tokens); Qwen2.5-1.5B's (12 / 2 of 128) on an
RL mix (128 samples, responses log-normal up to 8k). Each kernel's output and input gradients are
compared with the per-sequence path's (max |difference|). flex_attention's block mask is built once per
micro-batch, outside the timing, as a trainer would share it across the layers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}


def workloads(seed: int = 0) -> list[tuple[str, str, list[int]]]:
    rng = random.Random(seed)
    short = [rng.randint(36, 44) for _ in range(128)]
    tail = [rng.randint(50, 4000) for _ in range(32)]
    mix = [rng.randint(100, 500) + min(8192, int(rng.lognormvariate(5.5, 1.2))) for _ in range(128)]
    return [("smollm2-135m", "128 x ~40", short), ("smollm2-135m", "32 x 50-4,000", tail),
            ("qwen2.5-1.5b", "RL mix 128, to 8k", mix)]


def attention_layer(heads: int, kv_heads: int, dim: int, kernel: str, dtype: torch.dtype):
    """The trainer's SDPAttention for one layer of these heads, ``kernel`` forced (Megatron's parallel
    state initialised for one process first: ``init_megatron``)."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_rl.trainer_megatron.attention import SDPAttention
    from slime_rl.trainer_megatron.model import HFModelShape, transformer_config

    shape = HFModelShape(family="llama", architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=heads * dim,
                         intermediate_size=4 * heads * dim, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=dim, rms_norm_eps=1e-6, rope_theta=1e4, rope_type="default",
                         max_position_embeddings=32768, tie_word_embeddings=True, qkv_bias=False, qk_norm=False)
    config = transformer_config(shape, tp=1, pp=1, dtype=dtype, packed_attention=kernel)
    attn = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return lambda q, k, v, params: attn(q, k, v, None, packed_seq_params=params)


def init_megatron(device_type: str) -> None:
    import os

    from megatron.core import parallel_state

    from slime_rl.trainer_megatron import device as dev

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device_type == "cpu":
        dev.redirect_megatron_to_cpu()
    dev.init_distributed(device_type)
    parallel_state.initialize_model_parallel()


def flex_document_attention(heads: int, kv_heads: int):
    """flex_attention with a causal document mask over the packed row (compiled), or None without it."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}  # a trainer builds a micro-batch's mask once for all its layers: built here once per workload

    def block_mask(params, device):
        key = (params.seq_lens, device)
        if key not in masks:
            document = torch.repeat_interleave(torch.arange(len(params.seq_lens), device=device),
                                               torch.tensor(params.seq_lens, device=device))

            def causal_document(b, h, q_idx, kv_idx):
                return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

            tokens = sum(params.seq_lens)
            masks.clear()  # one workload's at a time (uncompiled, the build holds tokens^2 booleans)
            masks[key] = create_block_mask(causal_document, None, None, tokens, tokens, device=device)
        return masks[key]

    def run(q, k, v, params):
        mask = block_mask(params, q.device)
        out = compiled(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), block_mask=mask,
                       enable_gqa=heads != kv_heads)
        return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], -1)

    return run


def time_kernel(fn, q, k, v, params, repeats: int, sync) -> tuple[float, list[torch.Tensor]]:
    def once():
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*xs, params)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(x.grad for x in xs)]

    result = once()  # warm-up (compilation, kernel selection)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-flex", action="store_true", help="leave flex_attention out (it compiles first)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from slime_rl.trainer_megatron.attention import packed_seq_params, varlen_applies

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    init_megatron(device.type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"## packed attention, one layer forward + backward, {args.device} {args.dtype}, median of {args.repeats}")
    print("| heads q/kv x dim | micro-batch | tokens | kernel | ms | x per-sequence | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for shape, label, lengths in workloads():
        heads, kv_heads, dim = SHAPES[shape]
        params = packed_seq_params(lengths)
        total = sum(lengths)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(total, h, dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads))
        kernels = {name: attention_layer(heads, kv_heads, dim, name, dtype) for name in ("per_sequence", "padded")}
        if varlen_applies(q, 0.0):
            kernels["varlen"] = attention_layer(heads, kv_heads, dim, "varlen", dtype)
        if device.type == "cuda" and not args.no_flex and (flex := flex_document_attention(heads, kv_heads)):
            kernels["flex"] = flex
        baseline_ms, reference = None, None
        for name, fn in kernels.items():
            try:
                seconds, result = time_kernel(fn, q, k, v, params, args.repeats, sync)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                print(f"| {heads}/{kv_heads} x {dim} | {label} | {total} | {name} | failed: {str(e)[:80]} | | |")
                continue
            ms = seconds * 1e3
            if reference is None:
                baseline_ms, reference = ms, result
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(result, reference, strict=True))
            print(f"| {heads}/{kv_heads} x {dim} | {label} | {total} | {name} | {ms:.2f} | {baseline_ms / ms:.1f}x"
                  f" | {diff:.2e} |")


if __name__ == "__main__":
    main()
