"""Synchronous, one step off and fully async: the same long-tail work through the real loop in each mode.

    python benchmarks/async_speedup.py                                  # the H200 run: one GPU shared, no offload
    python benchmarks/async_speedup.py --gpus 2                         # trainer on one GPU, the engine on the other
    python benchmarks/async_speedup.py --modes fully --kill-engine-after 20   # SIGKILL the SGLang server mid-run
    python benchmarks/async_speedup.py --device cpu --engine hf --shape tiny --groups 8 --batch 2 --samples 2 \\
        --prompt-len 8 --median-len 4 --max-len 32                      # the CPU smoke test

The work: ``--groups`` prompt groups of ``--samples`` samples, ``--batch`` groups a step, on a random model of
``--shape`` (made on the spot, with a local tokenizer). Every prompt has its own response length, drawn from a
lognormal long tail (median ``--median-len``, log-sd ``--sigma``, at most ``--max-len``; the quantiles of the
distribution, shuffled, so every mode and every run gets the same lengths): ``long_tail_generate`` (this file's
``rollout.generate_fn``) asks the engine for exactly that many tokens with eos ignored. The run refuses a
distribution whose p99/p50 is under 8.

Each mode runs `slime_rl.core.run.loop.train` (Megatron trainer, ``--engine`` rollout) from scratch: ``off``
(rollout, train, sync in turn), ``one_step`` (rollout k+1 during training on k) and ``fully`` (the engine
generates all the time, ``--in-flight`` groups at most, weights land mid-request; ``--max-staleness`` versions
at most). On one GPU (``--gpus 1``) trainer and engine share it, both resident (``colocate: true,
offload: false``); with ``--gpus 2`` they are apart (``colocate: false``).

Figures, per mode:
- wall s: from the loop's start notice (every actor built, before the first rollout) to its last step's notice;
  startup is not counted.
- trained tok/s: response tokens of the trained batches (the steps' ``rollout/tokens``, summed) / wall.
- engine busy: the share of the wall time in which at least one sample was generating
  (``rollout/engine_busy_total_s``, the rollout runner's clock, at the last step; in ``fully`` generation of
  groups that are not trained counts too).
- trainer busy: the loop's ``time/prepare`` + ``time/train`` phase timings (log-probs, advantages, the
  optimizer step), summed over the steps / wall. Weight sync (``time/weight_sync``) is shown on its own.

``--kill-engine-after S``: S seconds after the start notice, every SGLang server of the run (found by its
``--model-path``) is SIGKILLed with its process group; the run must complete and count the restart
(``engine/restarts`` in the step metrics), else the script exits 1. ``--kill-engine-at-step N`` kills at the
N-th step's notice instead: the same point of the run on any machine, so the run can be sized to end soon
after (the CPU test's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

MODES = ("off", "one_step", "fully")
MIN_TAIL_RATIO = 8.0  # p99 / p50 of the response lengths


async def long_tail_generate(sample, params, engine):
    """``rollout.generate_fn``: the default single-turn generate, with this prompt's own length
    (``metadata.max_new_tokens``) and eos ignored, so the lengths are the benchmark's, not the model's."""
    from slime_rl.core.run.rollout import generate_single_turn

    length = int(sample.metadata["max_new_tokens"])
    return await generate_single_turn(sample, replace(params, max_new_tokens=length, ignore_eos=True), engine)


def long_tail_lengths(count: int, median: int, sigma: float, cap: int, seed: int = 0) -> list[int]:
    """``count`` lengths: the lognormal's quantiles at (i + 0.5) / count, capped, in a seeded random order."""
    normal = statistics.NormalDist()
    lengths = [max(1, min(cap, round(median * 2.718281828459045 ** (sigma * normal.inv_cdf((i + 0.5) / count)))))
               for i in range(count)]
    random.Random(seed).shuffle(lengths)
    return lengths


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def write_long_tail_prompts(path: Path, folder: Path, lengths: list[int], prompt_len: int) -> Path:
    """Random ``prompt_len``-token prompts, one per length, each carrying its ``max_new_tokens``."""
    from colocated_step import write_prompts  # a sibling script

    write_prompts(path, folder, len(lengths), prompt_len)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "metadata": {"max_new_tokens": n}}) + "\n"
                            for r, n in zip(records, lengths, strict=True)))
    return path


@dataclass
class ModeResult:
    mode: str
    rows: list[dict[str, Any]]
    wall_s: float
    trained_tokens: float
    engine_busy_s: float
    trainer_busy_s: float
    sync_s: float
    restarts: float
    killed: list[int] = field(default_factory=list)  # pids of the SGLang servers killed mid-run

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / self.wall_s


