"""Peak memory of the trainer's log-prob head for one long response: the chunked head of
trainer_megatron/logprobs.py with the entropy and the trainer's loss (PPO surrogate, KL to the reference,
entropy bonus), forward and backward, against what full logits would hold (not run: N x V x 4 bytes for
the fp32 logits alone, before the log-softmax and the gradient that each take as much again).

Each length runs in a fresh process; the figure is the peak beyond the inputs (hidden states, output
layer and their gradients): on the CPU the process's peak RSS over its RSS before the pass, on CUDA
torch's peak allocation over the allocation before it.

    python benchmarks/long_logprobs_memory.py                       # CPU: hidden 16, Qwen2.5's 151,936 vocab
    python benchmarks/long_logprobs_memory.py --device cuda --hidden 1536 --dtype bfloat16   # a 1.5B head
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def probe(args) -> dict:
    import torch

    from slime_rl.core.algorithms.losses import LossBatch, compute_loss
    from slime_rl.core.config import AlgorithmConfig
    from slime_rl.trainer_megatron import device, logprobs

    torch.set_num_threads(args.threads)
    import os
    import socket

    with socket.socket() as s:  # one rank of its own
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    if args.device == "cpu":
        device.redirect_megatron_to_cpu()
    device.init_distributed(args.device)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    hidden = torch.randn(n, args.hidden, generator=g).to(dev, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (n,), generator=g).to(dev)
    old, ref, adv = (torch.randn(1, n, generator=g).to(dev) * s for s in (0.1, 0.1, 1.0))
    mask = torch.ones(1, n, device=dev)
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    # the gradients' own memory is the inputs', not the head's: allocated before the baseline
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
    start = time.perf_counter()
    logp, entropy = logprobs.token_log_probs(hidden, weight, targets, with_entropy=True)
    batch = LossBatch(log_probs=logp[None] - 0 * old, old_log_probs=old - 1.0, advantages=adv, loss_mask=mask,
                      ref_log_probs=ref - 1.0, entropy=entropy[None])
    loss, _ = compute_loss(algo, batch, eps_clip_high=0.2, num_tokens=float(n), num_seqs=1.0)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"tokens": n, "peak_bytes": peak, "seconds": time.perf_counter() - start,
            "chunk_tokens": logprobs.chunk_tokens(args.vocab, device_type=dev.type), "loss": float(loss)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16384,32768,65536")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)  # one probe, in this process
    args = p.parse_args(argv)
    if args.tokens:
        print(json.dumps(probe(args)))
        return
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--tokens", str(n)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"probe at {n} tokens failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n## log-prob head with entropy and loss, forward + backward: {args.device}, {args.dtype},"
          f" vocab {args.vocab:,}, hidden {args.hidden}")
    print("| response tokens | chunk (tokens) | peak beyond inputs | fp32 full logits alone | seconds |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        naive = r["tokens"] * args.vocab * 4
        print(f"| {r['tokens']:,} | {r['chunk_tokens']:,} | {r['peak_bytes'] / MiB:,.0f} MiB |"
              f" {naive / MiB:,.0f} MiB | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
