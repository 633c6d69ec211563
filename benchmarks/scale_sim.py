"""The control plane at 64 to 1,024 GPUs, simulated on one CPU machine (issue 43, docs/scale.md).

Per size: a few Ray nodes of this host advertising fake GPUs (Ray's real placement of one bundle a GPU), the
trainer ranks as real `TrainerWorker`s with a no-math trainer inside a handful of actors, the engines as
stand-in SGLang servers in one asyncio process behind the real sglang-router, the real rollout worker and
SGLang engine, and real steps of the loop. It prints, per size, CPU seconds and message counts (not wall
time: on 2 shared cores wall time is contention) of start-up, the driver per step, the router per request,
a weight sync's fan-out, the engines' health checks, a dead engine detected and replaced, a checkpoint;
the memory of each process; then how each cost grew from the smallest size to the largest, and the step
model of docs/scale.md with each per-step cost's share of the modelled step.

    .venv/bin/python benchmarks/scale_sim.py --sizes 64,128,256,512,1024 [--steps 3] [--json out.json]
    .venv/bin/python benchmarks/scale_sim.py --sizes small --json out.json   # what the fast test runs
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

# Ray reads these when first imported; the stand-in ranks and servers use one thread each.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared machine: others' memory must not kill ours
os.environ.setdefault("SLIME_RL_TORCH_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from slime_rl.core.testing.scale import Layout, at_most_linear, growth_exponent  # noqa: E402

SMALL = Layout(gpus=32, tp=2, pp=1, ep=2, engine_gpus=4, ray_nodes=2, hosts=2, prompts_per_engine=2, samples=4)

# The step model's inputs, fixed in docs/scale.md before any cost was measured.
PEAK_FLOPS = 989e12
MFU = {"dense": 0.358, "moe": 0.116}
SCALE_EFFICIENCY = 0.31 / 0.40  # verl's Qwen3-30B-A3B MFU at 32 GPUs over 8
DECODE_3B = 19036.0  # tokens/s per GPU, 3.1B dense colocated
TAIL = 1.5
SYNC_S_PER_GIB = 0.031
OFFLOAD_S_PER_GB = 0.040
STEP = {"samples": 2048, "prompt": 512, "response": 2800}
MODELS = {  # name: (total parameters, active parameters, kind, GPUs)
    "Qwen3-30B-A3B on 64": (30.5e9, 3.3e9, "moe", 64),
    "Qwen3-235B-A22B on 512": (235e9, 22e9, "moe", 512),
    "Qwen3-235B-A22B on 1,024": (235e9, 22e9, "moe", 1024),
}


def modelled_step(total: float, active: float, kind: str, gpus: int) -> dict[str, float]:
    """docs/scale.md's step model: seconds per phase of a colocated synchronous GRPO step."""
    tokens = STEP["samples"] * (STEP["prompt"] + STEP["response"])
    response = STEP["samples"] * STEP["response"]
    train = 6 * active * tokens / (gpus * MFU[kind] * SCALE_EFFICIENCY * PEAK_FLOPS)
    rollout = response / (gpus * DECODE_3B * 3.1e9 / active) * TAIL
    sync = total * 2 / 2**30 * SYNC_S_PER_GIB
    offload = 16 * total / gpus / 1e9 * OFFLOAD_S_PER_GB
    step = train + rollout + sync + offload
    return {"rollout": rollout, "train": train, "sync": sync, "offload": offload, "step": step,
            "tokens_per_s_per_gpu": tokens / step / gpus}


def parse_sizes(text: str) -> list[Layout]:
    return [SMALL if s == "small" else Layout(gpus=int(s)) for s in text.split(",")]


