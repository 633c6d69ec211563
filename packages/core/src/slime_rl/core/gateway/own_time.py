"""The gateway's own time on a call, and what is inside it.

A call's own work (checks, history match, tokenising, parsing, the response) runs in two parts around the
engine. `OwnTime` sums those parts three ways: by the clock, by CPU time on the gateway's thread (the clock less
the time the thread waited for a core or the GIL), and the collector's pauses that fell inside them (the clock
of `GC_PAUSES`): a step whose gateway share jumps says which of the three it was.
"""

from __future__ import annotations

import gc
import time


class GCPauses:
    """The collector's pauses in this process while it is installed (``gc.callbacks``): how many, their total."""

    def __init__(self) -> None:
        self.count, self.total_s, self._start = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count, self.total_s = self.count + 1, self.total_s + time.perf_counter() - self._start

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)


GC_PAUSES = GCPauses()  # the gateway's, installed by `Gateway.start`: one callback a collection, whatever runs


class OwnTime:
    """A stopwatch over the parts of one call the gateway spends itself; `stop` before awaiting the engine and
    `start` after it."""

    __slots__ = ("wall_s", "cpu_s", "gc_s", "_marks")

    def __init__(self) -> None:
        self.wall_s = self.cpu_s = self.gc_s = 0.0
        self.start()

    def start(self) -> None:
        self._marks = (time.perf_counter(), time.thread_time(), GC_PAUSES.total_s)

    def stop(self) -> OwnTime:
        wall, cpu, paused = self._marks
        self.wall_s += time.perf_counter() - wall
        self.cpu_s += time.thread_time() - cpu
        self.gc_s += GC_PAUSES.total_s - paused
        return self

    def totals(self) -> tuple[float, float, float]:
        """(by the clock, CPU time on the thread, the collector's pauses inside) in seconds."""
        return self.wall_s, self.cpu_s, self.gc_s
