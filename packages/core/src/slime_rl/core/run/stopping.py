"""SIGINT, SIGTERM, SIGHUP and SIGQUIT end a run one way: the wait in progress is left, Ray, the
engines and the run's processes are shut down (`local_ray`'s exit), and the run ends with one line
saying where it stopped and how to continue:

    stopped by SIGTERM during step 4 (3 done); last checkpoint: step 2 in runs/x/checkpoints; resume with --resume

Without this, SIGTERM ended the driver through Ray's own handler (``sys.exit``, no word), and SIGHUP
and SIGQUIT ended it at once, leaving the cleanup to the reaper (infra/leftovers.py), which is also
what cleans up after a SIGKILL: the next start removes whatever a killed run left. A second signal
while the run shuts down ends the process at once (the reaper then does the rest).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from slime_rl.core.config import Config, RunFailedError
from slime_rl.core.run import checkpoint

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
Callback = Callable[[str, dict[str, Any]], None]


class Stopped(BaseException):  # noqa: N818  (like KeyboardInterrupt: no `except Exception` swallows it)
    """Raised in the driver's main thread when a stop signal arrives."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.signum,)


class RunStoppedError(RunFailedError):
    """The run ended on a signal; ``str(err)`` is the final line, ``exit_code`` is 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.signum)


class StopSignals:
    """What a stop needs to say: the steps done so far (from the loop's events, `follow`)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.steps_done: int | None = None  # None: before the first step started
        self._previous: dict[int, Any] = {}

    def follow(self, notify: Callback) -> Callback:
        """``notify``, also counting the steps done (the "start" and "step" events)."""

        def followed(event: str, payload: dict[str, Any]) -> None:
            if event == "start":
                self.steps_done = payload.get("start_step", 0)
            elif event == "step":
                self.steps_done = payload["step"]
            notify(event, payload)

        return followed

    def arm(self) -> None:
        """Install the handlers (after ``ray.init``, which sets its own for SIGTERM). Main thread only:
        elsewhere Python allows no handler, and the signals keep their default."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, self._stop)

    def disarm(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        for other in STOP_SIGNALS:  # a second one while the run shuts down: out at once
            signal.signal(other, _exit_now)
        raise Stopped(signum)

    def final_message(self, signum: int) -> str:
        name = signal.Signals(signum).name
        if self.steps_done is None:
            where = "while starting (no step trained)"
        else:
            where = f"during step {self.steps_done + 1} ({self.steps_done} done)"
        save_dir = Path(self.cfg.checkpoint_dir)
        last = checkpoint.latest_name(save_dir)
        if last is None:
            return f"stopped by {name} {where}; no checkpoint was saved, so a new run starts from step 0"
        found = re.fullmatch(r"step_0*(\d+)", last)
        return (f"stopped by {name} {where}; last checkpoint: {f'step {found[1]}' if found else last} in"
                f" {save_dir}; resume with --resume (checkpoint.resume=true)")


def _exit_now(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)


@contextlib.contextmanager
def ending_on_signals(cfg: Config) -> Iterator[StopSignals]:
    """Around a run: a stop signal raised in it (once `StopSignals.arm` is called) leaves it, after the
    blocks inside have cleaned up, as `RunStoppedError` with the final message. The previous handlers
    come back at the end."""
    stops = StopSignals(cfg)
    try:
        yield stops
    except Stopped as stop:
        raise RunStoppedError(stops.final_message(stop.signum), stop.signum) from None
    finally:
        stops.disarm()
