"""Kill a ``cluster.async_mode=fully`` run's driver with SIGKILL at random moments, resume it each time,
and prove that across the whole run every group is trained on exactly once or recorded.

Each life starts the driver (``--resume`` once a checkpoint exists; a kill before the first one means
starting again without it), waits a random time after its first step (so the kill falls
mid-generation, mid-train, mid-sync or mid-save, wherever the run is), and SIGKILLs it and its Ray
processes. The last life runs to the end. Then, from the final checkpoint's JSON state and the
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

TRAIN = ("import sys; from slime_rl.core.config import load_config; from slime_rl.core.loop import train; "
         "train(load_config(None, sys.argv[1:]))")


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
    from slime_rl.core import checkpoint

    found = checkpoint.latest(run_dir / "checkpoints") if (run_dir / "checkpoints" / "latest").exists() else None
    return found[1]["step"] if found else None


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
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "SLIME_RL_TORCH_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    rng = random.Random(args.seed)
    kills = []
    for life in range(args.kills + 1):
        resume = latest_step(run_dir) is not None
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
        while not logged_since(run_dir / "metrics.jsonl", started, start_step) and proc.poll() is None:
            time.sleep(0.05)
        if proc.poll() is not None:  # the run finished before this kill: check what there is
            print(f"life {life} ran to the end before its kill (exit {proc.returncode}); give more --steps"
                  " for all the kills")
            if proc.returncode != 0:
                return 1
            break
        wait = rng.uniform(0.0, args.max_wait)
        time.sleep(wait)
        rows = metric_rows(run_dir / "metrics.jsonl")
        if proc.poll() is not None:
            print(f"life {life} ran to the end before its kill; give more --steps for all the kills")
            break
        kill_group(proc)
        kills.append((life, resume, wait, rows[-1]["step"] if rows else 0, latest_step(run_dir)))

    print("| life | resumed | killed s after its first step | last logged step | checkpoint after kill |")
    print("|---|---|---|---|---|")
    for life, resumed, wait, step, saved in kills:
        print(f"| {life} | {resumed} | {wait:.1f} | {step} | {saved} |")
    return verdict(run_dir, args.steps)


def verdict(run_dir: Path, steps: int) -> int:
    from slime_rl.core import checkpoint

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
