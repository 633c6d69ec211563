"""The trainer side of a sync to SGLang servers: trainer rank 0 pushes the buckets itself.

The loop holds generation through the engine (`SGLangEngine.begin_weight_sync`, which
returns the servers as targets), every trainer rank runs `SGLangWeightSender.send` over its
`named_weights` (a collective), and the engine lets generation continue on the new version
(`end_weight_sync`). Tensors never pass through the rollout process or Ray.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slime_rl.core.config import Config
from slime_rl.core.contracts import NamedTensors, WeightSender
from slime_rl.rollout_sglang import weight_sync as ws


def _with_last(buckets: Iterator[NamedTensors]) -> Iterator[tuple[int, NamedTensors, bool]]:
    """(index, bucket, is_last): the version travels with the last bucket only."""
    previous, index = None, 0
    for bucket in buckets:
        if previous is not None:
            yield index, previous, False
            index += 1
        previous = bucket
    if previous is not None:
        yield index, previous, True


class SGLangWeightSender(WeightSender):
    """CUDA IPC tensors when colocated (``tensor``), an NCCL broadcast when not (``nccl``), or an
    HF folder the servers load (``disk``). Only rank 0 sends; the others take part in the gather."""

    def __init__(self, cfg: Config, *, rank: int):
        super().__init__(cfg, rank=rank)
        self.group: Any = None
        self.group_targets: list[ws.Target] | None = None

    def send(self, buckets: Iterator[NamedTensors], handle: list[ws.Target], *, version: int,
             transport: str) -> None:
        if self.rank != 0:
            for _ in buckets:  # the gather across TP/PP needs every rank
                pass
            return
        targets = list(handle)
        timeout = self.cfg.rollout.weight_sync_timeout  # one step of a transfer: one bucket into every engine
        if transport == "nccl" and self.group_targets != targets:
            if self.group is not None:  # an engine was restarted: its side of the group is gone
                ws.destroy_nccl_group(self.group, self.group_targets or [], timeout=timeout)
            self.group = ws.init_nccl_group(targets, timeout=timeout)
            self.group_targets = targets
        folder = Path(self.cfg.logging.dir) / "weights" / f"v{version}"
        expected = {}  # first rows of each bucket's first and last tensor, for check_weight_update
        for index, bucket, last in _with_last(buckets):
            if self.cfg.rollout.check_weight_update:
                for name, tensor in (bucket[0], bucket[-1]):
                    expected[name] = tensor.detach()[:100].to("cpu", copy=True)
            step = f"weight sync v{version} bucket {index} ({transport})"
            tag = version if last else None
            if transport == "tensor":
                ws.push_tensor_bucket(targets, bucket, version=tag, timeout=timeout, step=step)
            elif transport == "nccl":
                ws.broadcast_bucket(self.group, targets, bucket, version=tag, timeout=timeout, step=step)
            elif transport == "disk":
                ws.write_shard(folder, index, bucket)
            else:
                raise ValueError(f"rollout.update_weight_transport: unknown transport {transport!r}")
        if transport == "disk":
            ws.finish_hf_folder(folder, self.cfg.model.path)
            for target in targets:
                ws.update_from_disk(target, folder, version=version, timeout=timeout,
                                    step=f"weight sync v{version} (disk)")
        for target in targets if expected else []:
            ws.check_weights(target, expected, timeout=timeout, step=f"weight sync v{version} ({transport})")
