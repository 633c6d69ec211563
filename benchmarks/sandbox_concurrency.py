"""Do sandboxed tool calls starve the rollout? (issue 18: "64 sandboxed calls queued at once do not
starve the rollout: with the default sandbox concurrency, the rollout's step time on this 2-core
machine stays within 1.5x of the same step without tool calls' CPU cost").

One rollout step of ``--samples`` two-turn trajectories, in one event loop as the rollout worker
runs them: each sample generates a first turn (HF engine, CPU), calls the ``python`` tool, and
generates a second turn on the prompt + first turn + observation. First turns have one length and
finish together, so all ``--samples`` tool calls are queued at once; second turns vary per sample
(seeded). Two variants of the same step (same prompts, lengths, seeds):

- free: the tool returns the observation at once (the step without the tool calls' CPU cost);
- sandbox: the tool runs the code in the sandbox (core/sandbox) at ``--concurrency`` calls at once
  (default: the sandbox's default, one per core).

Variants alternate over ``--rounds`` rounds (the machine is shared; the median and each round are
printed). Target: sandbox / free <= 1.5.

    .venv/bin/python benchmarks/sandbox_concurrency.py [--samples 64] [--rounds 3] [--concurrency N]
        [--model builtin:smollm2-135m-instruct | PATH]   # default: a random 4-layer Qwen2 (hidden 256)
        [--hidden 256] [--layers 4]                      # the random model's size
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sandbox import SandboxSettings, arun_python, isolation_support, make_python_tool
from slime_rl.core.sandbox.settings import default_concurrency

TOOL_CODE = "import math\nprint(sum(math.isqrt(i) for i in range(20000)))"  # a small computation, like a model's
TARGET = 1.5


def build_engine(model: str | None, workdir: Path, threads: int, hidden: int = 256, layers: int = 4):
    from slime_rl.rollout_hf.engine import HFEngine

    if model is None:
        from slime_rl.core.testing import tiny_model_folder

        folder = tiny_model_folder(workdir / "model", hidden_size=hidden, num_layers=layers, num_heads=4)
    else:
        from slime_rl.core.config.builtin_models import resolve_model_path

        folder = resolve_model_path(model)
    return HFEngine.from_pretrained(folder, dtype="float32", device="cpu", num_threads=threads)


def trajectories(samples: int, first_turn: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """(prompt ids, first-turn tokens, second-turn tokens) per sample; the same in both variants."""
    rng = random.Random(seed)
    return [([rng.randrange(5, 1000) for _ in range(rng.randrange(16, 48))], first_turn,
             rng.randrange(8, 48)) for _ in range(samples)]


async def rollout_step(engine, plan, tool, observation_ids: list[int]) -> tuple[float, int]:
    """Wall seconds for the whole step, and the most tool calls that were waiting or running at once."""
    in_tool = most = 0

    async def one(prompt: list[int], first: int, second: int, k: int) -> None:
        nonlocal in_tool, most
        out = await engine.generate(prompt, SamplingParams(max_new_tokens=first, ignore_eos=True, seed=k))
        in_tool += 1
        most = max(most, in_tool)
        await tool(TOOL_CODE)
        in_tool -= 1
        context = prompt + out.token_ids + observation_ids
        await engine.generate(context, SamplingParams(max_new_tokens=second, ignore_eos=True, seed=k + 10_000))

    start = time.perf_counter()
    await asyncio.gather(*(one(p, a, b, k) for k, (p, a, b) in enumerate(plan)))
    return time.perf_counter() - start, most


async def measure(args: argparse.Namespace, engine) -> list[tuple[float, float, int]]:
    settings = SandboxSettings(max_concurrency=args.concurrency)
    sandboxed = make_python_tool(settings)
    observation = (await arun_python(TOOL_CODE, settings)).observation()

    async def free(code: str) -> str:
        return observation

    observation_ids = [ord(c) % 1000 for c in observation]
    plan = trajectories(args.samples, args.first_turn)
    await rollout_step(engine, plan[:4], free, observation_ids)  # warm up the engine
    rounds = []
    for r in range(args.rounds):
        order = [("free", free), ("sandbox", sandboxed)] if r % 2 == 0 else [("sandbox", sandboxed), ("free", free)]
        times = {}
        for name, tool in order:
            times[name], most = await rollout_step(engine, plan, tool, observation_ids)
            if name == "sandbox":
                queued = most
        rounds.append((times["free"], times["sandbox"], queued))
        print(f"round {r + 1}: free {times['free']:.2f} s, sandbox {times['sandbox']:.2f} s,"
              f" ratio {times['sandbox'] / times['free']:.2f} (up to {queued} calls queued at once)", flush=True)
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-turn", type=int, default=48, help="tokens of every first turn")
    parser.add_argument("--concurrency", type=int, default=None, help="sandbox calls at once (default: the default)")
    parser.add_argument("--model", default=None, help="an HF folder or builtin:<name>; default a random tiny Qwen2")
    parser.add_argument("--hidden", type=int, default=256, help="the random model's hidden size")
    parser.add_argument("--layers", type=int, default=4, help="the random model's layers")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="torch threads of the engine (1: on a shared 2-core machine more threads only contend)")
    args = parser.parse_args()
    support = isolation_support()
    concurrency = args.concurrency or default_concurrency()
    print(f"sandbox: isolation {support.level} ({support.reason}); concurrency {concurrency}"
          f"{' (the default)' if args.concurrency is None else ''}; {os.cpu_count()} cores;"
          f" engine threads {args.engine_threads}")
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args.model, Path(tmp), args.engine_threads, args.hidden, args.layers)
        rounds = asyncio.run(measure(args, engine))
    free = statistics.median(r[0] for r in rounds)
    sandbox = statistics.median(r[1] for r in rounds)
    ratio = statistics.median(r[1] / r[0] for r in rounds)
    print()
    print("| samples | tool calls queued at once | concurrency | step, free tool (s) | step, sandboxed tool (s) |"
          " ratio (median) | target |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.samples} | {max(r[2] for r in rounds)} | {concurrency} | {free:.2f} | {sandbox:.2f} |"
          f" {ratio:.2f} ({', '.join(f'{r[1] / r[0]:.2f}' for r in rounds)}) | <= {TARGET} |")


if __name__ == "__main__":
    main()
