"""WeightSync decides the path and the transport once per run and asks the actors nothing more at each
step. The actors are fakes that count their calls (fake_actors.py); `ray.get` unwraps their answers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from fake_actors import FakeActor, fake_get, fake_watch

from slime_rl.core.config import load_config
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.run.loop import TrainerGroup
from slime_rl.core.weights.sync import WeightSync, resolve_transport


def fake_trainer(calls: Counter, log: list, node: str, ranks: int = 2) -> TrainerGroup:
    """The trainer's ranks: a real `TrainerGroup` over fake ranks (logged as ``rank<r>.<method>``);
    rank 0 answers ``weight_buckets`` with the buckets, the other ranks with None."""

    def buckets(bucket_bytes: int, folder: str | None, version: int = 0, engines_hold: int | None = None
                ) -> list[str]:
        if folder is None:
            return ["host arrays"]
        (Path(folder) / "bucket-0").write_text("weights")
        return [str(Path(folder) / "bucket-0")]

    group = TrainerGroup.__new__(TrainerGroup)
    group.role, group.watch = "actor", fake_watch()
    group.workers = [FakeActor(calls, log, f"rank{r}.", node_id=node, push_weights=None,
                               weight_buckets=buckets if r == 0 else None,
                               weight_sync_metrics={"weights/bytes_moved": 7.0} if r == 0 else None)
                       for r in range(ranks)]
    return group


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
            # (the folder's .owner.json is its owner record, infra/leftovers.py)
            seen_folders.append(sorted(p.name for p in Path(buckets[0]).parent.iterdir() if p.name != ".owner.json"))

    rollout = FakeActor(calls, log, weight_sender=sender, node_id="rollout-node", begin_weight_sync=["target"],
                        end_weight_sync=None, update_weights=update_weights)
    trainer = fake_trainer(calls, log, "rollout-node" if same_node else "trainer-node")
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
    sync = WeightSync(cfg, plan, trainer, rollout, trainer.watch)
    assert (sync.path, sync.transport, sync.sender) == ("engine", transport, "pkg.mod:Sender")
    for version in (1, 2, 3):
        assert sync.sync(version=version) == "engine"
    assert calls["weight_sender"] == 1 and calls["node_id"] == 0  # at setup, not per step
    assert calls["begin_weight_sync"] == calls["end_weight_sync"] == 3
    assert calls["rank0.push_weights"] == calls["rank1.push_weights"] == 3  # every rank takes part
    pushes = [args for method, args in log if method == "rank0.push_weights"]
    assert pushes[-1] == ("pkg.mod:Sender", ["target"], 3 * 1024**2, 3, transport)
    begins = [args for method, args in log if method == "begin_weight_sync"]
    assert begins == [(1, transport), (2, transport), (3, transport)]
    # each version: generation held, the trainer pushes, generation let go, in that order
    order = [m for m, _ in log if m in ("begin_weight_sync", "rank0.push_weights", "end_weight_sync")]
    assert order == ["begin_weight_sync", "rank0.push_weights", "end_weight_sync"] * 3


def test_without_a_sender_on_one_node_buckets_go_as_files_removed_after_each_sync(fake_ray):
    seen: list = []
    cfg, plan, trainer, rollout, calls, log = make(sender=None, same_node=True, seen_folders=seen)
    sync = WeightSync(cfg, plan, trainer, rollout, trainer.watch)
    assert sync.path == "files" and sync.transport is None
    assert [sync.sync(version=v) for v in (1, 2)] == ["files", "files"]
    assert calls["weight_sender"] == calls["node_id"] == calls["rank0.node_id"] == 1  # once, at setup
    folders = [args[1] for method, args in log if method == "rank0.weight_buckets"]
    assert all(folder is not None for folder in folders) and folders[0] != folders[1]
    assert seen == [["bucket-0"], ["bucket-0"]]  # the rollout side got the bucket while the folder was there
    assert not any(Path(folder).exists() for folder in folders)  # and the folder is gone after the sync
    updates = [args for method, args in log if method == "update_weights"]
    assert [version for _, version in updates] == [1, 2]


def test_without_a_sender_across_nodes_buckets_go_through_the_object_store(fake_ray):
    cfg, plan, trainer, rollout, calls, log = make(sender=None, same_node=False)
    sync = WeightSync(cfg, plan, trainer, rollout, trainer.watch)
    assert sync.path == "object_store"
    assert [sync.sync(version=v) for v in (1, 2, 3)] == ["object_store"] * 3
    assert calls["weight_sender"] == calls["node_id"] == calls["rank0.node_id"] == 1
    assert [args for method, args in log if method == "rank1.weight_buckets"] == [
        (3 * 1024**2, None, v, None) for v in (1, 2, 3)]  # full mode: never a delta
    assert sync.metrics == {"weights/bytes_moved": 7.0}  # rank 0's, every sync


def test_delta_mode_builds_on_the_engines_version_and_redoes_a_broken_chain_in_full(fake_ray):
    from slime_rl.core.weights.delta import DeltaChainBroken

    cfg, plan, trainer, rollout, calls, log = make(sender=None, same_node=False)
    cfg.rollout.update_weight_mode = "delta"
    broken = iter([True, False, False])

    def update_weights(buckets, version):
        if version == 2 and next(broken):
            raise DeltaChainBroken("engine-1 restarted")

    rollout.answers.update(delta_base=1, update_weights=update_weights)
    sync = WeightSync(cfg, plan, trainer, rollout, trainer.watch)
    sync.sync(version=2)
    asked = [args[2:] for method, args in log if method == "rank0.weight_buckets"]
    assert asked == [(2, 1), (2, None)]  # a delta onto version 1, then the same version in full
