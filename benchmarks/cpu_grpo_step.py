"""The CPU demo's step time by phase, and the peak memory of all its processes together.

Runs the configuration `slime-cli train` runs with no CONFIG (GRPO on SmolLM2-135M-Instruct
over addition problems: slime_rl.cli.default_run) through slime_rl.core.run.loop.train for --steps
steps, drops the first --warmup, and prints the median of each phase the loop times
(time/rollout, time/prepare, time/train, time/weight_sync, time/step; inside prepare, rank 0's
time/log_probs, time/ref_log_probs and time/advantages).

Memory: a thread sums the RSS of this process and all its descendants every 0.2 s (Ray's
GCS and raylet are children of this process, the trainer and engine actors the raylet's
children; checked against Ray's actor table at the start) and reports the peak over the
whole run (startup, evals, the final checkpoint save) and over the measured steps. RSS counts
shared pages once per process (the libraries every Python process maps, the object-store pages
both the trainer and the engine touch during weight sync), so the PSS sum (each shared page split
among its users) is printed next to it. The machine is shared: the CPU the other processes used
meanwhile is printed too, since it slows the steps.

    .venv/bin/python benchmarks/cpu_grpo_step.py [--steps 8] [--warmup 2] [key=value ...]

Targets on the 2-core CPU machine: median time/step <= 4.5 s, peak RSS sum <= 5 GiB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from slime_rl.cli.app import wire
from slime_rl.cli.default_run import prepare_default
from slime_rl.core.config import load_config
from slime_rl.core.config.cpu import cpu_info
from slime_rl.core.run.loop import train

STEP_TARGET_S = 4.5
RSS_TARGET_GIB = 5.0
PHASES = ("rollout", "prepare", "train", "wait_rollout", "weight_sync")  # one after the other: they add up
PREPARE_PARTS = ("log_probs", "ref_log_probs", "advantages")  # rank 0's parts of prepare
GIB = 1024**3
LORA_OVERRIDES = ("trainer.lora.rank=16", "trainer.lora.alpha=32", "trainer.lr=1e-4")  # examples/grpo_math_lora.yaml


@dataclass
class Peak:
    rss: int = 0
    pss: int = 0
    rss_at: str = ""
    rss_procs: list[tuple[str, int]] = field(default_factory=list)  # (name, RSS) at the RSS peak, largest first


@dataclass
class TreeMemory:
    """Samples the summed RSS (and, every 5th time, PSS) of a process and its descendants."""

    root: psutil.Process = field(default_factory=psutil.Process)
    interval_s: float = 0.2
    extra_pids: set[int] = field(default_factory=set)  # processes outside the tree to count too
    label: str = "startup"  # what the run is doing, set by the loop's callback
    in_steps: bool = False  # within the measured steps (set by the callback)
    run_peak: Peak = field(default_factory=Peak)
    steps_peak: Peak = field(default_factory=Peak)
    cpu_s: dict[int, tuple[float, float]] = field(default_factory=dict)  # pid -> (first, last) CPU seconds
    _stop: threading.Event = field(default_factory=threading.Event)

    def tree(self) -> list[psutil.Process]:
        procs = [self.root, *self.root.children(recursive=True)]
        seen = {p.pid for p in procs}
        procs += [psutil.Process(pid) for pid in self.extra_pids - seen if psutil.pid_exists(pid)]
        return procs

    def sample(self, with_pss: bool) -> None:
        rss, pss, named = 0, 0, []
        for proc in self.tree():
            try:
                with proc.oneshot():
                    mem = proc.memory_info().rss
                    times = proc.cpu_times()
                    named.append((proc.name(), mem))
                if with_pss:
                    pss += proc.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # it ended between listing and reading
            rss += mem
            first = self.cpu_s.get(proc.pid, (times.user + times.system,))[0]
            self.cpu_s[proc.pid] = (first, times.user + times.system)
        for peak in (self.run_peak, self.steps_peak) if self.in_steps else (self.run_peak,):
            if rss > peak.rss:
                peak.rss, peak.rss_at, peak.rss_procs = rss, self.label, sorted(named, key=lambda x: -x[1])
            peak.pss = max(peak.pss, pss)

    def run(self) -> None:
        count = 0
        while not self._stop.is_set():
            self.sample(with_pss=count % 5 == 0)
            count += 1
            self._stop.wait(self.interval_s)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join()

    def tree_cpu_s(self) -> float:
        return sum(last - first for first, last in self.cpu_s.values())


def ray_actor_pids() -> dict[int, str]:
    """pid -> class of each live Ray actor, from the GCS's actor table (the driver is connected)."""
    from ray._private import state  # the public state API needs the dashboard, which the loop leaves off

    return {info["Pid"]: info["ActorClassName"] for info in state.actors(actor_state_name="ALIVE").values()}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent busy since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps to run (data.num_rollout)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    parser.add_argument("--lora", action="store_true",
                        help=f"run it twice, full fine-tuning then LoRA ({' '.join(LORA_OVERRIDES)}), and compare")
    parser.add_argument("overrides", nargs="*", help="key=value changes to the demo configuration, as slime-cli takes")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    runs = [("full fine-tuning", measure(args, args.overrides))]
    if args.lora:
        runs.append(("LoRA", measure(args, [*args.overrides, *LORA_OVERRIDES])))
        print("\n## Full fine-tuning and LoRA side by side (medians of the measured steps)")
        print("| run | step s | train s | weight_sync s | peak RSS GiB, all processes | held-out pass@1 |")
        print("|---|---|---|---|---|---|")
        for label, r in runs:
            accuracy = [e.get("eval/addition/pass@1", float("nan")) for e in (r["eval_before"], r["eval_after"])]
            print(f"| {label} | {r['step']:.3f} | {r['train']:.3f} | {r['weight_sync']:.3f} | {r['rss_gib']:.2f} |"
                  f" {accuracy[0]:.3f} -> {accuracy[1]:.3f} |")


