"""HFEngine generation speed for the CPU demo's rollout: 4 prompts x 8 samples, temperature 1, 8 new tokens.

    .venv/bin/python packages/rollout-hf/benchmarks/generate_speed.py [--model PATH] [--threads 1 2] [--repeats 7]

Prints one row per torch thread count: the median and best wall time of one rollout wave.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from slime_rl.core.config.builtin_models import resolve_model_path
from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_hf.engine import HFEngine

QUESTIONS = [(3, 4), (17, 25), (41, 9), (12, 38)]


async def one_wave(engine: HFEngine, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int):
    params = [SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed + i) for i in range(len(prompts) * n)]
    requests = [p for p in prompts for _ in range(n)]
    return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(requests, params, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    path = resolve_model_path(args.model)  # builtin: -> the HF folder converted once
    engine = HFEngine.from_pretrained(path, device="cpu")
    prompts = [engine.tokenizer(f"Question: What is {a} + {b}?\nAnswer:").input_ids for a, b in QUESTIONS]

    rows = []
    for threads in args.threads:
        engine.num_threads = threads
        times, tokens = [], 0
        for r in range(args.repeats + 1):
            start = time.perf_counter()
            outputs = asyncio.run(one_wave(engine, prompts, args.n, args.max_new_tokens, seed=1000 * r))
            if r > 0:  # the first wave warms up the allocator
                times.append(time.perf_counter() - start)
                tokens += sum(len(o.token_ids) for o in outputs)
        rows.append((threads, statistics.median(times), min(times), tokens / len(times), tokens / sum(times)))

    print(f"\nHFEngine, {len(prompts)} prompts x {args.n} samples, temperature 1, max_new_tokens {args.max_new_tokens}, "
          f"fp32 CPU, {args.repeats} waves")
    print(f"{'threads':>7} | {'median s':>8} | {'best s':>6} | {'tokens/wave':>11} | {'tokens/s':>8}")
    for threads, median, best, tokens, rate in rows:
        print(f"{threads:>7} | {median:>8.3f} | {best:>6.3f} | {tokens:>11.0f} | {rate:>8.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
