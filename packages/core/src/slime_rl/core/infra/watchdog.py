"""A watchdog that reports an event loop blocked too long, naming the code that blocks it.

A custom generate function runs in the rollout's event loop (it awaits the engine). One
that blocks it (``time.sleep``, ``requests``, long CPU work in an ``async def``) stops
every request, the weight sync and the rewards, and nothing in the loop can notice. A
thread can: the loop ticks a heartbeat, and when the heartbeat is older than
``warn_after_s`` the thread logs where the loop's thread is, once per block and again each
time the block doubles. It only reports: a blocked loop cannot be unblocked from outside,
and a long synchronous stretch may be legitimate (a generate function tokenising a long
context); the report makes a hang visible instead of silent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import time
from types import FrameType

logger = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, warn_after_s: float, *, what: str = "event loop"):
        self.loop = loop
        self.warn_after_s = warn_after_s
        self.what = what
        self.reports: list[str] = []  # every report made, newest last (tests read them)
        self._beat = time.monotonic()
        self._loop_thread: int | None = None
        self._interval = min(1.0, warn_after_s / 4)
        self._stop = threading.Event()
        loop.call_soon_threadsafe(self._tick)
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        self._beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        if not self._stop.is_set() and not self.loop.is_closed():
            self.loop.call_later(self._interval, self._tick)

    def _watch(self) -> None:
        next_report = self.warn_after_s
        while not self._stop.wait(self._interval):
            if self.loop.is_closed():
                return
            blocked = time.monotonic() - self._beat
            if blocked < self.warn_after_s:
                next_report = self.warn_after_s
            elif blocked >= next_report:
                report = f"the {self.what} has been blocked for {blocked:.0f} s {self.where()}"
                self.reports.append(report)
                logger.warning("%s", report)
                next_report = 2 * blocked

    def where(self) -> str:
        """The async function running now, and the line the loop's thread is on."""
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "(the loop's thread is gone)"
        innermost = frame
        coroutine: FrameType | None = None
        while frame is not None:  # the innermost async function on the stack: the one that blocks
            if frame.f_code.co_flags & inspect.CO_COROUTINE:
                coroutine = frame
                break
            frame = frame.f_back
        at = f"{innermost.f_code.co_filename}:{innermost.f_lineno} ({innermost.f_code.co_name})"
        if coroutine is None:
            return f"at {at}"
        name = coroutine.f_code.co_qualname
        module = coroutine.f_globals.get("__name__", "?")
        return (f"in async function {module}.{name}, at {at}; a blocking call in async code (time.sleep, "
                "requests, long CPU work) holds up every request: await an async one, or move it to a thread")

    def stop(self) -> None:
        self._stop.set()
