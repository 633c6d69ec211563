"""Trainer ranks for the scale simulation (docs/scale.md): hundreds of real `TrainerWorker`s in a handful of
Ray actors, each rank with a stand-in trainer that does no model math.

One Ray actor per rank at 1,024 ranks would need ~200 GB on a 24 GiB machine and measure only contention.
A `RankHost` actor builds the real `TrainerWorker` of each rank it hosts (config validation, the trainer
plugin, the shard check) and runs every collective call of the loop on all of them at once, one thread a
rank: each rank fetches its own shard from the object store, and the data-parallel sums of advantages and
metrics are real sums over the ranks (`HostCollective` in the host, a `Reducer` actor across hosts), in
place of the trainer's all-reduce. `HostedTrainerGroup` is `run.loop.TrainerGroup`'s interface over the
hosts, so the loop's own step functions (`_train_on`, `_sync_after_train`, `_save`) and `WeightSync` drive
them; it counts the calls the real group would make (one per rank) beside the ones it makes (one per host).

Load the stand-in trainer as ``trainer.backend=slime_rl.core.testing.scale_ranks:StandinRank``.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.contracts import NamedTensors, PolicyTrainer
from slime_rl.core.infra.stall import Party, StallWatch

GroupKey = tuple[int, int]  # (tp rank, pp rank): the ranks with one key form a data-parallel group


def rank_coords(rank: int, tp: int, pp: int, world: int) -> tuple[int, int, int]:
    """(tp, dp, pp) rank in megatron's order, as `config.placement.plan_placement` numbers them."""
    dp = world // (tp * pp)
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


class Reducer:
    """Across hosts: sums each host's partial sums of a collective round and hands every host the total
    (an async Ray actor; one call per host per round)."""

    def __init__(self, hosts: int):
        self.hosts = hosts
        self.rounds: dict[int, dict[str, Any]] = {}

    async def reduce(self, round_id: int, partial: dict[GroupKey, torch.Tensor]) -> dict[GroupKey, torch.Tensor]:
        entry = self.rounds.setdefault(round_id, {"sum": {}, "arrived": 0, "left": self.hosts,
                                                  "done": asyncio.Event()})
        for key, tensor in partial.items():
            entry["sum"][key] = entry["sum"][key] + tensor if key in entry["sum"] else tensor.clone()
        entry["arrived"] += 1
        if entry["arrived"] == self.hosts:
            entry["done"].set()
        await entry["done"].wait()
        entry["left"] -= 1
        if not entry["left"]:
            del self.rounds[round_id]
        return entry["sum"]


class HostCollective:
    """The data-parallel sum of the ranks one host holds: each rank's thread adds its tensor; the last to
    arrive sends the host's partial sums to the `Reducer` and every thread takes its group's total."""

    def __init__(self, groups: dict[int, GroupKey], reducer: Any):
        self.groups, self.reducer = groups, reducer
        self.cond = threading.Condition()
        self.next_round = Counter()  # rank -> its next round
        self.pending: dict[int, dict[str, Any]] = {}
        self.rounds = 0  # cross-host reductions made (messages to the reducer)

    def sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        import ray

        key = self.groups[rank]
        with self.cond:
            round_id = self.next_round[rank]
            self.next_round[rank] += 1
            entry = self.pending.setdefault(round_id, {"sum": {}, "arrived": 0, "total": None,
                                                       "left": len(self.groups)})
            entry["sum"][key] = entry["sum"][key] + tensor if key in entry["sum"] else tensor.clone()
            entry["arrived"] += 1
            last = entry["arrived"] == len(self.groups)
        if last:
            total = ray.get(self.reducer.reduce.remote(round_id, entry["sum"]))
            with self.cond:
                entry["total"] = total
                self.rounds += 1
                self.cond.notify_all()
        with self.cond:
            while entry["total"] is None:
                self.cond.wait()
            entry["left"] -= 1
            if not entry["left"]:
                del self.pending[round_id]
            return entry["total"][key].clone()


_BUILDING: HostCollective | None = None  # the collective of the host building its ranks (StandinRank.from_config)


