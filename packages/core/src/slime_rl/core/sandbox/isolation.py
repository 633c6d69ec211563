"""What this machine's kernel lets the sandbox do, which uid a call runs as, and killing what a call
left behind.

Isolation comes in two levels:
- ``namespaces``: root with a kernel that allows unshare(2) of the network, mount and pid
  namespaces: no network at all (not even loopback), a new root of read-only binds with a tmpfs
  scratch, and every process of the call dies with the namespace's pid 1;
- ``none``: a separate process with rlimits, an empty environment and a scratch working directory,
  but the host's file system and network. As root it still drops to the call's uid, so the
  process-count limit holds and root-only files stay closed.
"""

from __future__ import annotations

import fcntl
import functools
import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "slime-rl-sandbox-uids"
MAX_UIDS = 4096  # the uids a machine's sandboxes draw from: uid_base .. uid_base + MAX_UIDS - 1


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
    return IsolationSupport("namespaces", "network, mount and pid namespaces (unshare as root)")


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
        LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in range(uid_base, uid_base + MAX_UIDS):
            fd = os.open(LOCK_DIR / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"rollout.sandbox.uid_base: all {MAX_UIDS} uids from {uid_base} are in use")

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


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
