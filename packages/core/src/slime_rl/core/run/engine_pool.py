"""Elastic rollout capacity for engines of one instance each (the hf engine; SGLang stand-ins): `EnginePool`
fronts several engines as one `RolloutEngine`, and engines join and leave it while a run goes.

- A new engine (`add_engines`) is built in a thread and serves no request until it holds the pool's weight
  version: the initial weights are version 0, anything later arrives by the next full sync (a joiner makes
  `delta_base` answer None, so the next sync is full: core/weights/delta.py).
- A removed engine (`remove_engine`) drains: it gets no new request, its in-flight requests are aborted
  and each is resumed on another engine from the tokens it made (a partial rollout: the caller sees one
  answer, its tokens and log-probs in order), then it shuts down. Nothing is lost or generated twice.
- ``stats`` reports ``engine/count`` (engines serving) and ``engine/requests_moved`` (cumulative).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.contracts import GenerateOutput, NamedTensors, RolloutEngine, SamplingParams
from slime_rl.core.weights.delta import DeltaChainBroken, apply_delta_bucket, is_delta_bucket

logger = logging.getLogger(__name__)


@dataclass
class Member:
    name: str
    engine: RolloutEngine
    state: str = "joining"  # joining -> serving -> draining
    in_flight: dict[str, int] = field(default_factory=dict)  # pool request id -> 1
    moving: set[str] = field(default_factory=set)  # aborted to be resumed elsewhere
    moved_out: int = 0  # of those, the ones the abort caught (one that finished first is no move)


class EnginePool(RolloutEngine):
    """Engines of one kind behind one `RolloutEngine`; ``build`` makes another (``from_config``, blocking)."""

    loads_delta_buckets = True  # rebuilt per engine, each from its own weights

    def __init__(self, build: Callable[[], RolloutEngine], first: RolloutEngine, *, max_engines: int = 8):
        self.build, self.max_engines = build, max_engines
        self._names = (f"engine-{i}" for i in itertools.count())
        self.members: dict[str, Member] = {}
        self._add(first, serving=True)
        self._ids = itertools.count()
        self.requests_moved = 0
        self._version = first.weight_version
        self._changed: asyncio.Event | None = None
        self.accepts_images = getattr(first, "accepts_images", False)  # every member is built the same way

    def _add(self, engine: RolloutEngine, *, serving: bool) -> Member:
        member = Member(next(self._names), engine, "serving" if serving else "joining")
        self.members[member.name] = member
        return member

    @property
    def weight_version(self) -> int:
        return self._version

    def serving(self) -> list[Member]:
        return [m for m in self.members.values() if m.state == "serving"]

    def placement(self) -> list[dict[str, object]]:
        """Each engine's name, state, version and requests in flight (the control endpoint's answer)."""
        return [{"name": m.name, "state": m.state, "weight_version": m.engine.weight_version,
                 "in_flight": len(m.in_flight)} for m in self.members.values()]

    # ------------------------------------------------------------------ joining and leaving

    async def add_engines(self, count: int) -> list[str]:
        """Start ``count`` engines; they serve once they hold the pool's version. Returns their names."""
        if count < 1:
            raise ValueError(f"add engines: count must be >= 1, got {count}")
        if len(self.members) + count > self.max_engines:
            raise ValueError(f"add engines: {len(self.members)} + {count} is over rollout.elastic.max_engines="
                             f"{self.max_engines}; raise it to add more")
        names = []
        for _ in range(count):
            engine = await asyncio.to_thread(self.build)
            # version 0 is the model's own weights: a joiner at the pool's version serves at once
            member = self._add(engine, serving=engine.weight_version == self._version)
            names.append(member.name)
            logger.info("elastic: %s joined (%s)", member.name, member.state)
        self._notify()
        return names

    async def remove_engine(self, name: str) -> int:
        """Drain engine ``name`` and shut it down; returns how many requests moved to other engines (a
        request that finished as it was asked to move is not one: it stayed)."""
        member = self.members.get(name)
        if member is None:
            raise KeyError(f"remove engine: no engine {name!r}; the run has {', '.join(self.members)}")
        if member.state == "serving" and len(self.serving()) == 1:
            raise ValueError(f"remove engine: {name} is the only engine serving; add one first")
        member.state = "draining"
        asked = list(member.in_flight)
        member.moving.update(asked)
        for request_id in asked:
            await member.engine.abort(f"{name}:{request_id}")
        while member.in_flight:
            await self._wait_change()
        del self.members[name]
        await member.engine.shutdown()
        logger.info("elastic: %s left; %d requests moved", name, member.moved_out)
        return member.moved_out

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=0.5)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ the contract

    async def generate(self, input_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, **images: Any) -> GenerateOutput:
        pool_id = request_id or f"r{next(self._ids)}"
        done: GenerateOutput | None = None
        while True:
            member = await self._pick(pool_id)
            member.in_flight[pool_id] = 1
            try:
                out = await member.engine.generate(input_ids, params, f"{member.name}:{pool_id}", **images)
            finally:
                member.in_flight.pop(pool_id, None)
                self._notify()
            done = out if done is None else _joined(done, out)
            if pool_id not in member.moving or out.finish_reason != "abort":
                member.moving.discard(pool_id)
                return done
            member.moving.discard(pool_id)  # drained: resume from the tokens made, on another engine
            self.requests_moved += 1
            member.moved_out += 1
            input_ids = input_ids + out.token_ids
            params = copy.copy(params)
            params.max_new_tokens -= len(out.token_ids)
            if params.max_new_tokens <= 0:
                done.finish_reason = "length"
                return done

    async def _pick(self, pool_id: str) -> Member:
        while True:
            serving = self.serving()
            if serving:
                session = pool_id.split("/", 1)[0] if "/" in pool_id else None
                if session is not None:  # a multi-turn episode's turns stay where its prefix is cached
                    return serving[hash(session) % len(serving)]
                return min(serving, key=lambda m: len(m.in_flight))
            await self._wait_change()

    async def abort(self, request_id: str | None = None) -> None:
        for member in list(self.members.values()):
            if request_id is None:
                await member.engine.abort(None)
            elif request_id in member.in_flight:
                await member.engine.abort(f"{member.name}:{request_id}")

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """A bucket into every engine: a delta rebuilt from each engine's own weights (one at another version
        refuses it: `DeltaChainBroken`, the sync is redone in full); a joiner takes full buckets only."""
        delta = is_delta_bucket(named_tensors)
        if delta:
            base = int(named_tensors[0][1][0])
            behind = [m.name for m in self.members.values()
                      if m.state != "joining" and m.engine.weight_version != base]
            if behind:
                raise DeltaChainBroken(f"{', '.join(behind)} not at weight version {base}; it needs a full sync")
        for member in list(self.members.values()):
            if delta and member.state == "joining":
                continue
            tensors = named_tensors
            if delta and not member.engine.loads_delta_buckets:
                tensors = apply_delta_bucket(named_tensors, member.engine.current_weight,
                                             held_version=member.engine.weight_version)
            await member.engine.update_weights(tensors, version=version, last=last)
            if last and member.state == "joining":
                member.state = "serving"
        if last:
            self._version = version
            self._notify()

    def current_weight(self, name: str) -> torch.Tensor:
        return self.serving()[0].engine.current_weight(name)

    async def pause_generation(self) -> bool:
        results = [await m.engine.pause_generation() for m in self.members.values()]
        return all(results)

    async def continue_generation(self) -> None:
        for member in self.members.values():
            await member.engine.continue_generation()

    async def release_memory(self) -> None:
        for member in self.members.values():
            await member.engine.release_memory()

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        for member in self.members.values():
            await member.engine.resume_memory(tags)

    async def health(self) -> bool:
        return all([await m.engine.health() for m in self.members.values()])

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for member in self.members.values():
            for key, value in member.engine.stats().items():
                out[key] = out.get(key, 0.0) + value
        out["engine/count"] = float(len(self.serving()))
        out["engine/requests_moved"] = float(self.requests_moved)
        return out

    async def shutdown(self) -> None:
        for member in list(self.members.values()):
            await member.engine.shutdown()


