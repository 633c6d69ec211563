"""The start-up cleanup removes a leftover folder only when its owner is provably ours and dead:
same boot, same pid namespace, the pid gone or reused. A pid alone proves nothing across containers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slime_rl.core.infra import leftovers


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """The cleanup looks in tmp_path (for /tmp) and tmp_path/shm (for /dev/shm)."""
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(leftovers, "shared_memory_dir", lambda: str(tmp_path / "shm"))
    return tmp_path


def exited_process() -> tuple[int, str]:
    """The pid and start time (clock ticks, from /proc) of a process that has exited."""
    proc = subprocess.Popen(["sleep", "30"])
    start = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    proc.kill()
    proc.wait()
    return proc.pid, start


def plant(parent: Path, prefix: str, pid: int, start: str, record: dict | None) -> Path:
    tag = f"{leftovers._base36(pid)}.{leftovers._base36(int(start))}"
    folder = parent / f"{prefix}{tag}-planted"
    folder.mkdir()
    (folder / "bucket-0.safetensors").write_bytes(b"\0" * 64)
    if record is not None:
        (folder / ".owner.json").write_text(json.dumps(record))
    return folder


def ours(pid: int, start: str) -> dict:
    return {"pid": pid, "start": start, "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pid_ns": os.stat("/proc/self/ns/pid").st_ino}


def test_a_dead_owner_in_this_pid_namespace_and_boot_has_its_folders_removed(folders):
    pid, start = exited_process()
    dead = [plant(folders / "shm", leftovers.WEIGHTS_PREFIX, pid, start, ours(pid, start)),
            plant(folders, leftovers.RAY_PREFIX, pid, start, ours(pid, start))]
    live = leftovers.private_folder(leftovers.RAY_PREFIX)  # this process's own: alive, kept
    assert sorted(leftovers.remove_dead()) == sorted(dead)
    assert live.is_dir() and not any(p.exists() for p in dead)


def test_a_folder_from_another_pid_namespace_boot_or_without_a_record_is_left_alone(folders):
    pid, start = exited_process()  # the pid is gone here; in another container it may be a live run
    other_ns = {**ours(pid, start), "pid_ns": ours(pid, start)["pid_ns"] + 1}
    other_boot = {**ours(pid, start), "boot_id": "00000000-0000-0000-0000-000000000000"}
    kept = [plant(folders / "shm", leftovers.WEIGHTS_PREFIX, pid, start, other_ns),
            plant(folders, leftovers.RAY_PREFIX, pid, start, other_boot),
            plant(folders, leftovers.KEYS_PREFIX, pid, start, None)]
    assert leftovers.remove_dead() == []
    assert all((p / "bucket-0.safetensors").is_file() for p in kept)


def test_a_folder_records_its_owner_beyond_the_pid(folders):
    folder = leftovers.private_folder(leftovers.KEYS_PREFIX)
    record = json.loads((folder / leftovers.OWNER_RECORD).read_text())
    assert record == ours(os.getpid(), record["start"]) and record["start"]
    assert not leftovers.provably_dead(folder, folder.name.removeprefix(leftovers.KEYS_PREFIX).split("-")[0])


def ray_processes_once_there(folder: Path, count: int) -> dict[int, str]:
    """`leftovers.ray_processes` once it finds ``count`` (a child names the folder only after its exec)."""
    for _ in range(200):
        if len(found := leftovers.ray_processes(folder)) == count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{count} processes naming {folder} never ran: {found}")


def test_the_processes_of_a_ray_folder_and_those_below_them_are_ended(tmp_path):
    """What a run's end sweeps after ray.shutdown(): processes naming its Ray folder on their command line (the
    GCS, the raylet) and everything below them (the raylet's agents retitle themselves), SIGKILLed after the
    grace; a process that does not name the folder is left alone, and one that exits within the grace is not
    killed."""
    folder = tmp_path / "slime-rl-ray-x"
    spawn_child = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    raylet = subprocess.Popen([sys.executable, "-c", spawn_child, f"--temp-dir={folder}/r"])
    bystander = subprocess.Popen(["sleep", "60"])
    quitter = None
    try:
        ray_processes_once_there(folder, 2)  # the "raylet" has started its "agent"
        quitter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)", str(folder)])
        found = ray_processes_once_there(folder, 3)
        agent = set(found) - {raylet.pid, quitter.pid}
        assert raylet.pid in found and quitter.pid in found and len(agent) == 1 and bystander.pid not in found
        killed = leftovers.end_processes(found, grace_s=3.0)
        assert killed == sorted({raylet.pid, *agent})
        assert raylet.wait(timeout=10) == -signal.SIGKILL and quitter.wait(timeout=10) == 0
        assert bystander.poll() is None
    finally:
        for proc in (raylet, bystander, quitter or bystander):
            proc.kill()
            proc.wait()
