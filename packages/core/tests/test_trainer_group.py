"""`TrainerGroup` forwards each of its methods to the `TrainerWorker` method of the same name on every
rank, rank r with its own arguments, and reads rank 0's answer. The ranks are fakes (fake_actors.py)."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
from fake_actors import FakeActor, fake_get, fake_watch

from slime_rl.core.run.actors import TrainerWorker
from slime_rl.core.run.loop import TrainerGroup


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", fake_get)


def group_of(ranks: int, calls: Counter, log: list) -> TrainerGroup:
    def prepare(shard, values):  # (rank 0's timings, this shard's returns), as TrainerWorker.prepare
        return ({"log_probs": 0.5} if shard == "shard-0" else None), f"returns of {shard}"

    group = TrainerGroup.__new__(TrainerGroup)
    group.role, group.watch = "actor", fake_watch()
    group.workers = [FakeActor(calls, log, f"rank{r}.", prepare=prepare, compute_values=lambda s: f"values of {s}",
                               train=lambda returns, r=r: {"loss": 1.0} if r == 0 else None,
                               save=None, node_id=f"node-{r}")
                     for r in range(ranks)]
    return group


def test_every_method_forwards_to_the_trainer_worker_method_of_its_name():
    forwarded = {name for name, _ in inspect.getmembers(TrainerGroup, inspect.isfunction)
                 if not name.startswith("_")} - {"wait_ready", "node_ids"}
    assert forwarded and forwarded <= set(dir(TrainerWorker))
    for name in forwarded:  # the same parameters, so a call reads the same on both sides
        group_params = list(inspect.signature(getattr(TrainerGroup, name)).parameters)[1:]
        worker_params = list(inspect.signature(getattr(TrainerWorker, name)).parameters)[1:]
        per_rank = {"shards": "shard", "values": "values", "returns": "returns"}
        assert [per_rank.get(p, p) for p in group_params] == worker_params, name
    assert {"ready", "node_id"} <= set(dir(TrainerWorker))


def test_each_rank_gets_its_own_shard_and_the_driver_reads_rank_0(fake_ray):
    calls, log = Counter(), []
    group = group_of(2, calls, log)
    shards = ["shard-0", "shard-1"]
    values = group.compute_values(shards)
    timings, returns = group.prepare(shards, values)
    assert timings == {"log_probs": 0.5}
    assert [r.value for r in returns] == ["returns of shard-0", "returns of shard-1"]
    assert [args for method, args in log if method.endswith(".prepare")] == [
        ("shard-0", "values of shard-0"), ("shard-1", "values of shard-1")]
    assert group.train(returns) == {"loss": 1.0}
    assert [args for method, args in log if method.endswith(".train")] == [
        ("returns of shard-0",), ("returns of shard-1",)]
    assert group.train() == {"loss": 1.0}  # the actor: no returns, every rank called with None
    assert log[-2:] == [("rank0.train", (None,)), ("rank1.train", (None,))]
    group.save("/ckpt/actor")
    assert calls["rank0.save"] == calls["rank1.save"] == 1
    assert group.node_ids() == ["node-0", "node-1"]


def test_a_rank_count_that_differs_from_the_shards_is_refused(fake_ray):
    group = group_of(2, Counter(), [])
    with pytest.raises(ValueError):
        group.compute_values(["shard-0"])
