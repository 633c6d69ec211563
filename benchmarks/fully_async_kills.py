"""Kill a ``cluster.async_mode=fully`` run's driver with SIGKILL at random moments, resume it each time,
and prove that across the whole run every group is trained on exactly once or recorded.

Each life starts the driver (``--resume`` once a checkpoint exists; a kill before the first one means
starting again without it) and SIGKILLs it and its Ray processes. The driver writes the loop phase it is
in to a file (the loop's own `phase` timer, wrapped), so each kill is attributed to one: mid-generation
(the driver waits for its batch while the engine generates), mid-train (log-probs, advantages, the
optimizer step), mid-sync, mid-save, or before the first checkpoint. With ``--cover`` (the default) the
first life is killed before its first checkpoint and the others at a random moment (up to ``--max-wait``
s after their first step) of a phase taken in turn from the other four, so every phase is shown hit;
``--no-cover``: at a random time after the first step, wherever the run is. The last life runs to the end. Then, from the final checkpoint's JSON state and the
per-step rollout files: no group trained twice, the trained groups are the ledger's, and every group
the data source handed out is trained, held (ready or in flight) or recorded as filtered, failed or
dropped as stale. Prints a table of the kills and the verdict (PASS/FAIL); exit 1 on FAIL.

    .venv/bin/python benchmarks/fully_async_kills.py --kills 10 --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The driver: the loop's phase timer wrapped to write the phase it is in to $KILLS_PHASE_FILE.
TRAIN = """
import contextlib, os, sys
import slime_rl.core.run.loop as loop
from slime_rl.core.config import load_config

def mark(name):
    with open(os.environ["KILLS_PHASE_FILE"] + ".tmp", "w") as out:
        out.write(name)
    os.replace(os.environ["KILLS_PHASE_FILE"] + ".tmp", os.environ["KILLS_PHASE_FILE"])

timer = loop.phase

@contextlib.contextmanager
def phase(timings, name):
    mark(name)
    try:
        with timer(timings, name):
            yield
    finally:
        mark("between")