def run_size(layout: Layout, args, model: Path, tmp: Path) -> dict:
    from slime_rl.core.testing.scale_run import simulate
    from slime_rl.rollout_sglang.testing.fleet import start_fleet

    work = tmp / f"gpus{layout.gpus}"
    work.mkdir(parents=True, exist_ok=True)
    print(f"{layout.describe()}", file=sys.stderr, flush=True)
    fleet = start_fleet(layout.engines, str(model), str(work / "fleet.log"), token_delay=args.token_delay)
    try:
        return simulate(layout, fleet, model, work, steps=args.steps, kill=not args.no_kill,
                        revive_after=args.revive_after, ckpt_layers=args.ckpt_layers,
                        health_window_s=args.health_window,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        fleet.stop()


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def per_size(r: dict) -> dict[str, float]:
    """The costs the growth check compares, per size: medians over the steps after the first."""
    steps = r["steps"][1:] or r["steps"]
    rec = r.get("recovery") or {}
    return {
        "placement driver CPU s": r["placement"]["cpu_s"],
        "start-up driver CPU s": r["startup"]["driver_cpu_s"],
        "start-up rollout worker CPU s": r["startup"]["rollout_cpu_s"],
        "start-up ranks' build CPU s (sum)": r["startup"]["ranks_build_cpu_s"],
        "start-up HTTP messages": sum(r["startup"]["http"].values()),
        "driver CPU s / step": median([s["driver_cpu_s"] for s in steps]),
        "driver CPU s / step, real loop (estimated)": real_loop_driver_s(r),
        "rollout worker CPU s / step": median([s["rollout_cpu_s"] for s in steps]),
        "rank calls / step (real loop)": median([s["rank_calls"] for s in steps]),
        "host calls / step (here)": median([s["host_calls"] for s in steps]),
        "router CPU ms / request": median([s["router_cpu_ms_per_request"] for s in steps]),
        "sync driver CPU s": median([s["sync"]["driver_cpu_s"] for s in steps]),
        "sync control CPU s (rollout + ranks)": median([s["sync"]["rollout_cpu_s"] + s["sync"]["hosts_cpu_s"]
                                                         for s in steps]),
        "sync HTTP messages": median([s["sync"]["messages"] for s in steps]),
        "health checks / 10 s": r["health"]["checks"],
        "health rollout CPU s / 10 s": r["health"]["rollout_cpu_s"],
        "recovery HTTP messages": sum(rec.get("http", {}).values()),
        "recovery rollout CPU s": rec.get("rollout_cpu_s", 0.0),
        "save driver CPU s": r["save"]["driver_cpu_s"],
        "checkpoint items": r["checkpoint"]["items"],
        "checkpoint coordinator CPU s": r["checkpoint"]["coordinator_cpu_s"],
        "checkpoint .metadata MB": r["checkpoint"]["metadata_bytes"] / 1e6,
        "checkpoint load planning CPU s (all ranks)": r["checkpoint"]["load_cpu_s"],
        "driver RSS MB": r["memory_mb"]["driver"],
        "rollout worker RSS MB": r["memory_mb"]["rollout"],
        "rank host peak RSS MB (max)": max(r["memory_mb"]["hosts_peak"]),
        "router RSS MB": r["memory_mb"]["router"],
        "fleet RSS MB": r["memory_mb"]["fleet"],
    }


def real_loop_driver_s(r: dict) -> float:
    """The driver per step of the real loop, which calls every rank where the simulation calls a host: the
    measured step plus the calls it did not make at the measured CPU per call (0 where not measured)."""
    steps = r["steps"][1:] or r["steps"]
    extra = median([s["rank_calls"] - s["host_calls"] for s in steps])
    return median([s["driver_cpu_s"] for s in steps]) + extra * r.get("driver_cpu_s_per_actor_call", 0.0)


def print_size(r: dict) -> None:
    print(f"\n## {r['layout']}")
    place = r["placement"]
    print(f"placement: {place['bundles']} bundles, driver {place['cpu_s']:.2f} s CPU, {place['wall_s']:.1f} s wall,"
          f" problems: {place['problems'][:3] or 'none'}")
    for name, value in per_size(r).items():
        print(f"  {name:<44} {value:>12.4g}")
    rec = r.get("recovery")
    if rec and rec["replaced_s"] is None:
        print(f"  dead engine {rec['engine']}: NOT replaced within {rec['revive_after_s'] + 120:.0f} s (detected: "
              f"{rec['detected_s']})")
    elif rec:
        print(f"  dead engine {rec['engine']}: detected {rec['detected_s']:.1f} s, replaced {rec['replaced_s']:.1f} s "
              f"(its process back after {rec['revive_after_s']:.0f} s), version {rec['engine_version_at_replacement']} "
              f"of {rec['version_at_replacement']}; step trained {rec['step_samples']:.0f} of {rec['expected_samples']}"
              f" samples, once each: {rec['positions_trained_once']:.3f}; then {rec['victim_generates_after']} "
              f"requests served by it")


def print_growth(results: list[dict]) -> None:
    sizes = [r["gpus"] for r in results]
    rows = [per_size(r) for r in results]
    print(f"\n## growth from {sizes[0]} to {sizes[-1]} simulated GPUs (x{sizes[-1] / sizes[0]:g})")
    print(f"{'cost':<44} " + " ".join(f"{s:>10}" for s in sizes) + f" {'exponent':>9} {'<= linear':>9}")
    for name in rows[0]:
        values = [row[name] for row in rows]
        exp = growth_exponent(sizes, values)
        ok = at_most_linear(sizes, values) if min(values) > 0 else True
        print(f"{name:<44} " + " ".join(f"{v:>10.4g}" for v in values) + f" {exp:>9.2f} {'yes' if ok else 'NO':>9}")


def print_model(results: list[dict]) -> None:
    print("\n## step model (docs/scale.md) and the measured per-step control-plane costs against it")
    for name, (total, active, kind, gpus) in MODELS.items():
        m = modelled_step(total, active, kind, gpus)
        print(f"{name}: rollout {m['rollout']:.1f} s, train {m['train']:.1f} s, sync {m['sync']:.1f} s, offload "
              f"{m['offload']:.2f} s = step {m['step']:.1f} s ({m['tokens_per_s_per_gpu']:.0f} tokens/s/GPU)")
        same = [r for r in results if r["gpus"] == gpus]
        if same:
            c = per_size(same[0])
            for cost in ("driver CPU s / step", "driver CPU s / step, real loop (estimated)", "sync driver CPU s",
                         "sync control CPU s (rollout + ranks)"):
                print(f"  {cost}: {c[cost]:.3f} s = {100 * c[cost] / m['step']:.3f}% of the step")
            per_request = c["router CPU ms / request"] / 1e3 * STEP["samples"]
            print(f"  router over {STEP['samples']} requests: {per_request:.3f} s CPU = "
                  f"{100 * per_request / m['step']:.3f}% of the step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,128,256,512,1024", help="GPU counts, or 'small' (the test's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--revive-after", type=float, default=20.0, help="s until a killed engine listens again")
    parser.add_argument("--health-window", type=float, default=10.0, help="s of idle engines' health checks measured")
    parser.add_argument("--no-kill", action="store_true", help="skip the dead-engine measurement")
    parser.add_argument("--token-delay", type=float, default=0.002, help="each stand-in server's s per token")
    parser.add_argument("--ckpt-layers", type=int, default=4, help="layers of the 235B shape in the checkpoint")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()
    from slime_rl.core.config.cpu import cpu_info
    from slime_rl.core.testing import tiny_model_folder

    print(f"CPU: {cpu_info().describe()}", file=sys.stderr, flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="scale-sim-") as tmp:
        model = tiny_model_folder(Path(tmp) / "model", "qwen2", hidden_size=32, num_layers=4, num_heads=8,
                                  num_kv_heads=8)  # TP up to 8 divides the heads, PP up to 4 the layers
        for layout in parse_sizes(args.sizes):
            results.append(run_size(layout, args, model, Path(tmp)))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"CPU: {cpu_info().describe()}")
    for r in results:
        print_size(r)
    if len(results) > 1:
        print_growth(results)
    print_model(results)


if __name__ == "__main__":
    main()
