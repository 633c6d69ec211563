"""WeightSync decides the path and the transport once per run and asks the actors nothing more at each
step. The actors are fakes that count their calls; `ray.get` unwraps their answers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.weights.sync import WeightSync, resolve_transport


class Answer:
    """What a fake actor's ``.remote()`` returns: a value `ray.get` gives back."""

    def __init__(self, value: Any):
        self.value = value


class FakeActor:
    """``actor.method.remote(*args)`` records the call and answers with ``answers[method](*args)``."""

    def __init__(self, calls: Counter, log: list, **answers: Any):
        self.calls, self.log, self.answers = calls, log, answers

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Answer:
                args = tuple(a.value if isinstance(a, Answer) else a for a in args)  # Ray resolves refs in args
                actor.calls[method] += 1
                actor.log.append((method, args))
                answer = actor.answers[method]
                return Answer(answer(*args) if callable(answer) else answer)

        return Method


class FakeTrainer:
    """The trainer ranks as WeightSync sees them: ``workers`` and ``start`` (one answer per rank)."""

    def __init__(self, calls: Counter, log: list, node: str, ranks: int = 2):
        self.workers = [FakeActor(calls, log, node_id=node) for _ in range(ranks)]
        self.calls, self.log = calls, log

    def start(self, method: str, *args: Any) -> list[Answer]:
        self.calls[f"trainer.{method}"] += 1
        self.log.append((f"trainer.{method}", args))
        if method == "weight_buckets":  # rank 0's buckets; the other ranks answer None
            folder = args[1]
            if folder is None:
                buckets = ["host arrays"]
            else:
                (Path(folder) / "bucket-0").write_text("weights")
                buckets = [str(Path(folder) / "bucket-0")]
            return [Answer(buckets), *[Answer(None) for _ in self.workers[1:]]]
        return [Answer(None) for _ in self.workers]


def fake_get(refs: Any) -> Any:
    return [r.value for r in refs] if isinstance(refs, list) else refs.value


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", fake_get)


def make(transport: str = "auto", *, sender: str | None, same_node: bool = True, colocate: bool = True,
         device: str = "cuda", seen_folders: list | None = None):
    overrides = [f"rollout.update_weight_transport={transport}", f"cluster.colocate={str(colocate).lower()}",
                 "rollout.update_weight_buffer_mb=3"]
    if not colocate:
        overrides.append("cluster.rollout_num_gpus=1")
    cfg = load_config(None, overrides, check=False)
    plan = plan_placement(cfg, device=device)
    calls, log = Counter(), []

    def update_weights(buckets, version):
        if seen_folders is not None:
            seen_folders.append(sorted(p.name for p in Path(buckets[0]).parent.iterdir()))

    rollout = FakeActor(calls, log, weight_sender=sender, node_id="rollout-node", begin_weight_sync=["target"],
                        end_weight_sync=None, update_weights=update_weights)
    trainer = FakeTrainer(calls, log, "rollout-node" if same_node else "trainer-node")
    return cfg, plan, trainer, rollout, calls, log


@pytest.mark.parametrize(("setting", "colocated", "on_cuda", "chosen"), [
    ("auto", True, True, "tensor"),  # CUDA IPC to engines on the trainer's GPUs
    ("auto", False, True, "nccl"),  # a broadcast to engines on other GPUs
    ("auto", False, False, "tensor"),  # CPU tensors by value: no NCCL on the CPU
    ("disk", False, True, "disk"),
    ("nccl", True, True, "nccl"),  # an explicit choice stands
])
def test_resolve_transport(setting, colocated, on_cuda, chosen):
    assert resolve_transport(setting, colocated=colocated, on_cuda=on_cuda) == chosen


@pytest.mark.parametrize(("colocate", "device", "transport"), [(True, "cuda", "tensor"), (False, "cuda", "nccl"),
                                                               (False, "cpu", "tensor")])
def test_engine_path_resolves_auto_and_looks_up_the_sender_once(fake_ray, colocate, device, transport):
    cfg, plan, trainer, rollout, calls, log = make(sender="pkg.mod:Sender", colocate=colocate, device=device)
    sync = WeightSync(cfg, plan, trainer, rollout)
    assert (sync.path, sync.transport, sync.sender) == ("engine", transport, "pkg.mod:Sender")
    for version in (1, 2, 3):
        assert sync.sync(version=version) == "engine"
    assert calls["weight_sender"] == 1 and calls["node_id"] == 0  # at setup, not per step
    assert calls["begin_weight_sync"] == calls["end_weight_sync"] == calls["trainer.push_weights"] == 3
    pushes = [args for method, args in log if method == "trainer.push_weights"]
    assert pushes[-1] == ("pkg.mod:Sender", ["target"], 3 * 1024**2, 3, transport)
    begins = [args for method, args in log if method == "begin_weight_sync"]
    assert begins == [(1, transport), (2, transport), (3, transport)]
    # each version: generation held, the trainer pushes, generation let go, in that order
    order = [m for m, _ in log if m in ("begin_weight_sync", "trainer.push_weights", "end_weight_sync")]
    assert order == ["begin_weight_sync", "trainer.push_weights", "end_weight_sync"] * 3


def test_without_a_sender_on_one_node_buckets_go_as_files_removed_after_each_sync(fake_ray):
    seen: list = []
    cfg, plan, trainer, rollout, calls, log = make(sender=None, same_node=True, seen_folders=seen)
    sync = WeightSync(cfg, plan, trainer, rollout)
    assert sync.path == "files" and sync.transport is None
    assert [sync.sync(version=v) for v in (1, 2)] == ["files", "files"]
    assert calls["weight_sender"] == 1 and calls["node_id"] == 2  # the rollout's and rank 0's, once
    folders = [args[1] for method, args in log if method == "trainer.weight_buckets"]
    assert all(folder is not None for folder in folders) and folders[0] != folders[1]
    assert seen == [["bucket-0"], ["bucket-0"]]  # the rollout side got the bucket while the folder was there
    assert not any(Path(folder).exists() for folder in folders)  # and the folder is gone after the sync
    updates = [args for method, args in log if method == "update_weights"]
    assert [version for _, version in updates] == [1, 2]


def test_without_a_sender_across_nodes_buckets_go_through_the_object_store(fake_ray):
    cfg, plan, trainer, rollout, calls, log = make(sender=None, same_node=False)
    sync = WeightSync(cfg, plan, trainer, rollout)
    assert sync.path == "object_store"
    assert [sync.sync(version=v) for v in (1, 2, 3)] == ["object_store"] * 3
    assert calls["weight_sender"] == 1 and calls["node_id"] == 2
    assert [args for method, args in log if method == "trainer.weight_buckets"] == [(3 * 1024**2, None)] * 3
