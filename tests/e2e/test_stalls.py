"""A stopped trainer rank (SIGSTOP: a hung collective, a process in D state) is named within the bound
and ends the run with one line (infra/stall.py); the stopped process goes with the run."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psutil
from test_lockdown import clean_env, overrides, steps_done, tree, write_yaml

FLOOR_S = 6.0  # the test's cluster.stall_fail_floor_s: a CPU step of the tiny model takes about a second


def test_a_stopped_trainer_rank_is_named_then_fails_the_run_within_the_bound(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "config.yaml", [
        *overrides(tiny_model_dir, tmp_path, num_rollout=40), f"cluster.stall_fail_floor_s={FLOOR_S}",
        "cluster.stall_warn_factor=2.0", "cluster.stall_fail_factor=4.0", "logging.progress_bar=false"])
    driver = subprocess.Popen([sys.executable, "-m", "slime_rl.cli.app", "train", str(config)],
                              env=clean_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stopped: psutil.Process | None = None
    try:
        deadline = time.time() + 300
        while steps_done(run_dir) < 2:  # every phase of a step has a history
            assert driver.poll() is None, driver.stderr.read()[-3000:]
            assert time.time() < deadline, "the run made no progress"
            time.sleep(0.1)
        processes = tree(driver.pid)
        trainers = [p for p in processes if p.name().startswith("ray::TrainerWorker")]
        assert len(trainers) == 2, [p.name() for p in processes]
        stopped = trainers[-1]
        stopped.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        _, stderr = driver.communicate(timeout=120)
        ended_s = time.time() - stopped_at
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    lines = stderr.strip().splitlines()
    named = f"trainer rank [01] \\(pid {stopped.pid}, stopped \\(SIGSTOP\\)\\)"
    # (with the low floor, start-up's first waits may warn too: they are no step of the run)
    warnings = [i for i, line in enumerate(lines) if line.startswith("slime-rl: stall: the ") and re.search(named, line)]
    assert warnings, stderr[-3000:]
    assert driver.returncode == 1, stderr[-3000:]
    failure = lines[-1]
    assert failure.startswith("error: cluster.stall_fail_floor_s: the ") and " wait stalled (" in failure, failure
    assert re.search(named, failure) and warnings[0] < len(lines) - 1
    # The bound: the floor (the phases' medians are well under a second here), a poll, and Ray's shutdown.
    assert ended_s < FLOOR_S + 30, f"the run ended {ended_s:.0f} s after the rank stopped"
    print(f"the run ended {ended_s:.1f} s after trainer pid {stopped.pid} stopped")
    try:  # the stopped rank goes with the run (a zombie until its parent reaps it)
        gone, _ = psutil.wait_procs([stopped], timeout=30)
        assert gone or stopped.status() == psutil.STATUS_ZOMBIE, "the stopped rank outlived the run"
    finally:
        if stopped.is_running():
            stopped.kill()