loop.phase = phase
mark("startup")
loop.train(load_config(None, sys.argv[1:]))
"""
# The loop's phases (loop.py) by what they mean for a kill.
PHASES = {"rollout": "mid-generation", "wait_rollout": "mid-generation", "prepare": "mid-train",
          "train": "mid-train", "weight_sync": "mid-sync", "save": "mid-save"}
COVERED = ("mid-generation", "mid-train", "mid-sync", "mid-save")


async def digit_reward(sample) -> float:
    """1 when the response holds a digit: a random tiny model gets both rewards, so the filter sees both."""
    return float(any(c.isdigit() for c in sample.response))


def metric_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged_since(path: Path, started: float, start_step: int) -> bool:
    """This life has logged a step (a resume first drops the killed life's rows past its checkpoint)."""
    if not path.exists() or path.stat().st_mtime < started:
        return False
    rows = metric_rows(path)
    return bool(rows) and rows[-1]["step"] > start_step


def latest_step(run_dir: Path) -> int | None:
    from slime_rl.core.run import checkpoint

    found = checkpoint.latest(run_dir / "checkpoints") if (run_dir / "checkpoints" / "latest").exists() else None
    return found[1]["step"] if found else None


def current_phase(phase_file: Path) -> str:
    """The loop phase the driver is in, by what it means for a kill (PHASES)."""
    try:
        name = phase_file.read_text()
    except OSError:
        name = "startup"
    return PHASES.get(name, name)


def kill_label(phase_file: Path, run_dir: Path) -> str:
    return "before the first checkpoint" if latest_step(run_dir) is None else current_phase(phase_file)


def wait_for_phase(proc: subprocess.Popen, phase_file: Path, target: str, timeout: float) -> bool:
    """Until the driver is in ``target`` (polled every 2 ms); False if it is not within ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if current_phase(phase_file) == target:
            return True
        time.sleep(0.002)
    return False


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait", type=float, default=20.0, help="seconds after a life's first step to kill")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--cover", action=argparse.BooleanOptionalAction, default=True,
                        help="kill in each phase in turn (the first life before its first checkpoint)")
    args = parser.parse_args()
    from slime_rl.core.testing import tiny_model_folder

    work = args.workdir or Path(tempfile.mkdtemp(prefix="fully-kills-"))
    model = tiny_model_folder(work / "model")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(2000)))
    run_dir = work / "run"
    overrides = [
        f"model.path={model}", f"data.prompt_data={prompts}", "data.rollout_batch_size=4",
        "data.n_samples_per_prompt=4", f"data.num_rollout={args.steps}", "rollout.max_response_len=4",
        "rollout.reward=fully_async_kills:digit_reward", "rollout.dynamic_sampling_filter=nonzero_std",
        "cluster.async_mode=fully", "rollout.max_staleness=1", "rollout.buffer_filter=stalest_first",
        "cluster.device=cpu", f"logging.dir={run_dir}", "logging.tensorboard=false", "logging.save_rollouts=true",
        "logging.progress_bar=false", "checkpoint.save_interval=1",
    ]
    phase_file = work / "phase"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "SLIME_RL_TORCH_THREADS": "1",
           "OMP_NUM_THREADS": "1", "KILLS_PHASE_FILE": str(phase_file)}
    rng = random.Random(args.seed)
    kills = []
    for life in range(args.kills + 1):
        resume = latest_step(run_dir) is not None
        phase_file.unlink(missing_ok=True)  # the killed life's last phase
        proc = subprocess.Popen([sys.executable, "-c", TRAIN, *overrides, *(["checkpoint.resume=true"] if resume
                                                                              else [])],
                                env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=open(work / f"life_{life}.err", "w"))
        started, start_step = time.time(), latest_step(run_dir) or 0
        if life == args.kills:
            proc.wait()
            if proc.returncode != 0:
                print(f"the last life failed (exit {proc.returncode}); see {work}/life_{life}.err")
                return 1
            break
        first_life = args.cover and life == 0 and not resume
        if first_life:  # killed during its first step, before the checkpoint that ends it
            target = "before the first checkpoint"
            wait_for_phase(proc, phase_file, "mid-generation", timeout=600)
        else:
            target = COVERED[(life - args.cover) % len(COVERED)] if args.cover else None
            while not logged_since(run_dir / "metrics.jsonl", started, start_step) and proc.poll() is None:
                time.sleep(0.05)
        if proc.poll() is not None:  # the run finished before this kill: check what there is
            print(f"life {life} ran to the end before its kill (exit {proc.returncode}); give more --steps"
                  " for all the kills")
            if proc.returncode != 0:
                return 1
            break
        wait = rng.uniform(0.0, 1.0 if first_life else args.max_wait)
        time.sleep(wait)
        if target is not None and not first_life and not wait_for_phase(proc, phase_file, target, 120):
            print(f"life {life}: the driver did not enter {target} within 120 s")
        phase = kill_label(phase_file, run_dir)
        rows = metric_rows(run_dir / "metrics.jsonl")
        if proc.poll() is not None:
            print(f"life {life} ran to the end before its kill; give more --steps for all the kills")
            break
        kill_group(proc)
        kills.append((life, resume, wait, phase, rows[-1]["step"] if rows else 0, latest_step(run_dir)))

    print("| life | resumed | random wait s (then the phase aimed at) | phase at the kill | last logged step |"
          " checkpoint after kill |")
    print("|---|---|---|---|---|---|")
    for life, resumed, wait, phase, step, saved in kills:
        print(f"| {life} | {resumed} | {wait:.1f} | {phase} | {step} | {saved} |")
    hit = {phase for *_, phase, _, _ in kills}
    missing = [p for p in ("before the first checkpoint", *COVERED) if p not in hit]
    print(f"phases hit: {', '.join(sorted(hit))}" + (f"; not hit: {', '.join(missing)}" if missing else ""))
    return verdict(run_dir, args.steps)


def verdict(run_dir: Path, steps: int) -> int:
    from slime_rl.core.run import checkpoint

    trained = []
    for k in range(1, steps + 1):
        lines = (run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()
        trained += [json.loads(line)["group_index"] for line in lines[::4]]
    state = checkpoint.latest(run_dir / "checkpoints")[1]["rollout_state"]["fully_async"]
    ledger = state["ledger"]
    held = [g[0]["group_index"] for g in state["ready"] + state["in_flight"]]
    accounted = trained + held + ledger["filtered"] + ledger["failed"] + ledger["dropped_stale"]
    twice = len(trained) - len(set(trained))
    lost = sorted(set(range(max(accounted) + 1)) - set(accounted))
    ok = twice == 0 and not lost and ledger["trained"] == trained and len(accounted) == len(set(accounted))
    print(f"\ngroups handed out {max(accounted) + 1}: trained {len(trained)}, filtered {len(ledger['filtered'])},"
          f" failed {len(ledger['failed'])}, dropped as stale {len(ledger['dropped_stale'])}, held {len(held)};"
          f" trained twice {twice}, lost {len(lost)}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
