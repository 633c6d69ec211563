"""The trainer side of a sync to SGLang servers: trainer rank 0 pushes the buckets itself.

The loop holds generation through the engine (`SGLangEngine.begin_weight_sync`, which
returns the servers as targets), every trainer rank runs `SGLangWeightSender.send` over its
`named_weights` (a collective), and the engine lets generation continue on the new version
(`end_weight_sync`). Tensors never pass through the rollout process or Ray.
"""

from __future__ import annotations

from collections.abc import Iterator

from slime_rl.core.config import Config
from slime_rl.core.contracts import NamedTensors, WeightSender
from slime_rl.core.lora import lora_spec, syncs_adapters
from slime_rl.rollout_sglang import adapters
from slime_rl.rollout_sglang import weight_sync as ws
from slime_rl.rollout_sglang.launch import work_dir
from slime_rl.rollout_sglang.transport import BucketPusher


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
    """Rank 0 pushes each bucket by the sync's transport (`transport.BucketPusher`, as the engine does
    with buckets in its own process); the other ranks take part in the gather. With LoRA adapters
    (`slime_rl.core.lora.syncs_adapters`) rank 0 gathers the adapter tensors and loads them into every
    server as version ``version``'s adapter (`adapters.push_adapter`); the engine switches to it at
    `SGLangEngine.end_weight_sync`."""

    def __init__(self, cfg: Config, *, rank: int):
        super().__init__(cfg, rank=rank)
        self.pusher = BucketPusher(weights_dir=work_dir(cfg) / "weights", model_path=cfg.model.path,
                                   timeout=cfg.rollout.weight_sync_timeout)

    def send(self, buckets: Iterator[NamedTensors], handle: list[ws.Target], *, version: int,
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
                                  timeout=self.pusher.timeout)
            return
        expected: dict[str, str] = {}  # checksums of each bucket's first and last tensor, for check_weight_update
        for index, bucket, last in _with_last(buckets):
            if self.cfg.rollout.check_weight_update:
                expected.update(ws.check_sample(bucket, tp_size=ws.widest_tp(targets)))
            self.pusher.push(transport, targets, bucket, version=version, index=index, last=last,
                             step=f"weight sync v{version} bucket {index} ({transport})")
        for target in targets if expected else []:
            ws.check_weights(target, expected, timeout=self.pusher.timeout,
                             step=f"weight sync v{version} ({transport})")
