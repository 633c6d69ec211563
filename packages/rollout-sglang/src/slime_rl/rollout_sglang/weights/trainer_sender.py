"""The trainer side of a sync to SGLang servers: trainer rank 0 pushes the buckets itself.

The loop holds generation through the engine (`SGLangEngine.begin_weight_sync`, which
returns the servers as targets), every trainer rank runs `SGLangWeightSender.send` over its
`named_weights` (a collective), and the engine lets generation continue on the new version
(`end_weight_sync`). Tensors never pass through the rollout process or Ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from slime_rl.core.algorithms.lora import lora_spec, syncs_adapters
from slime_rl.core.config import Config
from slime_rl.core.contracts import NamedTensors, WeightSender
from slime_rl.core.weights.fp8 import quantize_buckets
from slime_rl.rollout_sglang.fp8 import fp8_format, served_folder
from slime_rl.rollout_sglang.launch import work_dir
from slime_rl.rollout_sglang.settings import sglang_settings
from slime_rl.rollout_sglang.weights import adapters, verify
from slime_rl.rollout_sglang.weights.delta_push import DeltaPusher
from slime_rl.rollout_sglang.weights.pusher import BucketPusher
from slime_rl.rollout_sglang.weights.restore_copy import RestoreCopy
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError, reachable

logger = logging.getLogger(__name__)


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
    """Rank 0 pushes each bucket by the sync's transport (`pusher.BucketPusher`, as the engine does
    with buckets in its own process); the other ranks take part in the gather. With LoRA adapters
    (`slime_rl.core.algorithms.lora.syncs_adapters`) rank 0 gathers the adapter tensors and loads them into every
    server as version ``version``'s adapter (`adapters.push_adapter`); the engine switches to it at
    `SGLangEngine.end_weight_sync`."""

    def __init__(self, cfg: Config, *, rank: int):
        super().__init__(cfg, rank=rank)
        # rollout.precision=fp8: the buckets go as (weight, scale) pairs, quantised here on the trainer's device;
        # disk folders and the restore copy take their config (its quantization_config) from the servers' FP8 copy
        self.fp8 = fp8_format(cfg.model.path, cfg.cluster.rollout_num_gpus_per_engine) \
            if cfg.rollout.precision == "fp8" else None
        served = served_folder(cfg) if self.fp8 is not None else None
        served = str(served) if served is not None and served.is_dir() else cfg.model.path  # attached: their own copy
        self.pusher = BucketPusher(weights_dir=work_dir(cfg) / "weights", model_path=served,
                                   timeout=sglang_settings(cfg).weight_sync_timeout)
        # What a restarted server is restored from (restore_copy.py); a disk sync leaves its own folder.
        self.restore = (RestoreCopy(self.pusher.weights_dir, served)
                        if rank == 0 and sglang_settings(cfg).max_engine_restarts > 0 else None)
        self.adapter_folders = adapters.FolderWriter()
        # rollout.update_weight_mode=delta: rank 0's last sent version on the host, deltas through the loader
        self.delta = (DeltaPusher(weights_dir=self.pusher.weights_dir, timeout=self.pusher.timeout,
                                  bucket_bytes=cfg.rollout.update_weight_buffer_mb * 1024**2)
                      if rank == 0 and cfg.rollout.update_weight_mode == "delta" and not syncs_adapters(cfg) else None)

    def send(self, buckets: Iterator[NamedTensors], handle: list[Target], *, version: int,
             transport: str) -> None:
        if self.rank != 0:
            for _ in buckets:  # the gather across TP/PP needs every rank
                pass
            return
        targets = list(handle)
        spec = lora_spec(self.cfg) if syncs_adapters(self.cfg) else None
        if spec is not None:  # the adapters only, loaded as one adapter per version (adapters.py)
            tensors = [item for bucket in buckets for item in bucket]
            adapters.push_adapter(transport, targets, tensors, spec, version=version, base_model=self.cfg.model.path,
                                  folder=adapters.adapter_folder(work_dir(self.cfg), version),
                                  timeout=self.pusher.timeout, writer=self.adapter_folders)
            return
        if self.delta is not None:
            return self._send_delta(targets, buckets, version=version, transport=transport)
        if self.fp8 is not None:  # the restore copy and the checksums below see the FP8 pairs too
            buckets = quantize_buckets(buckets, self.fp8)
        expected: dict[str, str] = {}  # checksums of each bucket's first and last tensor, for check_weight_update
        for index, bucket, last in _with_last(buckets):
            if sglang_settings(self.cfg).check_weight_update:
                expected.update(verify.check_sample(bucket, tp_size=verify.widest_tp(targets)))
            targets = self._push(transport, targets, bucket, version=version, index=index, last=last)
            if self.restore is not None and transport != "disk":
                self.restore.add(bucket, first=index == 0)
                if last:
                    self.restore.finish(version)
        for target in targets if expected else []:
            verify.check_weights(target, expected, timeout=self.pusher.timeout,
                             step=f"weight sync v{version} ({transport})")

    def _send_delta(self, targets: list[Target], buckets: Iterator[NamedTensors], *, version: int,
                    transport: str) -> None:
        """Deltas (delta_push.py); SGLang's /weights_checker then compares every server with the full tensors
        kept (check_weight_update: all of them, so one wrong element anywhere fails the sync)."""
        self.delta.send(targets, buckets, version=version, transport=transport)
        if self.restore is not None:
            self.restore.add(list(self.delta.encoder.kept.items()), first=True)
            self.restore.finish(version)
        if sglang_settings(self.cfg).check_weight_update:
            kept = list(self.delta.encoder.kept.items())
            expected = verify.check_sample(kept, tp_size=verify.widest_tp(targets), every=True)
            for target in targets:
                verify.check_weights(target, expected, timeout=self.pusher.timeout,
                                     step=f"weight sync v{version} (delta, {transport})")

    def _push(self, transport: str, targets: list[Target], bucket: NamedTensors, *, version: int, index: int,
              last: bool) -> list[Target]:
        """The bucket into every target. A server that died meanwhile (it takes no connections) is left out
        and the others get the bucket again: the engine's recovery restarts it and restores this version
        (restore_copy.py). An NCCL group with a dead member cannot go on: that error is raised."""
        step = f"weight sync v{version} bucket {index} ({transport})"
        while True:
            try:
                self.pusher.push(transport, targets, bucket, version=version, index=index, last=last, step=step)
                return targets
            except WeightSyncError as err:
                if transport == "nccl":
                    raise
                alive = [t for t in targets if reachable(t)]
                for _ in range(20):  # a killed server resets its connections a moment before it stops listening
                    if len(alive) < len(targets):
                        break
                    time.sleep(0.1)
                    alive = [t for t in targets if reachable(t)]
                else:
                    raise
                logger.warning("%s: %s no longer take connections (%s); going on without them", step,
                               ", ".join(t.name for t in targets if t not in alive), err)
                targets = alive
