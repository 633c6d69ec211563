"""What a run keeps outside its logging dir, private to the user and gone when the run is.

Ray's temporary folder, the weight buckets in /dev/shm and the SGLang servers' key files live
in folders (mode 0700) named after the process that owns them: ``slime-rl-ray-<pid>.<start>-xxxx`` (base 36), where ``start``
is the process's start time, so a reused pid is not taken for the owner. A run removes them when it
ends; a run killed with SIGKILL cannot, so the next run removes every such folder whose owner
is provably gone (`remove_dead`), and a reaper process (`start_reaper`, this file run as a script)
removes them at once and ends the dead driver's Ray processes: Ray kills its GCS and raylet
with the driver (PR_SET_PDEATHSIG), but the raylet's agents and workers lingered ~60 s.

A pid means nothing in another pid namespace (containers sharing /dev/shm or /tmp) or after a
reboot, so each folder also holds ``.owner.json``: the pid, its start time, the boot id and the
pid namespace. A folder is removed only when it is provably ours and dead: same boot, same pid
namespace, and the pid gone or started at another time. Any other folder is left alone.

Standard library only: the reaper runs this file as a script, without torch.
"""

from __future__ import annotations

import contextlib
import json
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


OWNER_RECORD = ".owner.json"  # in each folder: who made it, beyond the pid (see the module docstring)


def boot_id() -> str:
    """This boot of this machine (Linux), "" where there is none to read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of the pid namespace ``pid`` lives in; None where it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def owner_record(pid: int | None = None) -> dict[str, object]:
    """What `provably_dead` compares: the pid, its start time, the boot and the pid namespace."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": process_start(pid), "boot_id": boot_id(), "pid_ns": pid_namespace(pid)}


def provably_dead(folder: Path, tag: str) -> bool:
    """Whether ``folder``'s owner is this machine's, this boot's and this pid namespace's, and has
    exited (its pid gone or reused). Without a readable record, or made elsewhere: False (left alone)."""
    try:
        record = json.loads((folder / OWNER_RECORD).read_text())
        pid = int(tag.partition(".")[0], 36)
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("pid") != pid:
        return False
    if record.get("boot_id") != boot_id() or record.get("pid_ns") != pid_namespace():
        return False  # another boot or another container: its pids are not ours to look up
    return not owner_alive(tag)


def owner_alive(tag: str) -> bool:
    pid, _, start = tag.partition(".")
    try:
        now = process_start(int(pid, 36))
    except ValueError:
        return True  # not one of ours: leave it
    return now is not None and (not start or not now or _base36(int(now)) == start)


def private_folder(prefix: str, parent: str | None = None) -> Path:
    """A new folder owned by this process, readable by the user only, with its `owner_record`."""
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=parent))  # mkdtemp: 0700
    write_owner_record(folder, owner_record())
    return folder


def write_owner_record(folder: Path, record: dict[str, object]) -> None:
    """Until it is there, `remove_dead` leaves the folder alone: a run starting elsewhere cannot race it."""
    fd = os.open(folder / OWNER_RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)


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
    """Remove this user's run folders whose owner is provably dead (`provably_dead`), or, with
    ``owner`` (the reaper, which watched that process die), that owner's."""
    removed = []
    for prefix, parent in _kinds():
        try:
            entries = list(os.scandir(parent))
        except OSError:
            continue
        for entry in entries:
            tag = _tag_of(entry.name, prefix)
            if tag is None or (owner and tag != owner):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            if not owner and not provably_dead(Path(entry.path), tag):
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


def descendants(pid: int, tree: dict[int, list[int]] | None = None) -> dict[int, str]:
    """pid -> start time of every process below ``pid``."""
    tree, found, todo = tree if tree is not None else _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            start = process_start(child)
            if start is not None and child not in found:
                found[child] = start
                todo.append(child)
    return found


def ray_processes(folder: Path) -> dict[int, str]:
    """pid -> start time of a local Ray instance's processes: those whose command line names ``folder``, its
    temporary folder (the GCS, the raylet, the log monitor), and every process below them (the raylet's agents
    and workers, which retitle themselves ``ray::...``). Empty where there is no /proc."""
    if not Path("/proc/self/stat").exists():
        return {}
    needle, tree, found = str(folder).encode(), _children(), {}
    for pid in (pid for pids in tree.values() for pid in pids):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes() and (start := process_start(pid)) is not None:
                found[pid] = start
                found.update(descendants(pid, tree))
    return found


def end_processes(tracked: dict[int, str], grace_s: float = 0.0) -> list[int]:
    """Give the processes of ``tracked`` (pid -> start time) ``grace_s`` to exit, then SIGKILL those still
    running; a pid now held by another process (another start time) is left alone. Returns the pids killed."""
    deadline = time.monotonic() + grace_s
    alive = {pid: start for pid, start in tracked.items() if pid != os.getpid()}
    while True:
        alive = {pid: start for pid, start in alive.items() if process_start(pid) == start}
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(alive)


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
    end_processes(tracked)
    remove_dead(owner=tag)


if __name__ == "__main__":
    _reap(sys.argv[1])
