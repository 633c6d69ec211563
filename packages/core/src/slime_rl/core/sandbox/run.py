"""Running one piece of Python in the sandbox: :func:`arun_python` (async, bounded by
``max_concurrency`` calls at a time per process) and :func:`run_python` (the same, blocking).

Each call is a fresh process tree: the launcher (launcher.py, as root) builds the isolation and
starts the code as the call's own uid; this side feeds it the job, reads its output up to
``max_output_bytes`` per stream, and afterwards kills whatever of the call's uid is still alive.
A call never raises for what the code does (loops, crashes, floods, escapes): the result says
what happened. It raises only for a broken sandbox (SandboxUnavailable, or the launcher failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from slime_rl.core.sandbox.isolation import (
    SandboxError,
    SandboxUnavailable,
    UidLease,
    isolation_support,
    kill_uid,
    remove_ipc_of,
    require_isolation_error,
)
from slime_rl.core.sandbox.settings import MIB, SandboxSettings

LAUNCHER = Path(__file__).with_name("launcher.py")
GRACE_S = 5.0  # the launcher enforces the wall clock; this side kills it only if it overstays by this much
READ_CHUNK = 65536
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/scratch",
            "TMPDIR": "/scratch", "PYTHONDONTWRITEBYTECODE": "1"}
SIGNAL_REASONS = {signal.SIGXCPU: "cpu time limit", signal.SIGXFSZ: "file size limit"}


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal or the wall clock
    signal: int | None = None  # the signal that ended the code, if one did
    timed_out: bool = False  # ran past timeout_s
    killed_reason: str | None = None  # "timeout", "cpu time limit", "file size limit", "output limit", ...
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    isolation: str = "none"  # "namespaces" or "none" (isolation.py)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None

    def observation(self) -> str:
        """The result as one text for a model: output, errors, and how the call ended when it failed."""
        parts = []
        if self.stdout:
            parts.append(self.stdout + ("\n[stdout truncated]" if self.stdout_truncated else ""))
        if self.stderr:
            parts.append(self.stderr + ("\n[stderr truncated]" if self.stderr_truncated else ""))
        if self.killed_reason:
            parts.append(f"[killed: {self.killed_reason}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


# --- the concurrency bound: one per event loop (asyncio) and one per process for blocking calls ---
_loop_limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_thread_limits: dict[int, threading.BoundedSemaphore] = {}
_thread_limits_lock = threading.Lock()


def _loop_limit(concurrency: int) -> asyncio.Semaphore:
    per_loop = _loop_limits.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault(concurrency, asyncio.Semaphore(concurrency))


async def arun_python(code: str, settings: SandboxSettings, *, stdin: str | None = None) -> SandboxResult:
    """Run ``code`` in the sandbox; at most ``settings.concurrency`` calls of this event loop at once
    (the rest wait their turn without blocking the loop)."""
    async with _loop_limit(settings.concurrency):
        return await _run_once(code, settings, stdin)


def run_python(code: str, settings: SandboxSettings, *, stdin: str | None = None) -> SandboxResult:
    """The blocking :func:`arun_python`, for threads and plain functions (``await arun_python`` in
    async code: this one cannot run inside an event loop's thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_python blocks; in async code use `await arun_python(...)`")
    with _thread_limits_lock:
        limit = _thread_limits.setdefault(settings.concurrency, threading.BoundedSemaphore(settings.concurrency))
    with limit:
        return asyncio.run(_run_once(code, settings, stdin))


def _open_to_others(path: str) -> bool:
    """Whether an unprivileged uid can run ``path`` (every directory above it searchable by others)."""
    real = Path(os.path.realpath(path))
    return all(p.stat().st_mode & 0o001 for p in (real, *real.parents))


def _interpreter(settings: SandboxSettings, isolated: bool) -> str:
    """The code's interpreter. Without namespaces it must be reachable by the call's uid as it is on
    the host (a pyenv under /root is not): then fall back to the system's python3."""
    python = settings.interpreter
    if isolated or os.geteuid() != 0 or _open_to_others(python):
        return python
    if settings.python is None:
        for system_python in ("/usr/bin/python3", "/usr/local/bin/python3"):
            if os.path.exists(system_python) and _open_to_others(system_python):
                return system_python
    raise SandboxError(f"rollout.sandbox.python: {python} cannot be run by an unprivileged uid (a directory above it"
                       " is closed to others) and this machine has no namespaces to bind it; give an interpreter"
                       " outside /root, e.g. /usr/bin/python3")


def _job(code: str, settings: SandboxSettings, stdin: str | None, uid: int, isolated: bool, place: str) -> dict:
    python = _interpreter(settings, isolated)
    prefix = str(Path(os.path.realpath(python)).parents[1])  # the interpreter's own tree (/usr, a pyenv, ...)
    return {
        "code": code, "stdin": stdin, "uid": uid, "isolated": isolated, "python": python,
        "root": place, "scratch": place, "scratch_mb": settings.scratch_mb, "timeout_s": settings.timeout_s,
        "readonly_paths": [prefix, *settings.readonly_paths],
        "env": {**BASE_ENV, **({} if isolated else {"HOME": place, "TMPDIR": place}), **settings.env},
        "limits": {"cpu_s": settings.cpu_time_s, "memory_bytes": settings.memory_mb * MIB,
                   "file_size_bytes": settings.file_size_mb * MIB, "processes": settings.max_processes,
                   "open_files": settings.max_open_files},
    }


async def _run_once(code: str, settings: SandboxSettings, stdin: str | None,
                    *, isolated: bool | None = None) -> SandboxResult:
    if isolated is None:
        if settings.require_isolation and (error := require_isolation_error()):
            raise SandboxUnavailable(f"rollout.sandbox.require_isolation: {error}")
        isolated = (await asyncio.to_thread(isolation_support)).isolated  # the first call probes
    lease = UidLease(settings.uid_base)
    swept = False  # whether the launcher's init killed every process of the call itself
    place = tempfile.mkdtemp(prefix="slime-sandbox-")  # isolated: the new root's mount point; else the scratch
    try:
        if not isolated and os.geteuid() == 0:
            os.chown(place, lease.uid, lease.uid)
            os.chmod(place, 0o700)
        job = _job(code, settings, stdin, lease.uid, isolated, place)
        result, swept = await _launch(job, settings)
        return result
    finally:
        # A namespace whose init reported back took every process of the call with it; otherwise
        # (no namespaces, the call killed from here, an error) kill what is left of the uid.
        if not (isolated and swept):
            await asyncio.to_thread(kill_uid, lease.uid)
        if not isolated:  # no IPC namespace took the call's SysV objects with it
            await asyncio.to_thread(remove_ipc_of, lease.uid)
        lease.release()
        shutil.rmtree(place, ignore_errors=True)


async def _launch(job: dict, settings: SandboxSettings) -> tuple[SandboxResult, bool]:
    """The result, and whether the launcher's init ran to the end (then it killed every process of
    the call in its namespace) rather than being killed from here."""
    status_read, status_write = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            job["python"], "-I", "-S", str(LAUNCHER),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=(status_write,), env={"PATH": BASE_ENV["PATH"]}, start_new_session=True)
    finally:
        os.close(status_write)
    with contextlib.closing(os.fdopen(status_read, "rb")) as status_pipe:
        killed_reason = None

        def kill(reason: str) -> None:
            nonlocal killed_reason
            killed_reason = killed_reason or reason
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's death takes its namespace with it

        proc.stdin.write(json.dumps({**job, "status_fd": status_write}).encode())
        proc.stdin.close()
        streams = [_read_capped(proc.stdout, settings.max_output_bytes, kill),
                   _read_capped(proc.stderr, settings.max_output_bytes, kill)]
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(
                asyncio.gather(*streams), settings.timeout_s + GRACE_S)
            await asyncio.wait_for(proc.wait(), GRACE_S)
        except TimeoutError:  # the launcher itself overstayed: kill everything
            kill("timeout")
            await proc.wait()
            out, out_cut, err, err_cut = b"", False, b"", False
        status = json.loads(status_pipe.read() or b"{}")
    if "setup_error" in status:
        raise SandboxError(f"the sandbox could not start the code: {status['setup_error']}")
    if not status and killed_reason is None:
        raise SandboxError(f"the sandbox launcher exited with {proc.returncode} without a status;"
                           f" its stderr: {err.decode(errors='replace')[-500:]}")
    killed_here = killed_reason is not None
    sig = status.get("signal")
    if status.get("timed_out"):
        killed_reason = killed_reason or "timeout"
    elif sig is not None:
        killed_reason = killed_reason or SIGNAL_REASONS.get(sig, f"signal {signal.Signals(sig).name}")
    init_finished = bool(status) and not killed_here
    return SandboxResult(
        stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
        exit_code=status.get("exit_code"), signal=sig, timed_out=bool(status.get("timed_out")) or
        killed_reason == "timeout", killed_reason=killed_reason, stdout_truncated=out_cut,
        stderr_truncated=err_cut, duration_s=status.get("duration_s", 0.0),
        isolation="namespaces" if job["isolated"] else "none"), init_finished


async def _read_capped(stream: asyncio.StreamReader, cap: int, kill) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of the stream; more than that kills the call (a 1 GB print stops here)."""
    chunks, size = [], 0
    while chunk := await stream.read(READ_CHUNK):
        if size + len(chunk) > cap:
            chunks.append(chunk[:cap - size])
            kill("output limit")
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


def probe_namespaces() -> str | None:
    """Run ``pass`` with namespaces once: None when that works, else why not."""
    outcome: list = []

    def probe() -> None:  # in its own thread: the caller may be inside an event loop
        try:
            outcome.append(asyncio.run(_run_once("pass", SandboxSettings(), None, isolated=True)))
        except Exception as err:  # whatever fails here means: no namespaces
            outcome.append(" ".join(str(err).split()))

    thread = threading.Thread(target=probe, name="sandbox-probe")
    thread.start()
    thread.join()
    result = outcome[0]
    if isinstance(result, str):
        return result
    if result.exit_code != 0:
        return f"a trivial call exited with {result.exit_code}: {result.stderr.strip()[-300:]}"
    return None
