"""Killable worker processes for code that may hang: user rewards, dynamic-sampling filters, math-verify.

A :class:`WorkerPool` keeps a few long-lived processes (:mod:`slime_rl.core.infra.worker_main`),
each running one ``module:attr`` call at a time. A call that outlives its timeout gets
its worker killed (with anything it started) and replaced by a fresh one on next use; the
caller gets :class:`UserCodeTimeout`. Threads could not do this: a hung thread stays, and
hung threads in asyncio's default executor starve whatever else runs there (SGLang's
weight sync did). Each worker is waited on by one thread of the pool's own, never
asyncio's shared executor, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slime_rl.core.infra.plugins import PluginError

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # a fresh worker until it says ready (imports its preloads)
LOAD_TIMEOUT_S = 120.0  # importing the user's module (it may import transformers); not part of a call's timeout
_WORKER_SCRIPT = str(Path(__file__).with_name("worker_main.py"))
_LENGTH_BYTES = 4


class UserCodeError(RuntimeError):
    """The function raised, returned what cannot be sent back, or its worker died. The message
    reads on from the function's name: "raised ValueError: ...", "returned a ...", "died ..."."""


class WorkerStartError(UserCodeError):
    """A worker process did not start (a broken environment, or a preload that does not import)."""


class UserCodeTimeout(TimeoutError):
    """The call outlived its timeout; its worker was killed."""


class UserCodeLoadError(PluginError):
    """The function cannot be loaded (import error, no such attribute, not callable)."""


class WorkerProcess:
    """One worker process and its pipes; :meth:`request` blocks until the reply or the deadline."""

    def __init__(self, *, path: Sequence[str] = (), preload: Sequence[str] = (), quiet: bool = False):
        self.proc = subprocess.Popen(
            # A file, not -m: importing slime_rl.core would pull in torch. -P: its folder stays off sys.path.
            [sys.executable, "-P", _WORKER_SCRIPT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if quiet else None,
            start_new_session=True,  # its own process group: a kill takes what the user's code started too
        )
        self.loaded: set[str] = set()
        self._buffer = b""
        try:
            self._send({"path": [*path, *sys.path], "preload": list(preload)})
            ready = self._read(time.monotonic() + WORKER_START_TIMEOUT_S)
        except (EOFError, OSError):
            ready = None
        if ready != ("ready",):
            self.kill()
            raise WorkerStartError(f"could not start a worker process ({sys.executable} {_WORKER_SCRIPT}"
                                   + (f", preloading {', '.join(preload)})" if preload else ")"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, message: tuple, timeout_s: float) -> tuple | None:
        """The reply, or None at the deadline. Raises EOFError/OSError when the worker died."""
        self._send(message)
        return self._read(time.monotonic() + timeout_s)

    def _send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(len(data).to_bytes(_LENGTH_BYTES, "big") + data)
        self.proc.stdin.flush()

    def _read(self, deadline: float) -> Any:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buffer) >= _LENGTH_BYTES:
                size = int.from_bytes(self._buffer[:_LENGTH_BYTES], "big")
                if len(self._buffer) >= _LENGTH_BYTES + size:
                    frame = self._buffer[_LENGTH_BYTES:_LENGTH_BYTES + size]
                    self._buffer = self._buffer[_LENGTH_BYTES + size:]
                    return pickle.loads(frame)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:  # closed its stdout but lives on; kill() ends it
                    code = None
                raise EOFError(f"the worker process exited (code {code})")
            self._buffer += chunk

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class WorkerPool:
    """``size`` worker processes, started on first use; :meth:`call` blocks (from any thread),
    :meth:`acall` awaits without blocking the event loop."""

    def __init__(self, size: int, *, path: Sequence[str] = (), preload: Sequence[str] = (), quiet: bool = False,
                 name: str = "user-code"):
        self.size = size
        self._worker_args = dict(path=tuple(path), preload=tuple(preload), quiet=quiet)
        self._threads = ThreadPoolExecutor(size, thread_name_prefix=name)  # one waiting thread per worker
        self._slots: queue.Queue[WorkerProcess | None] = queue.Queue()
        for _ in range(size):
            self._slots.put(None)  # workers start on first use
        self._workers: set[WorkerProcess] = set()
        self._lock = threading.Lock()
        self._closed = False

    async def acall(self, spec: str, args: tuple, timeout_s: float) -> Any:
        return await self.run(self.call, spec, args, timeout_s)

    async def run(self, blocking: Callable[..., Any], *args: Any) -> Any:
        """``blocking(*args)`` on one of this pool's threads (there is one per worker)."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, blocking, *args)

    def call(self, spec: str, args: tuple, timeout_s: float) -> Any:
        """``spec(*args)`` in a worker. Raises UserCodeTimeout (worker killed), UserCodeError (the
        function raised, returned what cannot be pickled, or the worker died), UserCodeLoadError."""
        worker = self._slots.get()
        try:
            if worker is None:
                worker = self._start()
            if spec not in worker.loaded:
                self._ask(worker, ("load", spec), LOAD_TIMEOUT_S, f"{LOAD_TIMEOUT_S:g} s loading it",
                          UserCodeLoadError)
                worker.loaded.add(spec)
            return self._ask(worker, ("call", spec, args), timeout_s, f"{timeout_s:g} s", UserCodeError)
        except (UserCodeTimeout, UserCodeError, UserCodeLoadError) as err:
            if getattr(err, "worker_lost", False) and worker is not None:
                self._drop(worker)
                worker = None
            raise
        finally:
            self._slots.put(None if self._closed else worker)

    def _ask(self, worker: WorkerProcess, message: tuple, timeout_s: float, what: str,
             error: type[Exception]) -> Any:
        try:
            reply = worker.request(message, timeout_s)
        except (EOFError, OSError, pickle.PicklingError, TypeError, AttributeError) as err:
            if isinstance(err, EOFError | OSError):
                raise _lost(UserCodeError(f"died with its worker process ({err})")) from None
            raise error(f"got arguments that cannot be sent to a worker process ({err})") from None
        if reply is None:
            raise _lost(UserCodeTimeout(f"timed out after {what}; its worker process was killed"))
        if reply[0] == "error":
            raise error(reply[1])
        return reply[1]

    def _start(self) -> WorkerProcess:
        if self._closed:
            raise UserCodeError("the worker pool is closed")
        worker = WorkerProcess(**self._worker_args)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _drop(self, worker: WorkerProcess) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)

    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    def close(self) -> None:
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()


def _lost(err: Exception) -> Exception:
    err.worker_lost = True  # type: ignore[attr-defined]  # the pool replaces the worker
    return err


_user_pools: dict[int, WorkerPool] = {}
_user_pools_lock = threading.Lock()


def user_code_pool(size: int) -> WorkerPool:
    """The process-wide pool of ``size`` workers for user rewards and filters (one per size asked for)."""
    with _user_pools_lock:
        pool = _user_pools.get(size)
        if pool is None:
            pool = _user_pools[size] = WorkerPool(size)
            atexit.register(pool.close)
        return pool


def close_user_code_pools() -> None:
    with _user_pools_lock:
        pools = list(_user_pools.values())
        _user_pools.clear()
    for pool in pools:
        pool.close()


def is_user_code(spec: str) -> bool:
    """A ``module:attr`` spec (user code, run in workers), not a built-in name."""
    return ":" in spec
