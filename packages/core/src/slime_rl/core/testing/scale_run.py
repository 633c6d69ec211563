"""One simulated size of the scale simulation (docs/scale.md): real steps of the real loop at 64 to 1,024
simulated GPUs, measured by CPU seconds and message counts.

`simulate` places the layout on the fake-GPU cluster (scale.py), starts the rank hosts (scale_ranks.py) and
the real `RolloutWorker` with the real SGLang engine attached to a fleet of stand-in servers behind the
real sglang-router, then runs the loop's own step functions (`run.loop._train_on`, `_sync_after_train`,
`_save`) and measures: start-up, the driver per step, the router per request, a sync's fan-out, the engines'
health checks, a dead engine detected and replaced while a step runs, a checkpoint save and the metadata
of a distributed checkpoint of every rank (scale_checkpoint.py); the memory of every process.

``fleet`` is the stand-in servers (`slime_rl.rollout_sglang.testing.fleet.FleetProcess`: ``urls``, ``pid``,
``state()``, ``kill(engine, revive_after)``); core does not import the backend that makes it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from slime_rl.core.testing.scale import (
    CpuMeter,
    Layout,
    check_placement,
    count_diff,
    fake_gpu_cluster,
    request_counts,
    rss_mb,
)
from slime_rl.core.testing.scale_checkpoint import MoEShape, RankGrid, write_checkpoint_metadata


def _engine_view(worker) -> dict[str, Any]:
    """Inside the rollout worker (``__ray_call__``): the engine's recovery state and its router's pid."""
    engine = worker.engine
    return {"recovering": sorted(engine.control.recovering), "restarts": engine.restarts,
            "version": engine.weight_version, "router_pid": engine.router.process.pid,
            "urls": [s.url for s in engine.servers]}


def simulate(layout: Layout, fleet: Any, model: Path, workdir: Path, *, steps: int = 3, kill: bool = True,
             revive_after: float = 20.0, ckpt_layers: int = 4, health_window_s: float = 10.0,
             log=print) -> dict[str, Any]:
    """Run ``layout`` for ``steps`` steps (plus one with an engine killed, when ``kill``); returns the
    measurements (see benchmarks/scale_sim.py for the table they make)."""
    import ray

    from slime_rl.core.config import load_config
    from slime_rl.core.config.placement import plan_placement
    from slime_rl.core.infra.ray_placement import reserve
    from slime_rl.core.infra.stall import Party, StallBounds, StallWatch
    from slime_rl.core.run.actors import RolloutWorker
    from slime_rl.core.run.loop import Run
    from slime_rl.core.run.run_dir import new_run_id
    from slime_rl.core.testing.scale_ranks import HostedTrainerGroup
    from slime_rl.core.weights.sync import WeightSync

    workdir.mkdir(parents=True, exist_ok=True)
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"question {i}", "label": "1"}) + "\n"
                               for i in range(layout.prompts * (steps + 3))))
    cfg = load_config(None, layout.overrides(model=model, prompts=prompts, run_dir=workdir, engine_urls=fleet.urls))
    out: dict[str, Any] = {"layout": layout.describe(), "gpus": layout.gpus, "engines": layout.engines,
                           "ranks": layout.gpus, "dp": layout.dp}
    me = os.getpid()
    with fake_gpu_cluster(layout):
        t_cpu, t_wall = time.process_time(), time.perf_counter()
        plan = plan_placement(cfg, device="cuda")  # the GPU plan: one bundle a GPU, PACK (ray_placement.py)
        reservation = reserve(plan, timeout_s=300)
        problems = check_placement(plan, reservation)
        out["placement"] = {"bundles": len(plan.bundles), "cpu_s": time.process_time() - t_cpu,
                            "wall_s": time.perf_counter() - t_wall, "problems": problems}
        log(f"  placed {len(plan.bundles)} bundles in {out['placement']['wall_s']:.1f} s; problems: {len(problems)}")

        fleet_before = request_counts(fleet.state())
        t_cpu, t_wall = time.process_time(), time.perf_counter()
        watch = StallWatch(StallBounds.from_config(cfg))
        group = HostedTrainerGroup(cfg, reservation, watch, layout.hosts)
        log_dir = Path(cfg.logging.dir)
        rollout = ray.remote(**reservation.rollout_options())(RolloutWorker).remote(
            cfg.to_dict(reveal_secrets=True), str(workdir / "rollout_state"), str(log_dir))
        watch.register(rollout, Party("the rollout worker"))
        watch.get("rollout start", [rollout.ping.remote()], [rollout])
        group.wait_ready()
        run = Run(cfg, plan, group, None, rollout, WeightSync(cfg, plan, group, rollout, watch), new_run_id(),
                  False, watch)
        rollout_pid = watch.get("rollout start", [rollout.process.remote()], [rollout])[0][1]
        view = ray.get(rollout.__ray_call__.remote(_engine_view))
        host_pids = [pid for _, pid in ray.get([w.process.remote() for w in group.workers])]
        usage = group.usage()
        out["startup"] = {
            "driver_cpu_s": time.process_time() - t_cpu, "wall_s": time.perf_counter() - t_wall,
            "rollout_cpu_s": _cpu(rollout_pid), "router_cpu_s": _cpu(view["router_pid"]),
            "hosts_cpu_s": sum(u["cpu_s"] for u in usage), "ranks_build_cpu_s": sum(u["build_cpu_s"] for u in usage),
            "rank_calls": sum(group.rank_calls.values()), "host_calls": sum(group.host_calls.values()),
            "http": count_diff(request_counts(fleet.state()), fleet_before)}
        log(f"  started in {out['startup']['wall_s']:.1f} s")

        meter = CpuMeter({"driver": me, "rollout": rollout_pid, "router": view["router_pid"],
                          **{f"host{i}": pid for i, pid in enumerate(host_pids)}})
        out["steps"] = [_step(run, step, meter, fleet, layout) for step in range(1, steps + 1)]
        for row in out["steps"]:
            log(f"  step {row['step']}: driver {row['driver_cpu_s']:.3f} s CPU, sync {row['sync']['driver_cpu_s']:.3f}"
                f" s, router {row['router_cpu_ms_per_request']:.2f} ms/request, trained {row['samples']:.0f}")

        with meter.over() as took:
            before = request_counts(fleet.state())
            t_cpu = time.process_time()
            from slime_rl.core.run.loop import _save

            _save(run, steps)
            save_driver = time.process_time() - t_cpu
        out["save"] = {"driver_cpu_s": save_driver, "hosts_cpu_s": _hosts(took), "rollout_cpu_s": took["rollout"],
                       "http": count_diff(request_counts(fleet.state()), before)}

        before, cpu_before = request_counts(fleet.state()), meter.snapshot()
        time.sleep(health_window_s)  # the engine monitor checks every 5 s; the router too, every 60 s
        after = meter.snapshot()
        health = count_diff(request_counts(fleet.state()), before)
        out["health"] = {"window_s": health_window_s, "checks": health.get("/health", 0),
                         "rollout_cpu_s": after["rollout"] - cpu_before["rollout"],
                         "router_cpu_s": after["router"] - cpu_before["router"]}

        # the real loop makes one actor call per rank where the hosts take one per host: what each costs the driver
        out["driver_cpu_s_per_actor_call"] = group.call_cost(max(s["rank_calls"] for s in out["steps"]))
        step = steps
        if kill:
            out["recovery"] = _kill_and_replace(run, rollout, meter, fleet, layout, step + 1, revive_after, log)
            step += 1

        out["memory_mb"] = {"driver": rss_mb(me), "rollout": rss_mb(rollout_pid), "router": rss_mb(view["router_pid"]),
                            "fleet": fleet.state()["rss_mb"],
                            "hosts_peak": [u["peak_rss_mb"] for u in group.usage()]}
        run.ask_rollout("shutdown", rollout.shutdown.remote())

    t_cpu = time.process_time()
    grid = RankGrid(layout.gpus, layout.tp, layout.pp, layout.ep)
    cost = write_checkpoint_metadata(workdir / "dcp" / "actor", MoEShape(layers=ckpt_layers), grid)
    from slime_rl.core.infra.safe_pickle import check_dcp_folder
    from slime_rl.core.run.checkpoint_contents import missing_files

    t_check = time.process_time()
    missing = missing_files(workdir / "dcp", ("actor",))
    check_dcp_folder(workdir / "dcp" / "actor")
    out["checkpoint"] = {**cost.__dict__, "layers": ckpt_layers, "commit_check_cpu_s": time.process_time() - t_check,
                         "missing": missing, "total_cpu_s": time.process_time() - t_cpu}
    return out


def _cpu(pid: int) -> float:
    from slime_rl.core.testing.scale import cpu_s

    return cpu_s(pid)


def _hosts(took: dict[str, float]) -> float:
    return sum(v for k, v in took.items() if k.startswith("host"))


def _step(run, step: int, meter: CpuMeter, fleet, layout: Layout, during=None) -> dict[str, Any]:
    """One step of the loop (rollout, prepare and train, weight sync): its CPU by process and messages."""
    from slime_rl.core.run.loop import _sync_after_train, _train_on

    group = run.actor
    calls_before = sum(group.rank_calls.values()), sum(group.host_calls.values())
    http_before = request_counts(fleet.state())
    timings: dict[str, float] = {}
    t_cpu = time.process_time()
    with meter.over() as took_step:
        with meter.over() as took_rollout:
            refs = run.ask_rollout("rollout", during if during is not None else run.rollout.run_step.remote(step))
        http_rollout = count_diff(request_counts(fleet.state()), http_before)
        metrics = _train_on(run, refs, timings)
        sync_http_before = request_counts(fleet.state())
        sync_driver = time.process_time()
        with meter.over() as took_sync:
            _sync_after_train(run, step, timings)
        sync_driver = time.process_time() - sync_driver
    driver = time.process_time() - t_cpu
    # the engine monitor's and the router's health checks run on their own clocks: counted apart (out["health"])
    http_sync = {k: v for k, v in count_diff(request_counts(fleet.state()), sync_http_before).items() if k != "/health"}
    requests = http_rollout.get("/generate", 0)
    return {
        "step": step, "driver_cpu_s": driver, "rollout_cpu_s": took_step["rollout"], "hosts_cpu_s": _hosts(took_step),
        "rank_calls": sum(group.rank_calls.values()) - calls_before[0],
        "host_calls": sum(group.host_calls.values()) - calls_before[1],
        "requests": requests, "router_cpu_s": took_rollout["router"],
        "router_cpu_ms_per_request": 1e3 * took_rollout["router"] / max(requests, 1),
        "samples": metrics["train/samples"], "positions_trained_once": metrics["train/positions_trained_once"],
        "expected_samples": layout.prompts * layout.samples,
        "sync": {"driver_cpu_s": sync_driver, "rollout_cpu_s": took_sync["rollout"],
                 "hosts_cpu_s": _hosts(took_sync), "http": http_sync,
                 "messages": sum(http_sync.values())},
        "timings": {k: v for k, v in timings.items() if k.startswith("time/")},
    }


def _kill_and_replace(run, rollout, meter: CpuMeter, fleet, layout: Layout, step: int, revive_after: float,
                      log) -> dict[str, Any]:
    """Kill the last engine as step ``step``'s rollout starts (its fresh process listens again after
    ``revive_after`` s, as a supervisor's restart; sooner than the monitor's detection, 3 failed checks 5 s
    apart, it would come back unnoticed with the model's first weights, docs/scale.md); time the engine's
    detection (the monitor marks it recovering) and replacement (restored, back in the router); the step
    must train every sample."""
    import ray

    victim = layout.engines - 1
    start_view = ray.get(rollout.__ray_call__.remote(_engine_view))
    cpu_before, http_before = meter.snapshot(), request_counts(fleet.state())
    killed_at = fleet.kill(victim, revive_after)
    pending = rollout.run_step.remote(step)
    detected = replaced = None
    version_at_replacement = served_version = None
    deadline = time.time() + revive_after + 120
    while time.time() < deadline and replaced is None:
        view = ray.get(rollout.__ray_call__.remote(_engine_view))
        if detected is None and victim in view["recovering"]:
            detected = time.time() - killed_at
        if view["restarts"] > start_view["restarts"] and victim not in view["recovering"]:
            replaced = time.time() - killed_at
            version_at_replacement = view["version"]
            served_version = fleet.state()["engines"][victim]["weight_version"]
        time.sleep(0.1)
    cpu_after = meter.snapshot()
    http = count_diff(request_counts(fleet.state()), http_before)
    log(f"  engine {victim} killed: detected after {detected} s, replaced after {replaced} s")
    row = _step(run, step, meter, fleet, layout, during=pending)
    after = _step(run, step + 1, meter, fleet, layout)  # the replaced engine serves again
    victim_state = fleet.state()["engines"][victim]
    return {
        "engine": victim, "revive_after_s": revive_after, "detected_s": detected, "replaced_s": replaced,
        "control_plane_s": None if replaced is None else replaced - revive_after,
        "version_at_replacement": version_at_replacement, "engine_version_at_replacement": served_version,
        "rollout_cpu_s": cpu_after["rollout"] - cpu_before["rollout"], "http": http,
        "step_samples": row["samples"], "expected_samples": row["expected_samples"],
        "positions_trained_once": row["positions_trained_once"],
        "victim_generates_after": victim_state["requests"].get("/generate", 0),
        "victim_version_after": victim_state["weight_version"], "version_after": after["step"],
    }