def member_builder(engine_cls: type[RolloutEngine], cfg: Any) -> Callable[[], RolloutEngine]:
    """``engine_cls.from_config`` for each engine that joins, with a logging.dir of its own
    (``<logging.dir>/engines/<n>``): an engine that writes there (SGLang's logs, keys and weight folders)
    never shares files with another."""
    joined = itertools.count(1)

    def build() -> RolloutEngine:
        member_cfg = cfg.model_copy(deep=True)
        member_cfg.logging.dir = str(Path(cfg.logging.dir) / "engines" / str(next(joined)))
        return engine_cls.from_config(member_cfg)

    return build


def _joined(first: GenerateOutput, rest: GenerateOutput) -> GenerateOutput:
    """One answer from a request's part before a move and its part after."""
    versions = None
    if first.token_versions is not None or rest.token_versions is not None:
        versions = ((first.token_versions or [first.weight_version] * len(first.token_ids))
                    + (rest.token_versions or [rest.weight_version] * len(rest.token_ids)))
    return GenerateOutput(token_ids=first.token_ids + rest.token_ids, log_probs=first.log_probs + rest.log_probs,
                          finish_reason=rest.finish_reason, weight_version=rest.weight_version,
                          token_versions=versions, cached_tokens=first.cached_tokens)
