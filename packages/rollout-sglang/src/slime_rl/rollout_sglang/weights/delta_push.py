"""The trainer side of a delta sync into SGLang servers (rollout.update_weight_mode=delta; delta_loader.py is
the server side). Every bucket goes through the custom loader with a ``#delta`` header: full tensors (base -1)
while nothing is kept, deltas onto the version this sender sent last afterwards. Before a delta, each server's
weight version (``/model_info``) says whether it holds that base: one that does not (restarted, joined late,
missed a sync) gets the whole new version from the host copy the encoder keeps, so no other rank is asked to
gather again, and never a delta, which SGLang's scheduler would die on (delta_loader.py).

Transports: ``tensor`` (the bucket by value in the request; CPU tensors) and ``disk`` (a safetensors file per
bucket under ``weights_dir/delta``, its path in the request). NCCL's receive path in SGLang 0.5.17 calls the
model's own loader, never a custom one, so an NCCL sync stays full (docs/elastic.md).

Every call goes to all servers at once (`server_api.post_all` / `get_all` on the control thread), each bucket
serialised once: a sync's control time stays flat as engines join (docs/scale.md).
"""

from __future__ import annotations

import base64
import logging
import pickle
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.weights.delta import DeltaEncoder, SyncStats, header, is_delta_bucket
from slime_rl.rollout_sglang.weights.delta_loader import FULL, LOADER, file_pointer, write_delta_file
from slime_rl.rollout_sglang.weights.server_api import Target, get_all, post_all

logger = logging.getLogger(__name__)
DELTA_TRANSPORTS = ("tensor", "disk")
MLA_FUSED_FIRST_HALF = ".self_attn.q_a_proj.weight"  # SGLang fuses it with the kv_a_proj_with_mqa after it


class DeltaPusher:
    """Delta syncs to SGLang servers started with ``--custom-weight-loader`` `LOADER` (launch.py adds it)."""

    def __init__(self, *, weights_dir: str | Path, timeout: float, bucket_bytes: int = 2**30):
        self.folder = Path(weights_dir) / "delta"
        self.timeout, self.bucket_bytes = timeout, bucket_bytes
        self.encoder = DeltaEncoder()
        self.full_pushes = 0  # servers behind the delta's base that got the whole version

    @property
    def last(self) -> SyncStats:
        return self.encoder.last

    def send(self, targets: list[Target], buckets: Iterator[NamedTensors], *, version: int, transport: str) -> None:
        if transport not in DELTA_TRANSPORTS:
            raise ValueError(f"rollout.update_weight_mode=delta: transport {transport!r} cannot carry a delta into "
                             f"SGLang; use rollout.update_weight_transport={' or '.join(DELTA_TRANSPORTS)}")
        shutil.rmtree(self.folder, ignore_errors=True)
        base = self.encoder.kept_version
        held = held_versions(targets, timeout=self.timeout, version=version) if base is not None else []
        at_base = [t for t, v in zip(targets, held, strict=False) if v == base]  # held is [] without a base
        behind = [t for t in targets if t not in at_base] if at_base else []
        receivers = at_base or targets  # nobody at the base: the stream is full tensors, for everyone
        encoded = self.encoder.encode(buckets, version=version, engines_hold=base if at_base else None)
        previous: NamedTensors | None = None
        index = 0
        for bucket in encoded:  # one behind: the version goes with the last bucket
            if previous is not None:
                self._push_all(receivers, previous, version=version, index=index, last=False, transport=transport)
                index += 1
            previous = bucket if is_delta_bucket(bucket) else [header(FULL, version), *bucket]
        if previous is not None:
            self._push_all(receivers, previous, version=version, index=index, last=True, transport=transport)
        for target in behind:
            logger.warning("weight sync v%d: %s does not hold version %s, which the delta builds on; sending it"
                           " in full", version, target.name, base)
        if behind:
            self._push_full(behind, version=version, transport=transport)
            self.full_pushes += len(behind)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _push_full(self, targets: list[Target], *, version: int, transport: str) -> None:
        """The kept version (this sync's full tensors) into ``targets``, in buckets, through the loader."""
        chunks = full_chunks(self.encoder.kept.items(), self.bucket_bytes)
        for i, part in enumerate(chunks):
            self._push_all(targets, [header(FULL, version), *part], version=version, index=i,
                           last=i == len(chunks) - 1, transport=transport)

    def _push_all(self, targets: list[Target], bucket: NamedTensors, *, version: int, index: int, last: bool,
                  transport: str) -> None:
        """One bucket into every target at once, serialised once."""
        step = f"weight sync v{version} bucket {index} (delta, {transport})"
        if transport == "disk":  # one file a bucket, read by every server (a full one has base -1)
            path = self.folder / f"v{version}-base{int(bucket[0][1][0])}-{index:05d}.safetensors"
            if not path.exists():
                write_delta_file(bucket, path)
            bucket = file_pointer(path)
        payload = base64.b64encode(pickle.dumps([(n, t.detach().cpu()) for n, t in bucket])).decode("ascii")

        def body(_: int, target: Target) -> dict:
            out = {"serialized_named_tensors": [payload] * target.tp_size, "load_format": LOADER,
                   "flush_cache": False}
            return {**out, "weight_version": str(version)} if last else out

        post_all(targets, "/update_weights_from_tensor", body, timeout=self.timeout, step=step)


def full_chunks(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[NamedTensors]:
    """``tensors`` (in the trainer's order) cut into buckets of at least ``bucket_bytes``, the last one smaller. A
    bucket never ends on an MLA layer's ``q_a_proj``: SGLang 0.5.17 loads it fused with the ``kv_a_proj_with_mqa``
    that follows it only when both come in one load call and silently drops a half that comes alone (its
    deepseek_weight_loader.py caches the halves for one call). The trainer's own buckets keep the same rule
    (trainer_megatron.convert.bucketed); these are the kept copy re-cut for a server behind the delta's base."""
    chunks: list[NamedTensors] = []
    chunk: NamedTensors = []
    size = 0
    for name, tensor in tensors:
        chunk.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes and not name.endswith(MLA_FUSED_FIRST_HALF):
            chunks.append(chunk)
            chunk, size = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def held_versions(targets: list[Target], *, timeout: float, version: int) -> list[int | None]:
    """The weight version each target reports (``/model_info``), None where it is not one of ours (``default``:
    a server that has loaded nothing since it started)."""
    versions: list[int | None] = []
    for info in get_all(targets, "/model_info", timeout=timeout, step=f"weight sync v{version}: its weight version"):
        held = info.get("weight_version") if isinstance(info, dict) else None
        try:
            versions.append(int(held))
        except (TypeError, ValueError):
            versions.append(None)
    return versions