def run_config(args, mode: str, folder: Path, prompts: Path, run_dir: Path) -> dict[str, Any]:
    on_cuda = args.device == "cuda"
    engine_args: dict[str, Any] = {}
    if on_cuda:
        from colocated_step import GPU_ENGINE_ARGS

        engine_args = dict(GPU_ENGINE_ARGS, mem_fraction_static=args.mem_fraction)
    rollout: dict[str, Any] = {
        "engine": args.engine, "max_response_len": args.max_len, "temperature": 1.0,
        "reward": "exact_match", "generate_fn": "async_speedup:long_tail_generate"}
    if args.engine == "sglang":  # rollout.sglang: the server flags, the interpreter
        rollout["sglang"] = {"server_args": engine_args, **({"engine_python": args.engine_python} if args.engine_python
                                                            else {})}
    if mode == "fully":
        rollout.update(max_staleness=args.max_staleness, over_sampling_batch_size=args.in_flight or 2 * args.batch)
    cluster: dict[str, Any] = {"device": args.device, "async_mode": mode, "actor_num_gpus_per_node": 1}
    if args.gpus == 2:
        cluster.update(colocate=False, rollout_num_gpus=1)
    else:
        cluster.update(colocate=True, offload=False)  # one device, both resident: the modes can overlap
    return {
        "model": {"path": str(folder), "dtype": "bfloat16" if on_cuda else "float32"},
        # one pass over the groups, not num_rollout steps: with num_rollout the data cycles, and fully async would
        # run ahead into the next pass and train its short groups in place of this pass's long ones
        "data": {"prompt_data": str(prompts), "rollout_batch_size": args.batch, "n_samples_per_prompt": args.samples,
                 "num_epoch": 1},
        "rollout": rollout,
        "trainer": {"backend": "megatron", "lr": 1e-6},
        "cluster": cluster,
        "logging": {"dir": str(run_dir), "tensorboard": False, "progress_bar": False},
    }


