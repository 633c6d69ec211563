"""One run per folder (issue 34, high item 3): a second `slime-cli train` on a logging.dir or a
checkpoint.save_dir that a running run holds is refused at once, before Ray, in one line naming that
run (pid, host, start time); a killed run (SIGKILL) leaves no lock behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

# The first run: the real loop.train up to Ray's start, which stands still there (a run in progress)
FIRST_RUN = """
import contextlib, sys, time
from slime_rl.core.config import load_config
from slime_rl.core.run import loop

@contextlib.contextmanager
def ray_that_stays_up(cfg):
    print("running", flush=True)
    time.sleep(300)
    yield

loop.local_ray = ray_that_stays_up
loop.train(load_config(sys.argv[1], check=False))
"""


def _config(tmp_path: Path, name: str, save_dir: Path, log_dir: Path) -> Path:
    (tmp_path / "prompts.jsonl").write_text('{"input": "1 + 1 =", "label": "2"}\n')
    (tmp_path / "model").mkdir(exist_ok=True)
    tree = {"model": {"path": str(tmp_path / "model"), "dtype": "float32"},
            "data": {"prompt_data": str(tmp_path / "prompts.jsonl"), "rollout_batch_size": 2,
                     "n_samples_per_prompt": 2},
            "rollout": {"engine": "hf", "reward": "math", "max_response_len": 8},
            "trainer": {"backend": "megatron"}, "cluster": {"device": "cpu"},
            "checkpoint": {"save_dir": str(save_dir)}, "logging": {"dir": str(log_dir)}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture
def first_run(tmp_path):
    """Start the first run on ``<tmp>/shared_ckpt`` and ``<tmp>/shared_logs``; yields its process."""
    config = _config(tmp_path, "first", tmp_path / "shared_ckpt", tmp_path / "shared_logs")
    proc = subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    try:
        line = proc.stdout.readline()
        assert line == "running\n", proc.stderr.read() if proc.poll() is not None else line
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _second_run(config: Path) -> tuple[subprocess.CompletedProcess, float]:
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", str(config)], capture_output=True,
                          text=True, timeout=120)
    return proc, time.perf_counter() - began


@pytest.mark.parametrize("shared", ["checkpoint.save_dir", "logging.dir"])
def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_first(tmp_path, first_run, shared):
    save_dir = tmp_path / ("shared_ckpt" if shared == "checkpoint.save_dir" else "own_ckpt")
    log_dir = tmp_path / ("shared_logs" if shared == "logging.dir" else "own_logs")
    proc, elapsed = _second_run(_config(tmp_path, "second", save_dir, log_dir))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    folder = save_dir if shared == "checkpoint.save_dir" else log_dir
    assert lines[0].startswith(f"error: {shared}: {folder} is in use by another run (pid {first_run.pid} on"
                               f" {socket.gethostname()}, started {time.gmtime().tm_year}-"), lines[0]
    assert lines[0].endswith(f"; wait for it to end, or give this run another {shared}"), lines[0]
    assert "first.yaml" in lines[0]  # the first run's command
    assert elapsed < 60, elapsed  # refused at once: no Ray (its start alone takes longer here)
    assert not (tmp_path / "own_ckpt").exists() and not (tmp_path / "own_logs").exists()  # nothing made


def test_a_killed_run_leaves_no_lock(tmp_path, first_run):
    from slime_rl.core.run import folder_lock

    with pytest.raises(Exception, match=r"checkpoint.save_dir: .* is in use by another run"):
        folder_lock.claim("checkpoint.save_dir", tmp_path / "shared_ckpt")
    first_run.send_signal(signal.SIGKILL)
    first_run.wait()
    for field, folder in (("checkpoint.save_dir", tmp_path / "shared_ckpt"), ("logging.dir", tmp_path / "shared_logs")):
        folder_lock.claim(field, folder)  # the kernel dropped the dead run's lock
        folder_lock.release(folder)
        assert not (folder / folder_lock.LOCK_FILE).exists()


def test_claims_are_counted_and_released_when_the_run_ends(tmp_path):
    from slime_rl.core.run import folder_lock

    folder = tmp_path / "logs"
    with folder_lock.claims_released():
        folder_lock.claim("logging.dir", folder)
        with folder_lock.claims_released():
            folder_lock.claim("logging.dir", folder)  # the loop's claim of what slime-cli claimed
        assert (folder / folder_lock.LOCK_FILE).is_file()  # still held: the outer claim
        record = (folder / folder_lock.LOCK_FILE).read_text()
        assert f'"pid": {os.getpid()}' in record
    assert not (folder / folder_lock.LOCK_FILE).exists() and folder_lock.held_folders() == []


def test_a_filesystem_without_locks_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from slime_rl.core.run import folder_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with folder_lock.claims_released():
        folder_lock.claim("logging.dir", tmp_path / "nfs")
    assert capsys.readouterr().err == (f"slime-rl: warning: logging.dir: {tmp_path / 'nfs'} takes no file locks (No"
                                       " locks available), so another run using it at the same time is not refused\n")
    assert folder_lock.held_folders() == [] and not (tmp_path / "nfs" / folder_lock.LOCK_FILE).exists()
