"""Issue 36: the Megatron trainer on single samples of 32k and 64k tokens (a reasoning model's long
responses), one GPU: seconds, tokens/s, MFU and peak memory of an RL update.

Each row is one optimizer step over ``--samples`` samples of ``length`` tokens (``--prompt-len`` of
prompt, the rest response, random tokens, one N(0, 1) advantage each), after ``--warmup`` steps:
``compute_log_probs`` (the old policy's pass) then ``train_step`` (forward, backward, Adam), each
sample its own micro-batch (``trainer.max_tokens_per_gpu`` = the length). The model is a random
model of ``--shape`` whose positions cover the longest length (max_position_embeddings =
``--positions``, default the longest length), so the trainer's position check and RoPE see a model
built for it, as SGLang would.

Memory: the allocator's peak during the step (``torch.cuda.max_memory_allocated``), and what the
weights, gradients and Adam's state hold between steps; on the CPU, the process's peak RSS.
``--recompute full`` (the default) recomputes each layer's activations in backward
(``trainer.megatron.recompute: true``), what makes 64k tokens fit; ``none`` shows what they cost.

    python benchmarks/long_sample_train.py --device cuda --shape qwen2.5-1.5b --lengths 32768 65536

MFU counts the model's FLOPs (6 x parameters + attention per token), not the recomputed forward.
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
from pathlib import Path

import torch
from trainer_throughput import (
    SHAPES,
    init_single_rank,
    make_model,
    megatron_batch,
    model_flops,
    samples_of_lengths,
    timed,
)


def long_trainer(model_dir: Path, args, length: int):
    from slime_rl.core.config import load_config
    from slime_rl.core.config.positions import check_positions
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    init_single_rank()
    overrides = [f"model.path={model_dir}", f"cluster.device={args.device}", f"model.dtype={args.dtype}",
                 "trainer.lr=1e-6", "trainer.micro_batch_size=1", f"trainer.max_tokens_per_gpu={length}",
                 f"trainer.megatron.recompute={'true' if args.recompute == 'full' else 'false'}",
                 f"rollout.max_prompt_len={args.prompt_len}", f"rollout.max_response_len={length - args.prompt_len}"]
    cfg = load_config(None, overrides, check=False)  # no data: the samples are made here
    check_positions(cfg)  # the model's positions cover the sample, as `slime-cli train` checks
    return MegatronTrainer.from_config(cfg)


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one_length(args, model_dir: Path, length: int) -> dict:
    vocab = SHAPES[args.shape][1]
    samples = samples_of_lengths([args.prompt_len] * args.samples, [length - args.prompt_len] * args.samples,
                                 vocab, args.seed)
    batch = megatron_batch(samples)
    trainer = long_trainer(model_dir, args, length)
    times = []
    for it in range(args.warmup + args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()  # weights, grads, Adam state (after the first step)
            torch.cuda.reset_peak_memory_stats()
        lp_s, _ = timed(lambda: setattr(batch, "old_log_probs", trainer.compute_log_probs(batch)), args.device)
        tr_s, _ = timed(lambda: trainer.train_step(batch), args.device)
        if it >= args.warmup:
            times.append((lp_s, tr_s))
    lp_s, tr_s = min(times, key=lambda t: t[0] + t[1])
    tokens = length * args.samples
    flops = model_flops(args.shape, [length] * args.samples)
    row = dict(length=length, samples=args.samples, log_probs_s=lp_s, train_s=tr_s, train_tok_s=tokens / tr_s,
               mfu=flops / tr_s / (args.peak_tflops * 1e12) if args.peak_tflops else None,
               peak=peak_bytes(args.device), held=held if args.device == "cuda" else None)
    return row  # the trainer goes with this frame; main empties the cache before the next length


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536], help="tokens per sample")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--samples", type=int, default=1, help="samples per optimizer step, one micro-batch each")
    p.add_argument("--recompute", choices=["full", "none"], default="full")
    p.add_argument("--positions", type=int, default=None, help="the model's max_position_embeddings")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None, help="989 for an H200 (bf16 dense); CUDA default 989")
    p.add_argument("--model-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and args.peak_tflops is None:
        args.peak_tflops = 989.0
    if args.device == "cpu":
        torch.set_num_threads(1)
    if min(args.lengths) <= args.prompt_len:
        p.error(f"--lengths {min(args.lengths)} must be longer than --prompt-len {args.prompt_len}")
    positions = args.positions or max(args.lengths)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"slime-rl-long-{args.shape}-{positions}"
    make_model(args.shape, model_dir, positions=positions)

    rows = []
    for n in args.lengths:
        rows.append(one_length(args, model_dir, n))
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, 1 thread"
    print(f"\n## {args.shape} ({args.dtype}, positions {positions}) on {where}: recompute {args.recompute},"
          f" prompt {args.prompt_len} tokens, {args.samples} sample(s) a step, best of {args.steps}")
    print("| tokens per sample | compute_log_probs s | train_step s | train tokens/s | MFU | peak GiB | held GiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        held = f"{r['held'] / 2**30:.1f}" if r["held"] is not None else "-"
        print(f"| {r['length']:,} | {r['log_probs_s']:.2f} | {r['train_s']:.2f} | {r['train_tok_s']:.0f} | {mfu}"
              f" | {r['peak'] / 2**30:.1f} | {held} |")
    if args.device == "cpu":
        print("(peak: the process's peak RSS; held: CUDA only)")
    return rows


if __name__ == "__main__":
    main()