class StandinRank(PolicyTrainer):
    """One trainer rank without a model: zero log-probs, the data-parallel sums of its host, and as weights
    the model folder's tensors shifted by the number of steps trained (so each version differs). Its metrics
    say how many times each position of the step was trained over the data-parallel ranks."""

    def __init__(self, cfg, rank: int, collective: HostCollective):
        p = cfg.parallel
        self.cfg, self.rank, self.collective = cfg, rank, collective
        self.tp_rank, self.dp_rank, self.pp_rank = rank_coords(rank, p.tensor_model_parallel_size,
                                                               p.pipeline_model_parallel_size, cfg.actor_num_gpus)
        self.steps = 0

    @classmethod
    def from_config(cls, cfg, *, role="actor") -> StandinRank:
        if _BUILDING is None:
            raise RuntimeError("StandinRank is built by a RankHost (slime_rl.core.testing.scale_ranks)")
        return cls(cfg, int(os.environ["RANK"]), _BUILDING)

    @property
    def data_parallel_rank(self) -> int:
        return self.dp_rank

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.collective.sum(self.rank, tensor)

    def compute_log_probs(self, batch, *, model="actor") -> torch.Tensor:
        return torch.zeros(batch.num_response_tokens)

    def train_step(self, batch) -> dict[str, float]:
        """Metrics reduced over the data-parallel ranks: samples, trained tokens, and the share of the step's
        positions trained exactly once (1.0: none lost, none twice)."""
        per_position = torch.zeros(batch.step_size, dtype=torch.float64)
        per_position[batch.positions] += 1
        local = torch.cat([per_position, torch.tensor([float(len(batch)), float(batch.loss_mask.sum())],
                                                      dtype=torch.float64)])
        total = self.sum_over_dp(local)
        counts = total[:-2]
        self.steps += 1
        return {"loss": 0.0, "samples": float(total[-2]), "tokens": float(total[-1]),
                "optimizer_steps": float(len(list(batch.optimizer_steps()))),
                "positions_trained_once": float((counts == 1).double().mean())}

    def named_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Rank 0: the model folder's tensors + ``steps`` (the weights the engines serve, changed by every
        step); the other ranks take part in the gather and hold nothing."""
        if self.rank != 0:
            return
        from safetensors.torch import load_file

        bucket: NamedTensors = []
        size = 0
        for file in sorted(Path(self.cfg.model.path).glob("*.safetensors")):
            for name, tensor in load_file(str(file)).items():
                bucket.append((name, tensor + self.steps if tensor.is_floating_point() else tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
        if bucket:
            yield bucket

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def load(self, path: str) -> None:
        return None


class RankHost:
    """A Ray actor holding the real `TrainerWorker` of each of ``ranks``; every method is one collective call
    of the loop on all of them at once."""

    def __init__(self, cfg_dict: dict[str, Any], ranks: list[int], reducer: Any):
        global _BUILDING
        from slime_rl.core.config import Config
        from slime_rl.core.infra.net import LOOPBACK
        from slime_rl.core.run.actors import TrainerWorker

        cfg = Config.model_validate(cfg_dict)
        p = cfg.parallel
        world = cfg.actor_num_gpus
        groups = {}
        for rank in ranks:
            tp_rank, _, pp_rank = rank_coords(rank, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                              world)
            groups[rank] = (tp_rank, pp_rank)
        self.collective = HostCollective(groups, reducer)
        self.ranks = ranks
        started = time.process_time()
        _BUILDING = self.collective
        try:  # each rank's worker as the loop builds it: config, algorithm check, the trainer plugin
            self.workers = [TrainerWorker(cfg_dict, rank=rank, world_size=world, master_addr=LOOPBACK,
                                          master_port=0) for rank in ranks]
        finally:
            _BUILDING = None
        self.build_cpu_s = time.process_time() - started
        self.pool = ThreadPoolExecutor(len(ranks), thread_name_prefix="rank")

    def _each(self, fn, *per_rank: list[Any]) -> list[Any]:
        """``fn(worker, *args)`` for every hosted rank at once (collectives need them all in flight)."""
        return list(self.pool.map(fn, self.workers, *per_rank)) if per_rank else list(self.pool.map(fn, self.workers))

    def noop(self, arg: Any = None) -> None:
        """Nothing: what one actor call costs the driver (`HostedTrainerGroup.call_cost`)."""

    def ready(self) -> bool:
        for worker in self.workers:
            worker.ready()
        return True

    def process(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def node_ids(self) -> list[str]:
        return [w.node_id() for w in self.workers]

    def prepare(self, shards: list[Any], values: list[Any]) -> tuple[dict[str, float] | None, list[Any]]:
        """Each rank fetches its own shard (one object-store read a rank, as each rank's process does)."""
        import ray

        fetched = self._each(lambda w, ref: ray.get(ref), shards)
        answers = self._each(lambda w, shard, value: w.prepare(shard, value), fetched, values)
        return next((t for t, _ in answers if t is not None), None), [r for _, r in answers]

    def train(self) -> dict[str, float] | None:
        return next((m for m in self._each(lambda w: w.train()) if m is not None), None)

    def weight_buckets(self, bucket_bytes: int, folder: str | None, version: int = 0,
                       engines_hold: int | None = None) -> Any:
        answers = self._each(lambda w: w.weight_buckets(bucket_bytes, folder, version, engines_hold))
        return next((b for b in answers if b is not None), None)

    def weight_sync_metrics(self) -> dict[str, float]:
        return self.workers[0].weight_sync_metrics()  # host 0's first rank is rank 0

    def weight_digest(self) -> Any:
        return self.workers[0].weight_digest()

    def push_weights(self, sender_spec: str, handle: Any, bucket_bytes: int, version: int, transport: str) -> None:
        self._each(lambda w: w.push_weights(sender_spec, handle, bucket_bytes, version, transport))

    def save(self, path: str) -> None:
        self._each(lambda w: w.save(path))

    def load(self, path: str) -> None:
        self._each(lambda w: w.load(path))

    def usage(self) -> dict[str, float]:
        """This process's CPU seconds, peak RSS (MiB), ranks, the CPU its ranks' construction took, and the
        cross-host reductions made."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mb": ru.ru_maxrss / 1024, "ranks": len(self.ranks),
                "build_cpu_s": self.build_cpu_s, "reductions": self.collective.rounds}


class HostedTrainerGroup:
    """`run.loop.TrainerGroup`'s methods over `RankHost` actors (``hosts`` of them, ranks dealt out in
    contiguous blocks, each host in the placement group's bundle of its first rank). ``rank_calls`` counts
    the actor calls the real group would make (one per rank per call), ``host_calls`` those made here."""

    def __init__(self, cfg, reservation, watch: StallWatch, hosts: int):
        import ray

        world = cfg.actor_num_gpus
        self.watch, self.world = watch, world
        self.role = "actor"
        self.reducer = ray.remote(num_cpus=0)(Reducer).remote(hosts)
        per_host = -(-world // hosts)
        self.blocks = [list(range(start, min(start + per_host, world))) for start in range(0, world, per_host)]
        cfg_dict = cfg.to_dict(reveal_secrets=True)
        self.workers = []
        for block in self.blocks:
            options = reservation.trainer_options(block[0])
            options.pop("num_gpus", None)  # a host stands for many GPUs: it holds its first rank's bundle only
            self.workers.append(ray.remote(**options)(RankHost).remote(cfg_dict, block, self.reducer))
        for i, worker in enumerate(self.workers):
            watch.register(worker, Party(f"rank host {i} (ranks {self.blocks[i][0]}-{self.blocks[i][-1]})"))
        self.rank_calls: Counter = Counter()
        self.host_calls: Counter = Counter()

    def _all(self, call: str, refs: list[Any]) -> list[Any]:
        self.rank_calls[call] += self.world
        self.host_calls[call] += len(refs)
        return self.watch.get(f"actor {call}", refs, self.workers)

    def _first(self, call: str, refs: list[Any]) -> Any:
        return next((r for r in self._all(call, refs) if r is not None), None)

    def _split(self, per_rank: list[Any]) -> list[list[Any]]:
        return [per_rank[block[0]:block[-1] + 1] for block in self.blocks]

    def wait_ready(self) -> None:
        self._all("start", [w.ready.remote() for w in self.workers])

    def node_ids(self) -> list[str]:
        return [n for ids in self._all("start", [w.node_ids.remote() for w in self.workers]) for n in ids]

    def prepare(self, shards: list[Any], values: list[Any]) -> tuple[dict[str, float], list[Any]]:
        refs = [w.prepare.remote(s, v) for w, s, v in zip(self.workers, self._split(shards), self._split(values),
                                                           strict=True)]
        answers = self._all("prepare", refs)
        return next(t for t, _ in answers if t is not None), [r for _, returns in answers for r in returns]

    def train(self, returns: list[Any] | None = None) -> dict[str, float]:
        return self._first("train", [w.train.remote() for w in self.workers])

    def weight_buckets(self, bucket_bytes: int, folder: str | None, version: int = 0,
                       engines_hold: int | None = None) -> list[Any]:
        self.rank_calls["weight_buckets"] += self.world
        self.host_calls["weight_buckets"] += len(self.workers)
        return [w.weight_buckets.remote(bucket_bytes, folder, version, engines_hold) for w in self.workers]

    def weight_sync_metrics(self) -> dict[str, float]:
        """Rank 0's ``weights/*`` metrics of the last sync (one call, as the real group makes)."""
        self.rank_calls["weight_sync_metrics"] += 1
        self.host_calls["weight_sync_metrics"] += 1
        return self.watch.get("actor weight_sync", [self.workers[0].weight_sync_metrics.remote()], self.workers[:1])[0]

    def weight_digest(self) -> Any:
        self.rank_calls["weight_digest"] += 1
        self.host_calls["weight_digest"] += 1
        return self.watch.get("actor weight_sync", [self.workers[0].weight_digest.remote()], self.workers[:1])[0]

    def push_weights(self, sender_spec: str, handle: Any, bucket_bytes: int, version: int, transport: str) -> None:
        self._all("weight_sync", [w.push_weights.remote(sender_spec, handle, bucket_bytes, version, transport)
                                  for w in self.workers])

    def save(self, path: str) -> None:
        self._all("save", [w.save.remote(path) for w in self.workers])

    def load(self, path: str) -> None:
        self._all("load", [w.load.remote(path) for w in self.workers])

    def offload(self) -> None:
        return None

    def onload(self) -> None:
        return None

    def usage(self) -> list[dict[str, float]]:
        import ray

        return ray.get([w.usage.remote() for w in self.workers])

    def call_cost(self, calls: int) -> float:
        """The driver's CPU seconds per actor call with an object reference, over ``calls`` calls spread over
        the hosts: what each of the real loop's one-call-per-rank calls costs the driver."""
        import ray

        ref = ray.put(0)
        started = time.process_time()
        ray.get([self.workers[i % len(self.workers)].noop.remote(ref) for i in range(calls)])
        return (time.process_time() - started) / calls
