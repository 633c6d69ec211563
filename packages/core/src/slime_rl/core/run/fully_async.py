"""Fully asynchronous rollout (``cluster.async_mode: fully``): the engines never wait for the trainer.

A producer task in the rollout worker's event loop keeps groups in flight: it submits prompt
groups (held-over ones first, then the data source) while fewer than
``rollout.over_sampling_batch_size`` are generating and, AReaL's bound, the groups trained, ready
and generating number fewer than ``(version + eta + 1) * rollout_batch_size`` (version: the engine's
weights; eta = ``rollout.max_staleness``, 1 when unset): generation runs at most eta versions ahead
of the trainer, so with a fast engine nothing is generated only to be dropped as stale. Filtered
and dropped groups take no trainer slot: the producer replaces them.
Each finished group is scored and put through the dynamic-sampling filter as in a synchronous
rollout; kept ones wait in ``ready``.

`next_batch` (the trainer's next step) returns as soon as ``rollout_batch_size`` eligible groups
are ready: under ``staleness_policy: drop`` a group whose oldest token is more than eta versions
behind the trainer is dropped, and recorded (core/staleness.py). Which ready groups go first is
``rollout.buffer_filter`` (``oldest_first``: arrival order; ``stalest_first``: oldest token first).

Weight updates land while requests run (the rollout worker pauses the engine around the load:
`RolloutEngine.pause_generation`); an engine that cannot pause is aborted instead, and its
requests come back here as partial rollouts that continue from their tokens.

Every group ends in exactly one of: trained (handed to the trainer), filtered (dynamic filter),
failed (reward/filter/generate failed), dropped_stale. The ledger of group indexes is part of the
JSON state (`state_dict`), with the ready groups and the in-flight ones as they were submitted
(the prompt, or the partial response they resumed from, with its token versions): a resume
regenerates the in-flight ones and skips and repeats nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from slime_rl.core.algorithms import staleness
from slime_rl.core.algorithms.filters import BUFFER_FILTERS
from slime_rl.core.config import Config
from slime_rl.core.contracts import DataSource
from slime_rl.core.infra.plugins import load_function
from slime_rl.core.run.rollout import FailedSamples, RolloutRunner, ScoredGroups, sampling_params
from slime_rl.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)

Group = list[Sample]
STATE_FORMAT = 1


@dataclass
class Ledger:
    """Group indexes by how they ended (JSON: lists of ints)."""

    trained: list[int] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    dropped_stale: list[int] = field(default_factory=list)


class FullyAsyncRollout:
    """See the module docstring. Lives in one event loop (the rollout worker's); not thread-safe."""

    def __init__(self, cfg: Config, runner: RolloutRunner, data_source: DataSource,
                 weight_version: Callable[[], int]):
        self.cfg, self.runner, self.data_source, self.weight_version = cfg, runner, data_source, weight_version
        self.eta = cfg.rollout.max_staleness
        self.in_flight_cap = cfg.over_sampling_batch_size
        self.ahead = self.eta if self.eta is not None else 1  # versions generation may run ahead
        self.order = load_function(cfg.rollout.buffer_filter or "oldest_first", BUFFER_FILTERS,
                                   what="rollout.buffer_filter")
        self.ready: list[Group] = []
        self.in_flight: dict[int, list[dict[str, Any]]] = {}  # group_index -> the group as submitted (JSON)
        self.held_over: list[Group] = []  # in flight at the checkpoint a resume loaded: submitted first
        self.ledger = Ledger()
        self.source_exhausted = False
        self.counts = {"groups_seen": 0, "requeued_aborted": 0}
        self.failed_samples = FailedSamples()  # since the last batch
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()  # one task per group generating
        self._changed: asyncio.Event | None = None  # a group finished (or the producer stopped)
        self._space: asyncio.Event | None = None  # next_batch took groups: room to submit more

    # ---------------------------------------------------------------- the producer

    def start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        self._changed, self._space = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._produce(), name="fully-async-producer")
        self._task.add_done_callback(lambda _: self._changed.set())  # a failed producer wakes next_batch

    @property
    def finished(self) -> bool:
        """Nothing more will come: the data is used up and nothing is generating."""
        return self.source_exhausted and not self.held_over and not self.in_flight

    def _next_group(self) -> Group | None:
        if self.held_over:
            return self.held_over.pop(0)
        if self.source_exhausted:
            return None
        groups = self.data_source.get_groups(1)
        if not groups:
            self.source_exhausted = True
            return None
        return groups[0]

    async def _produce(self) -> None:
        params = sampling_params(self.cfg)
        running = self._running
        while True:
            self._space.clear()
            while len(running) < self.in_flight_cap and self._below_bound(len(running)):
                group = self._next_group()
                if group is None:
                    break
                self.in_flight[group[0].group_index] = [s.to_dict() for s in group]
                running.add(asyncio.ensure_future(self._run_group(group, params)))
            if not running:
                self._changed.set()
                if self.finished:
                    return
                await self._space.wait()
                continue
            space = asyncio.ensure_future(self._space.wait())
            done, _ = await asyncio.wait({*running, space}, return_when=asyncio.FIRST_COMPLETED)
            space.cancel()
            for task in done - {space}:
                running.discard(task)
                task.result()  # a bug in here ends the producer; next_batch reports it

    def _below_bound(self, running: int) -> bool:
        """AReaL's admission rule: trained + ready + generating < (version + eta + 1) * batch."""
        limit = (self.weight_version() + self.ahead + 1) * self.cfg.data.rollout_batch_size
        return len(self.ledger.trained) + len(self.ready) + running < limit

    async def _run_group(self, group: Group, params: Any) -> None:
        group_index = group[0].group_index
        samples = await self.runner._generate_group(group, params)
        # An engine that could not pause was aborted for a weight update: continue from the tokens made.
        while any(s.status in (SampleStatus.PENDING, SampleStatus.ABORTED) for s in samples):
            self.counts["requeued_aborted"] += 1
            samples = await self.runner._generate_group(samples, params)
        verdict = await self.runner._filter(samples) if all(s.reward is not None for s in samples) else None
        self.counts["groups_seen"] += 1
        self.failed_samples.add(samples)
        del self.in_flight[group_index]
        if verdict is None:
            self.ledger.failed.append(group_index)
        elif not verdict:
            self.ledger.filtered.append(group_index)
        else:
            self.ready.append(samples)
        self._changed.set()

    # ---------------------------------------------------------------- the trainer's side

    async def next_batch(self, current_version: int) -> ScoredGroups:
        """``rollout_batch_size`` eligible groups (fewer only when the data ran out), as soon as they exist."""
        want = self.cfg.data.rollout_batch_size
        self.start()
        self._space.set()  # the weights may be newer since the last call: room to submit under the bound
        while True:
            self._changed.clear()
            if self._task.done() and self._task.exception() is not None:
                await self.stop()  # the other groups' tasks: cancelled, their errors collected
                raise RuntimeError("the fully async producer failed") from self._task.exception()
            self._drop_stale(current_version)
            failure = self._failure()
            if failure is not None or len(self.ready) >= want or (self.finished and self._task.done()):
                break
            await self._changed.wait()
        picks = list(self.order(self.ready, want)) if failure is None else []
        groups = [self.ready[i] for i in picks]
        self.ready = [g for i, g in enumerate(self.ready) if i not in set(picks)]
        groups.sort(key=lambda g: g[0].group_index)  # data order, not finishing order
        self.ledger.trained.extend(g[0].group_index for g in groups)
        self._space.set()
        metrics = {
            "rollout/groups_seen": float(self.counts["groups_seen"]),
            "rollout/samples_failed": float(self.failed_samples.failed),
            "rollout/step_failed": float(failure is not None),
            "fully_async/ready_groups": float(len(self.ready)),
            "fully_async/in_flight_groups": float(len(self.in_flight)),
            "fully_async/requeued_aborted": float(self.counts["requeued_aborted"]),
            "fully_async/filtered_total": float(len(self.ledger.filtered)),
            "fully_async/dropped_stale_total": float(len(self.ledger.dropped_stale)),
        }
        metrics.update(self.runner._metrics(groups, 0.0))
        metrics.pop("rollout/time", None)
        metrics.pop("rollout/tokens_per_s", None)
        if failure is None:
            self.failed_samples.log_tolerated(self.cfg.rollout.max_failed_fraction)
        self.counts["groups_seen"] = 0
        self.failed_samples = FailedSamples()
        return ScoredGroups(groups, metrics, exhausted=self.finished and not self.ready, failure=failure)

    def _drop_stale(self, current_version: int) -> None:
        """Under ``drop``, groups whose oldest token is more than eta behind; under ``mask``, groups
        with no token left to train on. Both are recorded as dropped_stale."""
        if self.eta is None or self.cfg.rollout.staleness_policy == "downweight":
            return
        keep = []
        for group in self.ready:
            stale = not staleness.eligible(group, current_version, self.eta) if (
                self.cfg.rollout.staleness_policy == "drop") else all(
                current_version - v > self.eta for s in group for v in s.versions_per_token())
            if stale:
                self.ledger.dropped_stale.append(group[0].group_index)
            else:
                keep.append(group)
        if len(keep) < len(self.ready):
            self._space.set()
        self.ready = keep

    def _failure(self) -> str | None:
        if self.failed_samples.seen < self.cfg.data.rollout_batch_size * self.cfg.data.n_samples_per_prompt:
            return None
        return self.failed_samples.over(self.cfg.rollout.max_failed_fraction)

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """JSON only: the ready groups, the in-flight ones as submitted, the ledger."""
        return {
            "format": STATE_FORMAT,
            "ready": [[s.to_dict() for s in g] for g in self.ready],
            "in_flight": [*([s.to_dict() for s in g] for g in self.held_over), *self.in_flight.values()],
            "ledger": asdict(self.ledger),
            "source_exhausted": self.source_exhausted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._task is not None:
            raise RuntimeError("load the fully async state before the producer starts")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"fully async state format {state.get('format')!r} is not {STATE_FORMAT}")
        self.ready = [[Sample.from_dict(d) for d in g] for g in state["ready"]]
        self.held_over = [[Sample.from_dict(d) for d in g] for g in state["in_flight"]]
        self.ledger = Ledger(**state["ledger"])
        self.source_exhausted = bool(state["source_exhausted"])

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()  # a done one is left as it is; gather collects its error
        await asyncio.gather(*tasks, return_exceptions=True)
