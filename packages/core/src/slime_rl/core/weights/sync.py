"""How the trainer's weights reach the rollout engines: decided once per run, done every step.

`WeightSync` is built once the trainer ranks and the rollout worker exist. It asks the rollout
worker, once, whether its engine has a trainer-side sender, and picks one of three paths:

- ``engine``: the engine names a `WeightSender` (SGLang): every trainer rank runs it and rank 0
  pushes straight to the servers, by the run's transport (``rollout.update_weight_transport``,
  ``auto`` resolved once by `resolve_transport`); the engine holds generation around the push;
- ``files``: rank 0's buckets as shared-memory files the rollout process reads and deletes, when
  both run on one node (tensor_transport says why files are preferred);
- ``object_store``: the buckets through Ray's object store, across nodes.

The driver never holds the weights on any path.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal, Protocol

from slime_rl.core.infra.leftovers import weights_folder
from slime_rl.core.weights.delta import DeltaChainBroken

if TYPE_CHECKING:
    from ray import ObjectRef

    from slime_rl.core.config import Config
    from slime_rl.core.config.placement import Placement
    from slime_rl.core.infra.stall import StallWatch

SyncPath = Literal["engine", "files", "object_store"]


class TrainerRanks(Protocol):
    """What a sync asks of the trainer's ranks; run.loop's `TrainerGroup` has these methods. Declared
    here so the weights layer does not import the run that uses it."""

    workers: list[Any]  # each rank's actor handle: who a stalled wait names

    def node_ids(self) -> list[str]: ...

    def weight_buckets(self, bucket_bytes: int, folder: str | None, version: int = 0,
                       engines_hold: int | None = None) -> list[ObjectRef]: ...

    def weight_sync_metrics(self) -> dict[str, float]: ...

    def weight_digest(self) -> tuple[list[str], str] | None: ...

    def push_weights(self, sender_spec: str, handle: Any, bucket_bytes: int, version: int, transport: str) -> None:
        ...


def resolve_transport(setting: str, *, colocated: bool, on_cuda: bool) -> str:
    """``rollout.update_weight_transport`` as a sync uses it. ``auto``: an NCCL broadcast (``nccl``)
    from the trainer's GPU to engines on other GPUs; otherwise ``tensor`` (CUDA IPC handles to
    engines sharing the trainer's GPUs, or CPU tensors by value)."""
    if setting != "auto":
        return setting
    return "nccl" if on_cuda and not colocated else "tensor"


class WeightSync:
    """The run's weight sync: its path and transport, and the lookups they need, fixed at construction.

    ``actor`` is the trainer's ranks (`TrainerRanks`); ``rollout`` the rollout worker's
    Ray handle. Construction asks the rollout for its engine's sender and, without one, both node ids;
    `sync` asks nothing more. Every wait is ``watch``'s (infra/stall.py)."""

    def __init__(self, cfg: Config, plan: Placement, actor: TrainerRanks, rollout: Any, watch: StallWatch):
        self.actor, self.rollout, self.watch = actor, rollout, watch
        self.bucket_bytes = cfg.rollout.update_weight_buffer_mb * 1024**2
        self.delta = cfg.rollout.update_weight_mode == "delta"
        self.verify = self.delta and cfg.rollout.elastic.verify_weights
        self.metrics: dict[str, float] = {}  # the last sync's weights/* (change fraction, bytes moved)
        self.sender: str | None = self._ask("start", rollout.weight_sender.remote())  # module:attr of a WeightSender
        self.transport: str | None = None  # the engine path's transport
        self.path: SyncPath
        if self.sender is not None:
            self.path = "engine"
            self.transport = resolve_transport(cfg.rollout.update_weight_transport, colocated=plan.colocate,
                                               on_cuda=plan.device == "cuda")
        else:
            rollout_node, rank0_node = self._ask("start", rollout.node_id.remote()), actor.node_ids()[0]
            self.path = "files" if rollout_node == rank0_node else "object_store"

    def sync(self, *, version: int) -> SyncPath:
        """Send the trainer's current weights to the engines as ``version``; returns the path taken."""
        if self.path == "engine":
            handle = self._ask("begin_weight_sync", self.rollout.begin_weight_sync.remote(version, self.transport))
            self.actor.push_weights(self.sender, handle, self.bucket_bytes, version, self.transport)
            self._ask("end_weight_sync", self.rollout.end_weight_sync.remote(version))
            self.metrics = self.actor.weight_sync_metrics()
            return self.path
        engines_hold = self._ask("weight_sync", self.rollout.delta_base.remote()) if self.delta else None
        try:
            self._send_buckets(version, engines_hold)
        except DeltaChainBroken:  # an engine moved off the version asked for meanwhile (restarted, joined)
            self._send_buckets(version, None)
        self.metrics = self.actor.weight_sync_metrics()
        if self.verify:
            self._verify(version)
        return self.path

    def _verify(self, version: int) -> None:
        """rollout.elastic.verify_weights: every serving engine's weights bit-equal to the trainer's kept copy."""
        kept = self.actor.weight_digest()
        if kept is None:
            return
        names, want = kept
        held = self._ask("weight_sync", self.rollout.weight_digests.remote(names))
        wrong = sorted(name for name, digest in held.items() if digest != want)
        if wrong:
            raise RuntimeError(f"weight sync v{version}: {', '.join(wrong)} hold weights that differ from the "
                               "trainer's (rollout.elastic.verify_weights); a full sync should have been sent")
        self.metrics["weights/engines_verified"] = float(len(held))

    def _send_buckets(self, version: int, engines_hold: int | None) -> None:
        files = weights_folder() if self.path == "files" else contextlib.nullcontext()
        with files as folder:  # None: through the object store
            refs = self.actor.weight_buckets(self.bucket_bytes, folder, version, engines_hold)
            # the rollout loads rank 0's buckets; the other ranks answer once their part of the gather is done
            self.watch.get("weight_sync", [self.rollout.update_weights.remote(refs[0], version), *refs[1:]],
                           [self.rollout, *self.actor.workers[1:]])

    def _ask(self, call: str, ref: ObjectRef) -> Any:
        return self.watch.get(call, [ref], [self.rollout])[0]
