"""Every wait of the driver has a bound, set by that wait's own history.

The driver waits on the trainer ranks and the rollout worker (Ray references). A stopped or hung
process (a collective that never completes, a process in D state, SIGSTOP) used to hold a run
without a word. `StallWatch.get` is the driver's ``ray.get``: it waits with ``ray.wait`` in short
slices on each party's reference, so it knows which parties have not answered, and it keeps each
phase's durations (rollout, prepare, train, weight sync, save, eval ...):

- past ``cluster.stall_warn_factor`` x the phase's median (and at least `WARN_FLOOR_S`), one warning
  naming the phase and every party still pending (its pid, and its process state when it runs on
  the driver's node: ``stopped`` is a SIGSTOP, ``uninterruptible`` a D state); again each time the
  wait doubles;
- past both ``cluster.stall_fail_factor`` x the median and ``cluster.stall_fail_floor_s``, the run
  fails with one line (`StallError`).

A phase's first wait has no history and is legitimately slow (a 3B model's first step 80-88 s against
28-31 s later, a 7B model's first weight sync 15-19 s against 0.4 s): it warns only past the floor and
fails only past `FIRST_GRACE` x the floor. Here in infra, below weights/sync.py, which waits too.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_rl.core.config import Config, RunFailedError

WARN_FLOOR_S = 10.0  # no warning sooner (half stall_fail_floor_s when that is lower): short phases jitter
FIRST_GRACE = 3.0  # a phase's first wait fails past FIRST_GRACE x stall_fail_floor_s
HISTORY = 20  # durations kept per phase: the median follows a run whose steps slowly grow
POLL_S = 1.0  # ray.wait slices: how late a warning or the failure may come

# /proc/<pid>/stat's state letter, as a warning says it
_STATES = {"R": "running", "S": "sleeping", "D": "uninterruptible (D state: a driver or disk)",
           "T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "a zombie", "X": "dead"}


class StallError(RunFailedError):
    """A wait went past its bound; the message names the phase and who had not answered."""


@dataclass(frozen=True)
class StallBounds:
    warn_factor: float
    fail_factor: float
    fail_floor_s: float

    @classmethod
    def from_config(cls, cfg: Config) -> StallBounds:
        c = cfg.cluster
        return cls(c.stall_warn_factor, c.stall_fail_factor, c.stall_fail_floor_s)

    def limits(self, history: Sequence[float]) -> tuple[float, float]:
        """(warn after, fail after), in seconds, for a wait of a phase that took ``history`` before."""
        if not history:
            return self.fail_floor_s, FIRST_GRACE * self.fail_floor_s
        typical = statistics.median(history)
        return (max(self.warn_factor * typical, min(WARN_FLOOR_S, self.fail_floor_s / 2)),
                max(self.fail_factor * typical, self.fail_floor_s))


@dataclass(frozen=True)
class Party:
    """Who answers a reference: a trainer rank, the rollout worker. ``local``: on the driver's node,
    where its process state can be read."""

    label: str
    pid: int | None = None
    local: bool = False

    def describe(self) -> str:
        details = []
        if self.pid is not None:
            details.append(f"pid {self.pid}")
            state = process_state(self.pid) if self.local else None
            if state is not None:
                details.append(state)
        return f"{self.label} ({', '.join(details)})" if details else self.label


def process_state(pid: int) -> str | None:
    """The process's state from /proc ("stopped (SIGSTOP)", "sleeping" ...); None where unreadable."""
    try:
        letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _STATES.get(letter, letter)


