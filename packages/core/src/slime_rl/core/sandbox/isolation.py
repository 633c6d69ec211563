"""What this machine's kernel lets the sandbox do, which uid a call runs as, and killing what a call
left behind.

Isolation comes in two levels:
- ``namespaces``: root with a kernel that allows unshare(2) of the network, mount, pid and IPC
  namespaces: no network at all (not even loopback), a new root of read-only binds with a tmpfs
  scratch, no SysV IPC object of the host's and none that outlives the call, and every process of
  the call dies with the namespace's pid 1;
- ``none``: a separate process with rlimits, an empty environment and a scratch working directory,
  but the host's file system, network and SysV IPC. As root it still drops to the call's uid, so the
  process-count limit holds, root-only files stay closed, and the SysV objects of that uid are
  removed after the call.
Both levels give the code a fresh session keyring (launcher.py), never the caller's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import signal
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAX_UIDS = 4096  # the uids a machine's sandboxes draw from: uid_base .. uid_base + MAX_UIDS - 1
IPC_RMID = 0


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code it ran): the launcher could not set up a call."""


def default_lock_dir() -> Path:
    """Where the uid locks live, shared by every sandbox of this uid on the machine. As root:
    ``/run`` when only root can write there (no other user can plant the folder first); else a
    per-uid name in the temp folder, which UidLease trusts only when it is ours (owner, 0700, no link)."""
    run = Path("/run")
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            info = run.lstat()
            if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022:
                return run / "slime-rl-sandbox-uids"
    return Path(tempfile.gettempdir()) / f"slime-rl-sandbox-uids-{os.geteuid()}"


LOCK_DIR = default_lock_dir()


class SandboxUnavailable(RuntimeError):
    """``rollout.sandbox.require_isolation`` is set and this machine cannot isolate a call."""


@dataclass(frozen=True)
class IsolationSupport:
    level: str  # "namespaces" or "none"
    reason: str  # why, in words (for doctor and errors)

    @property
    def isolated(self) -> bool:
        return self.level == "namespaces"


@functools.cache
def isolation_support() -> IsolationSupport:
    """Probed once per process: runs one trivial sandboxed call with namespaces and sees if it worked."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return IsolationSupport("none", "no Linux namespaces on this system")
    if os.geteuid() != 0:
        return IsolationSupport("none", "not root: the sandbox needs root to unshare namespaces and drop to its uids")
    from slime_rl.core.sandbox.run import probe_namespaces  # run.py imports this module

    error = probe_namespaces()
    if error:
        return IsolationSupport("none", f"the kernel refused the namespaces: {error}")
    return IsolationSupport("namespaces", "network, mount, pid and IPC namespaces (unshare as root)")


def require_isolation_error() -> str | None:
    """The message refusing ``rollout.sandbox.require_isolation=true`` here, or None when it holds."""
    support = isolation_support()
    if support.isolated:
        return None
    return (f"this machine cannot isolate sandboxed code ({support.reason}); run as root on a Linux kernel"
            " that allows unshare(2), or set rollout.sandbox.require_isolation=false to run without namespaces")


class UidLease:
    """One uid for one call, held with an flock so that no other call, in this process or another,
    uses it at the same time (killing the uid's processes afterwards must hit only this call's)."""

    def __init__(self, uid_base: int):
        folder = _open_lock_dir(LOCK_DIR)
        try:
            for uid in range(uid_base, uid_base + MAX_UIDS):
                # O_NOFOLLOW: a lock file is never a link, even in a folder that is ours
                fd = os.open(str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return
        finally:
            os.close(folder)
        raise RuntimeError(f"rollout.sandbox.uid_base: all {MAX_UIDS} uids from {uid_base} are in use")

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


def _open_lock_dir(path: Path) -> int:
    """A descriptor of the lock folder, created 0700 if missing, and only if it is a real folder (no
    symlink) owned by us and closed to others: one planted by another user would let them redirect
    root's lock files or hold every lock."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fix = "remove it (or set TMPDIR to a private folder) and retry"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise SandboxError(f"sandbox uid lock folder {path} is not a plain folder ({err.strerror}): {fix}") from None
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise SandboxError(f"sandbox uid lock folder {path} is owned by uid {info.st_uid} with mode"
                           f" {stat.S_IMODE(info.st_mode):o}, not ours with 700: {fix}")
    return fd


def processes_of(uid: int) -> list[int]:
    """Pids whose real uid is ``uid`` (host pids; a namespace's processes are listed too), zombies
    (dead, waiting for their parent to collect them) left out."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            if int(fields[b"Uid"].split()[0]) == uid and not fields[b"State"].strip().startswith(b"Z"):
                pids.append(int(entry.name))
        except (OSError, KeyError, ValueError):
            continue
    return pids


def kill_uid(uid: int, *, rounds: int = 50) -> int:
    """SIGKILL every process of ``uid`` until none is left (a fork bomb forks while we kill);
    returns how many were killed. Only for the sandbox's own uids, never a real user's."""
    if os.geteuid() != 0:
        return 0  # not root: the code ran as our own uid and we cannot tell its processes from ours
    killed = 0
    for _ in range(rounds):
        pids = processes_of(uid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def remove_ipc_of(uid: int) -> int:
    """Without an IPC namespace: remove every SysV shared-memory segment, message queue and semaphore
    set owned by ``uid`` (they outlive the processes that made them); returns how many. Only for the
    sandbox's own uids, as root."""
    if os.geteuid() != 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"shm": lambda i: libc.shmctl(i, IPC_RMID, None), "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
              "sem": lambda i: libc.semctl(i, 0, IPC_RMID)}
    removed = 0
    for kind, remove_one in remove.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except OSError:
            continue  # no SysV IPC in this kernel
        id_column, uid_column = 1, header.index("uid")
        for row in rows:
            if int(row[uid_column]) == uid and remove_one(int(row[id_column])) == 0:
                removed += 1
    return removed