def measure(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """One run of the demo configuration with ``overrides``: prints its report, returns its medians."""

    with tempfile.TemporaryDirectory(prefix="cpu_grpo_step-") as tmp:
        workdir = args.workdir or Path(tmp)
        cfg = load_config(prepare_default(workdir), [*overrides, f"data.num_rollout={args.steps}"])
        wire(cfg)  # converts the built-in model's GGUF once; a no-op after that
        dtype_asked = cfg.model.dtype  # the loop resolves auto

        memory = TreeMemory()
        steps: list[dict[str, float]] = []
        checks: dict[str, Any] = {}

        def callback(event: str, payload: dict[str, Any]) -> None:
            if event == "start":
                checks["startup_s"] = payload["startup_s"]
                actors = ray_actor_pids()
                descendants = {p.pid for p in memory.root.children(recursive=True)}
                checks["actors"] = actors
                checks["outside"] = {pid: name for pid, name in actors.items() if pid not in descendants}
                memory.extra_pids |= set(checks["outside"])  # counted all the same
                memory.label = "eval before training"
            elif event == "eval" and payload["step"] == 0:
                memory.label = "step 1"
            elif event == "step":
                steps.append(payload["metrics"])
                k = payload["step"]
                memory.in_steps = args.warmup <= k < args.steps
                memory.label = f"step {k + 1}" if k < args.steps else "final eval, checkpoint save, shutdown"
                print(f"step {k}/{args.steps}: {payload['metrics']['time/step']:.2f} s", file=sys.stderr, flush=True)

        load_before = os.getloadavg()
        busy_before, wall_before = busy_cpu_s(), time.perf_counter()
        thread = memory.start()
        summary = train(cfg, callback=callback)
        memory.stop(thread)
        wall = time.perf_counter() - wall_before
        others_cores = max(0.0, busy_cpu_s() - busy_before - memory.tree_cpu_s()) / wall
        load_after = os.getloadavg()

    measured = steps[args.warmup:]
    d = cfg.data
    print(f"\n## CPU GRPO step: the demo configuration ({Path(cfg.model.path).name}, {d.rollout_batch_size} prompts"
          f" x {d.n_samples_per_prompt} samples, <= {cfg.rollout.max_response_len} new tokens, trainer"
          f" {cfg.trainer.backend}, engine {cfg.rollout.engine})")
    print(f"CPU: {cpu_info().describe()}; trained in {cfg.model.dtype} (model.dtype={dtype_asked});"
          f" recompute {cfg.trainer.megatron.recompute}; {torch.get_num_threads()} torch threads in the driver")
    print(f"steps {args.warmup + 1}-{len(steps)} of {len(steps)} (first {args.warmup} left out as warm-up);"
          f" startup {checks.get('startup_s', float('nan')):.1f} s; whole run {wall:.0f} s;"
          f" eval accuracy {summary.get('eval_before', {})} -> {summary.get('eval_after', {})}")
    print("| phase | median s | min s | max s | target |")
    print("|---|---|---|---|---|")
    for name in (*PHASES[:2], *PREPARE_PARTS, *PHASES[2:], "step"):
        values = [m[f"time/{name}"] for m in measured if f"time/{name}" in m]
        if not values:
            if name in ("rollout", "log_probs", "ref_log_probs", "train", "weight_sync"):
                print(f"| {name} | - | - | - | not run in this configuration |")
            continue
        label = f"prepare: {name}" if name in PREPARE_PARTS else name
        median = statistics.median(values)
        target = ""
        if name == "step":
            target = f"<= {STEP_TARGET_S} s: {'met' if median <= STEP_TARGET_S else 'MISSED'}"
        print(f"| {label} | {median:.3f} | {min(values):.3f} | {max(values):.3f} | {target} |")
    other = [m["time/step"] - sum(m.get(f"time/{p}", 0.0) for p in PHASES) for m in measured]
    print(f"| (rest of the step: the driver, eval) | {statistics.median(other):.3f} | {min(other):.3f}"
          f" | {max(other):.3f} | |")

    run, steady = memory.run_peak, memory.steps_peak
    print("\n| memory, all processes together | peak GiB, whole run | peak GiB, measured steps | target |")
    print("|---|---|---|---|")
    print(f"| sum of RSS (sampled every {memory.interval_s} s) | {run.rss / GIB:.2f} | {steady.rss / GIB:.2f} |"
          f" <= {RSS_TARGET_GIB} GiB: {'met' if run.rss / GIB <= RSS_TARGET_GIB else 'MISSED'} |")
    print(f"| sum of PSS (shared pages split; every {memory.interval_s * 5:.0f} s) | {run.pss / GIB:.2f} |"
          f" {steady.pss / GIB:.2f} | |")
    for name, peak in (("whole run", run), ("measured steps", steady)):
        print(f"RSS peak of the {name} during {peak.rss_at}: {len(peak.rss_procs)} processes, largest "
              + ", ".join(f"{proc} {rss / GIB:.2f}" for proc, rss in peak.rss_procs[:6]))
    actors = checks.get("actors", {})
    outside = checks.get("outside", {})
    print(f"Ray actors ({', '.join(sorted(set(actors.values())))}): {len(actors) - len(outside)} of {len(actors)}"
          " descend from this process" + (f"; counted by pid as well: {outside}" if outside else ""))
    own = memory.cpu_s.get(memory.root.pid, (0.0, 0.0))
    print(f"machine: {psutil.cpu_count()} cores; load average (1 min) {load_before[0]:.1f} before,"
          f" {load_after[0]:.1f} after; other processes used {others_cores:.2f} cores on average during the run;"
          f" this process (driver and sampler) {(own[1] - own[0]) / wall:.2f} cores")

    def median(name: str) -> float:
        values = [m[f"time/{name}"] for m in measured if f"time/{name}" in m]
        return statistics.median(values) if values else float("nan")

    return {"step": median("step"), "train": median("train"), "weight_sync": median("weight_sync"),
            "rss_gib": run.rss / GIB, "eval_before": summary.get("eval_before", {}),
            "eval_after": summary.get("eval_after", {})}

if __name__ == "__main__":
    main()
