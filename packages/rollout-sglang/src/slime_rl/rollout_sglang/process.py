"""Child processes (SGLang servers, the router): started in their own process group,
logged to a file, and always stopped, including when the parent exits on an error."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ChildProcess:
    name: str  # for messages: "sglang server 0", "sglang-router"
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the whole process group (SGLang forks schedulers and detokenizers), then SIGKILL."""
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children of the group may outlive the leader; make sure they go too.
        _signal_group(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        _RUNNING.pop(self.popen.pid, None)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# Every child still running when the interpreter exits is killed with its group.
_RUNNING: dict[int, ChildProcess] = {}


@atexit.register
def _stop_all() -> None:
    for child in list(_RUNNING.values()):
        child.stop(timeout=5.0)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM skips atexit; stop the children, then die of SIGTERM as before."""
    _stop_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_children_on_sigterm() -> None:
    # Only where nobody else handles SIGTERM (Ray, pytest plugins, servers install their own).
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def start_process(name: str, cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None) -> ChildProcess:
    """Start ``cmd`` in a new session (its own process group) with stdout and stderr to ``log_path``."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Private: SGLang logs its arguments, the run's keys among them.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        try:
            popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        except OSError as err:
            raise RuntimeError(f"{name}: cannot start {cmd[0]!r}: {err}") from None
    child = ChildProcess(name=name, popen=popen, log_path=log_path)
    _RUNNING[popen.pid] = child
    _stop_children_on_sigterm()
    return child


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