def _ray_wait(refs: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
    import ray

    return ray.wait(refs, num_returns=len(refs), timeout=timeout)


def _ray_get(refs: list[Any]) -> list[Any]:
    import ray

    return ray.get(refs)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class StallWatch:
    """The driver's waits, each bounded by its phase's history (see the module docstring).

    ``register`` names the party behind an actor handle; ``get`` waits on references, each made by one
    of those actors. ``clock``, ``wait`` (``ray.wait(refs, timeout)`` with every ref asked for),
    ``get`` and ``report`` are Ray's and stderr's unless a test gives its own."""

    def __init__(self, bounds: StallBounds, *, clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[list[Any], float], tuple[list[Any], list[Any]]] = _ray_wait,
                 get: Callable[[list[Any]], list[Any]] = _ray_get,
                 report: Callable[[str], None] = _to_stderr, poll_s: float = POLL_S):
        self.bounds, self.clock, self._wait, self._get, self._report = bounds, clock, wait, get, report
        self.poll_s = poll_s
        self.history: dict[str, deque[float]] = {}
        self.parties: dict[Hashable, Party] = {}
        self.reports: list[str] = []  # every warning made, newest last

    def register(self, handle: Hashable, party: Party) -> None:
        self.parties[handle] = party

    def party(self, handle: Hashable) -> Party:
        return self.parties.get(handle) or Party(str(handle))

    def get(self, phase: str, refs: Sequence[Any], handles: Sequence[Hashable]) -> list[Any]:
        """``ray.get(refs)`` (``refs[i]`` made by the actor ``handles[i]``), warning and then failing
        as the module docstring says; an error of any party is raised as soon as it arrives."""
        if len(refs) != len(handles):
            raise ValueError(f"{len(refs)} references but {len(handles)} handles")
        history = self.history.setdefault(phase, deque(maxlen=HISTORY))
        warn_after, fail_after = self.bounds.limits(history)
        started = self.clock()
        results: dict[int, Any] = {}
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            elapsed = self.clock() - started
            if elapsed >= fail_after:
                raise StallError(self._failure(phase, elapsed, history, pending, handles, index))
            if elapsed >= warn_after:
                self._warn(phase, elapsed, history, fail_after, pending, handles, index)
                warn_after = 2 * elapsed
            timeout = max(0.0, min(self.poll_s, warn_after - elapsed, fail_after - elapsed))
            ready, pending = self._wait(pending, timeout)
            if ready:  # fetched now: a failed rank's error comes out while its peers hang in a collective
                for ref, value in zip(ready, self._get(list(ready)), strict=True):
                    results[index[ref]] = value
        history.append(self.clock() - started)
        return [results[i] for i in range(len(refs))]

    def _pending(self, pending: list[Any], handles: Sequence[Hashable], index: dict[Any, int]) -> str:
        return ", ".join(self.party(handles[index[ref]]).describe() for ref in pending)

    @staticmethod
    def _against(elapsed: float, history: Sequence[float]) -> str:
        if not history:
            return f"{elapsed:.0f} s, its first (no earlier one to compare with)"
        typical = statistics.median(history)
        return f"{elapsed:.0f} s, {elapsed / max(typical, 1e-9):.1f}x its median of {typical:.1f} s"

    def _warn(self, phase: str, elapsed: float, history: Sequence[float], fail_after: float,
              pending: list[Any], handles: Sequence[Hashable], index: dict[Any, int]) -> None:
        line = (f"slime-rl: stall: the {phase} wait has taken {self._against(elapsed, history)}; not answered:"
                f" {self._pending(pending, handles, index)}; the run fails at {fail_after:.0f} s")
        self.reports.append(line)
        self._report(line)

    def _failure(self, phase: str, elapsed: float, history: Sequence[float], pending: list[Any],
                 handles: Sequence[Hashable], index: dict[Any, int]) -> str:
        b = self.bounds
        bound = (f"past {FIRST_GRACE:g} x cluster.stall_fail_floor_s={b.fail_floor_s:g} s, a first wait's bound"
                 if not history else f"past cluster.stall_fail_factor={b.fail_factor:g} x the median and"
                 f" cluster.stall_fail_floor_s={b.fail_floor_s:g} s")
        return (f"cluster.stall_fail_floor_s: the {phase} wait stalled ({self._against(elapsed, history)}; {bound});"
                f" not answered: {self._pending(pending, handles, index)}. A stopped or hung process (a collective"
                " that never completes, a process in D state): read its log; if this phase is this slow by"
                " nature, raise cluster.stall_fail_floor_s or cluster.stall_fail_factor")
