"""One bucket of a weight sync into every server, by the sync's transport: the one dispatch both
sides use, the engine (buckets in the rollout process, engine_sync.py) and the trainer's sender
(buckets in trainer rank 0, trainer_sender.py). The transports themselves are ipc.py, nccl.py and
disk.py. Which transport a run uses (``auto`` resolved) is decided once, by
`slime_rl.core.weights.sync.resolve_transport`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.weights import disk, ipc, nccl
from slime_rl.rollout_sglang.weights.server_api import Target

TRANSPORTS = ("tensor", "nccl", "disk")


class BucketPusher:
    """Pushes buckets by ``tensor`` (CUDA IPC handles, or CPU tensors by value), ``nccl`` (a broadcast
    in a weight-update group, made on first use and anew when the servers change; gloo for CPU
    tensors) or ``disk`` (an HF folder ``weights_dir/v{version}`` the servers load once the last
    bucket is written; the previous version's folder is removed then). Blocking; not thread-safe:
    one sync at a time."""

    def __init__(self, *, weights_dir: str | Path, model_path: str | Path, timeout: float):
        self.weights_dir = Path(weights_dir)
        self.model_path = model_path  # its config and tokenizer files complete a disk folder
        self.timeout = timeout  # one step of a transfer: one bucket into every engine
        self.group: Any = None
        self.group_targets: list[Target] = []
        self._disk_folder: Path | None = None  # the last folder this pusher completed

    def folder(self, version: int) -> Path:
        """Where a disk sync of ``version`` is written (by either side)."""
        return self.weights_dir / f"v{version}"

    def push(self, transport: str, targets: list[Target], bucket: NamedTensors, *, version: int,
             index: int, last: bool, step: str) -> None:
        """Bucket ``index`` of ``version`` into every target; the version is reported with the last one."""
        tag = version if last else None  # engines report the new version once they have all of it
        if transport == "tensor":
            ipc.push_tensor_bucket(targets, bucket, version=tag, timeout=self.timeout, step=step)
        elif transport == "nccl":
            self._join(targets, backend="nccl" if bucket[0][1].is_cuda else "gloo")
            nccl.broadcast_bucket(self.group, targets, bucket, version=tag, timeout=self.timeout, step=step)
        elif transport == "disk":
            folder = self.folder(version)
            if index == 0 and folder.exists():  # a failed attempt at this version left shards
                shutil.rmtree(folder)
            disk.write_shard(folder, index, bucket)
            if last:
                disk.finish_hf_folder(folder, self.model_path)
                for target in targets:
                    disk.update_from_disk(target, folder, version=version, timeout=self.timeout, step=step)
                previous, self._disk_folder = self._disk_folder, folder
                if previous is not None and previous != folder:
                    shutil.rmtree(previous, ignore_errors=True)
        else:
            raise ValueError(f"rollout.update_weight_transport: unknown transport {transport!r}; "
                             f"use one of auto, {', '.join(TRANSPORTS)}")

    def _join(self, targets: list[Target], *, backend: str) -> None:
        if self.group is not None and self.group_targets == targets:
            return
        self.drop_group(self.group_targets)  # an engine was restarted: its side of the group is gone
        self.group = nccl.init_nccl_group(targets, timeout=self.timeout, backend=backend)
        self.group_targets = list(targets)

    def drop_group(self, targets: list[Target]) -> None:
        """Leave the weight-update group, telling ``targets`` to leave it too; the next nccl push makes it anew."""
        if self.group is not None:
            group, self.group, self.group_targets = self.group, None, []
            nccl.destroy_nccl_group(group, targets, timeout=min(self.timeout, 30.0))

    def close(self) -> None:
        """This side of the group only (the servers are going away)."""
        if self.group is not None:
            group, self.group, self.group_targets = self.group, None, []
            try:
                nccl.close_group(group)
            except Exception:  # the engines are about to go anyway
                pass
