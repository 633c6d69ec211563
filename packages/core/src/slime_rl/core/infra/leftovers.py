"""What a run keeps outside its logging dir, private to the user and gone when the run is.

Ray's temporary folder, the weight buckets in /dev/shm and the SGLang servers' key files live
in folders (mode 0700) named after the process that owns them: ``slime-rl-ray-<pid>.<start>-xxxx`` (base 36), where ``start``
is the process's start time, so a reused pid is not taken for the owner. A run removes them when it
ends; a run killed with SIGKILL cannot, so the next run removes every such folder whose owner
is gone (`remove_dead`), and a reaper process (`start_reaper`, this file run as a script)
removes them at once and ends the dead driver's Ray processes: Ray kills its GCS and raylet
with the driver (PR_SET_PDEATHSIG), but the raylet's agents and workers lingered ~60 s.

Standard library only: the reaper runs this file as a script, without torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

RAY_PREFIX = "slime-rl-ray-"
WEIGHTS_PREFIX = "slime-rl-weights-"
KEYS_PREFIX = "slime-rl-sglang-keys-"  # an SGLang server's --config with the run's keys, until it starts


def shared_memory_dir() -> str:
    """/dev/shm where the machine has it (RAM-backed), else the temporary folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _kinds() -> list[tuple[str, str]]:
    """(prefix, parent folder) of every kind of folder a run leaves."""
    return [(RAY_PREFIX, tempfile.gettempdir()), (WEIGHTS_PREFIX, shared_memory_dir()),
            (KEYS_PREFIX, tempfile.gettempdir())]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when the process does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), "" where there is no /proc (the
    pid alone then identifies it), None when it does not exist or is a zombie."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    stat = _stat(pid)
    return None if stat is None or stat[0] == "Z" else stat[19]


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, digit = divmod(number, 36)
        out = digits[digit] + out
        if not number:
            return out


def owner_tag(pid: int | None = None) -> str:
    """``<pid>.<start>`` in base 36: short, since Ray's socket paths under its folder must fit
    in 107 bytes."""
    pid = os.getpid() if pid is None else pid
    start = process_start(pid)
    return f"{_base36(pid)}.{_base36(int(start)) if start else ''}"


def owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition(".")
    try:
        now = process_start(int(pid, 36))
    except ValueError:
        return True  # not one of ours: leave it
    return now is not None and (not start or not now or _base36(int(now)) == start)


def private_folder(prefix: str, parent: str | None = None) -> Path:
    """A new folder owned by this process, readable by the user only."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=parent))  # mkdtemp: 0700


@contextlib.contextmanager
def weights_folder() -> Iterator[str]:
    """A private folder in shared memory for one weight sync, removed after it."""
    folder = private_folder(WEIGHTS_PREFIX, shared_memory_dir())
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _tag_of(name: str, prefix: str) -> str | None:
    if not name.startswith(prefix):
        return None
    tag = name[len(prefix):].split("-", 1)[0]
    return tag if "." in tag else None  # folders from before owners were recorded have none


def remove_dead(owner: str | None = None) -> list[Path]:
    """Remove this user's run folders whose owner is dead (or, with ``owner``, that owner's)."""
    removed = []
    for prefix, parent in _kinds():
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            tag = _tag_of(entry.name, prefix)
            if tag is None or (tag != owner if owner else owner_alive(tag)):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


# --- the reaper -----------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None:
            tree.setdefault(int(stat[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below ``pid``."""
    tree, found, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            start = process_start(child)
            if start is not None and child not in found:
                found[child] = start
                todo.append(child)
    return found


def start_reaper() -> subprocess.Popen | None:
    """Watch this process from another one; when it dies, kill what it started and remove its
    folders. Stop it with `stop_reaper` once this process has shut Ray down. Linux only."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", __file__, owner_tag()], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


def stop_reaper(reaper: subprocess.Popen | None) -> None:
    if reaper is not None and reaper.poll() is None:
        reaper.terminate()
        reaper.wait()


def _reap(tag: str, interval_s: float = 1.0) -> None:
    """The reaper's loop: track the driver's process tree while it lives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the driver's normal end
    pid = int(tag.split(".")[0], 36)
    tracked: dict[int, str] = {}
    while owner_alive(tag):
        tracked.update(descendants(pid))
        tracked = {p: s for p, s in tracked.items() if process_start(p) == s}
        time.sleep(interval_s)
    for child, start in tracked.items():
        if child != os.getpid() and process_start(child) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    remove_dead(owner=tag)


if __name__ == "__main__":
    _reap(sys.argv[1])