def sglang_server_groups(model_folder: Path) -> list[int]:
    """The process groups of the SGLang servers serving ``model_folder`` (each server leads its own)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--model-path" in cmd and str(model_folder) in cmd:
            try:
                if os.getpgid(proc.info["pid"]) == proc.info["pid"]:
                    found.append(proc.info["pid"])
            except ProcessLookupError:
                continue
    return found


def run_mode(args, mode: str, folder: Path, prompts: Path, work: Path) -> ModeResult:
    from slime_rl.core.config import Config
    from slime_rl.core.run.loop import train

    marks: dict[str, float] = {}
    killed: list[int] = []
    kill_timer: threading.Timer | None = None

    def kill_engines() -> None:
        for pgid in sglang_server_groups(folder):
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
        print(f"[async_speedup] {mode}: SIGKILLed SGLang server group(s) {killed or 'none found'} at "
              f"{time.perf_counter() - marks['start']:.1f} s", flush=True)

    def callback(event: str, payload: dict[str, Any]) -> None:
        nonlocal kill_timer
        if event == "start":
            marks["start"] = time.perf_counter()
            if args.kill_engine_after is not None:
                kill_timer = threading.Timer(args.kill_engine_after, kill_engines)
                kill_timer.daemon = True
                kill_timer.start()
        elif event == "step":
            marks["last_step"] = time.perf_counter()
            if payload["step"] == args.kill_engine_at_step and not killed:
                kill_engines()

    summary = train(Config.model_validate(run_config(args, mode, folder, prompts, work / f"run-{mode}")), callback)
    if kill_timer is not None:
        kill_timer.cancel()
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]  # trained steps (an eval row has no step time)
    if not rows:
        raise RuntimeError(f"{mode}: no step trained ({summary})")
    return ModeResult(
        mode=mode, rows=rows, wall_s=marks["last_step"] - marks["start"],
        trained_tokens=sum(r["rollout/tokens"] for r in rows),
        engine_busy_s=rows[-1]["rollout/engine_busy_total_s"],
        trainer_busy_s=sum(r.get("time/prepare", 0.0) + r.get("time/train", 0.0) for r in rows),
        sync_s=sum(r.get("time/weight_sync", 0.0) for r in rows),
        restarts=max(r.get("engine/restarts", 0.0) for r in rows), killed=killed)


def table(results: list[ModeResult]) -> list[str]:
    lines = ["| mode | steps | wall s | trained tok/s | engine busy | trainer busy | sync s | staleness max |"
             " dropped stale | engine restarts |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        stale = max(row.get("staleness/max", 0.0) for row in r.rows)
        dropped = r.rows[-1].get("fully_async/dropped_stale_total", 0.0)
        lines.append(f"| {r.mode} | {len(r.rows)} | {r.wall_s:.1f} | {r.tokens_per_s:.0f} | "
                     f"{100 * r.engine_busy_s / r.wall_s:.0f}% | {100 * r.trainer_busy_s / r.wall_s:.0f}% | "
                     f"{r.sync_s:.1f} | {stale:.0f} | {dropped:.0f} | {r.restarts:.0f} |")
    by_mode = {r.mode: r for r in results}
    if "fully" in by_mode:
        for other in ("off", "one_step"):
            if other in by_mode:
                lines.append(f"speedup fully/{other}: {by_mode['fully'].tokens_per_s / by_mode[other].tokens_per_s:.2f}x"
                             " (trained tokens/s)")
    return lines


def main(argv: list[str] | None = None) -> list[ModeResult]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--groups", type=int, default=48, help="prompt groups in all (the same work in every mode)")
    parser.add_argument("--batch", type=int, default=8, help="groups per step (data.rollout_batch_size)")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--median-len", type=int, default=48, help="median response length")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-sd of the lengths (p99/p50 = e^(2.33 sigma))")
    parser.add_argument("--max-len", type=int, default=1024, help="longest response (rollout.max_response_len)")
    parser.add_argument("--max-staleness", type=int, default=2, help="fully: rollout.max_staleness")
    parser.add_argument("--in-flight", type=int, default=0, help="fully: groups generating at once; 0: 2 x batch")
    parser.add_argument("--gpus", type=int, default=1, choices=[1, 2])
    parser.add_argument("--engine", default="sglang", choices=["sglang", "hf"])
    parser.add_argument("--engine-python", default=None, help="interpreter that runs sglang.launch_server")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mem-fraction", type=float, default=0.4, help="SGLang --mem-fraction-static")
    kill = parser.add_mutually_exclusive_group()
    kill.add_argument("--kill-engine-after", type=float, default=None, help="seconds after the start notice")
    kill.add_argument("--kill-engine-at-step", type=int, default=None, help="at the notice of this step")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.groups % args.batch:
        parser.error(f"--groups {args.groups} is not a multiple of --batch {args.batch}")

    here = str(Path(__file__).parent)
    sys.path.insert(0, here)  # the sibling scripts, and this module for the rollout worker's generate_fn:
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])  # Ray's too
    from weight_sync import make_model_folder, param_count_of

    lengths = long_tail_lengths(args.groups, args.median_len, args.sigma, args.max_len)
    p50, p99 = percentile(lengths, 0.5), percentile(lengths, 0.99)
    if p99 / p50 < MIN_TAIL_RATIO:
        parser.error(f"the lengths' p99/p50 is {p99 / p50:.1f}, under {MIN_TAIL_RATIO:g}: raise --sigma or --max-len")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="async-speedup-"))
    folder = make_model_folder(args.shape, work / "model", weights=True)
    prompts = write_long_tail_prompts(work / "prompts.jsonl", folder, lengths, args.prompt_len)
    print(f"[async_speedup] {args.shape} ({param_count_of(folder) / 1e9:.2f}B), {args.groups} groups x "
          f"{args.samples} samples, {args.batch} groups a step; response lengths p50 {p50:.0f}, p99 {p99:.0f} "
          f"(p99/p50 {p99 / p50:.1f}), max {max(lengths)}, {sum(lengths) * args.samples} tokens in all; "
          f"{args.gpus} GPU(s) on {args.device}", flush=True)
    results = []
    for mode in args.modes:
        results.append(run_mode(args, mode, folder, prompts, work))
        print(f"[async_speedup] {mode}: {results[-1].wall_s:.1f} s", flush=True)
    print("\n".join(table(results)), flush=True)
    if args.json:
        args.json.write_text(json.dumps([{**r.__dict__, "tokens_per_s": r.tokens_per_s} for r in results], indent=1))
    if args.kill_engine_after is not None or args.kill_engine_at_step is not None:
        failed = [r.mode for r in results if not r.killed or r.restarts < 1]
        print(f"engine kill: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}: "
              + "; ".join(f"{r.mode}: killed {r.killed}, engine/restarts {r.restarts:.0f}" for r in results)
              + ("; no server found to kill, or the run ended before a step's metrics showed the restart: kill"
                 " earlier or give more --groups" if failed else ""), flush=True)
        if failed:
            sys.exit(1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
