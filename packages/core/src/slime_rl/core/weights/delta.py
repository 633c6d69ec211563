"""Delta weight syncs: send only the elements that changed since the version the engines hold.

After one optimizer step at RL learning rates most bf16 elements of an fp32 master are bit-identical
to the last synced version (benchmarks/delta_sync.py measures how many), so a sync can carry, per
tensor, the smallest of

- ``full``: the tensor itself;
- ``sparse``: the flat indices (int32) of the changed elements and their new values;
- ``xor``: the XOR of the new and the old bit patterns, zlib-compressed (level 1): zero runs and the
  mostly-zero high bits of small changes compress well.

A delta travels as ordinary named tensors, so every transport carries it unchanged: ``name#idx`` and
``name#val``, or ``name#xor`` (uint8), and each delta bucket starts with a ``#delta`` header tensor
(int64 ``[base_version, version]``). An engine applies a delta only onto ``base_version``
(`apply_delta_bucket`); any other version raises `DeltaChainBroken` and the sync is redone in full.
The trainer side (`DeltaEncoder`) keeps the last synced version's bytes on the host and sends a
delta only when the engines report that version (`SyncStats` says what moved).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from slime_rl.core.contracts import NamedTensors, RolloutEngine

HEADER = "#delta"
MARK = "#"  # HF parameter names never hold one
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view
ENCODINGS = ("full", "sparse", "xor")


class DeltaChainBroken(RuntimeError):
    """A delta arrived for a base version the engine does not hold: it needs a full sync."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as a flat integer tensor of the same element size (a view when contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()])


def is_delta_bucket(named_tensors: NamedTensors) -> bool:
    return bool(named_tensors) and named_tensors[0][0] == HEADER


def header(base_version: int, version: int) -> tuple[str, torch.Tensor]:
    return HEADER, torch.tensor([base_version, version], dtype=torch.int64)


@dataclass
class TensorDelta:
    """One tensor of a sync as it travels: its parts (named tensors) and what they cost."""

    name: str
    encoding: str  # one of ENCODINGS
    parts: NamedTensors
    changed: int  # elements that differ from the base
    numel: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.parts)


def encode_tensor(name: str, new: torch.Tensor, old: torch.Tensor | None,
                  encodings: tuple[str, ...] = ENCODINGS) -> TensorDelta:
    """``new`` against ``old`` (the engine's copy) by the smallest of ``encodings``; ``full`` whenever no
    delta is smaller, or there is no comparable ``old``."""
    numel = new.numel()
    full = TensorDelta(name, "full", [(name, new)], numel, numel)
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return full
    new_bits, old_bits = bits(new), bits(old)
    diff = torch.bitwise_xor(new_bits, old_bits)
    changed_mask = diff != 0
    changed = int(changed_mask.sum())
    full.changed = changed
    best = full
    if "sparse" in encodings and changed * (4 + new.element_size()) < best.nbytes:
        index = changed_mask.nonzero().reshape(-1).to(torch.int32)
        best = TensorDelta(name, "sparse", [(f"{name}#idx", index), (f"{name}#val", new.reshape(-1)[index.long()])],
                           changed, numel)
    if "xor" in encodings and changed < numel:  # all changed: XOR compresses no better than the values
        packed = zlib.compress(diff.numpy().tobytes(), 1)
        if len(packed) < best.nbytes:
            best = TensorDelta(name, "xor", [(f"{name}#xor", torch.frombuffer(bytearray(packed), dtype=torch.uint8))],
                               changed, numel)
    return best


def apply_delta_bucket(named_tensors: NamedTensors, current: Callable[[str], torch.Tensor], *,
                       held_version: int) -> NamedTensors:
    """The full tensors a delta bucket stands for, built from ``current(name)`` (the engine's tensor now,
    left unchanged). Raises `DeltaChainBroken` unless the engine holds the bucket's base version."""
    (name, head), rest = named_tensors[0], named_tensors[1:]
    if name != HEADER:
        raise ValueError("apply_delta_bucket: the bucket has no #delta header; load it as full tensors")
    base_version = int(head[0])
    if base_version != held_version:
        raise DeltaChainBroken(f"a delta onto weight version {base_version} reached an engine at version "
                               f"{held_version}; it needs a full sync")
    out: NamedTensors = []
    i = 0
    while i < len(rest):
        part, tensor = rest[i]
        base, _, kind = part.partition(MARK)
        if not kind:
            out.append((part, tensor))
            i += 1
            continue
        held = current(base)
        if kind == "idx":
            values = rest[i + 1][1]
            new = held.detach().clone()
            new.reshape(-1)[tensor.long()] = values.to(held.device)
            i += 2
        elif kind == "xor":
            diff = torch.frombuffer(bytearray(zlib.decompress(tensor.numpy().tobytes())), dtype=bits(held).dtype)
            new = torch.bitwise_xor(bits(held).cpu(), diff).view(held.dtype).reshape(held.shape).to(held.device)
            i += 1
        else:
            raise ValueError(f"apply_delta_bucket: unknown part {part!r}")
        out.append((base, new))
    return out


def weights_digest(names: list[str], weight: Callable[[str], torch.Tensor]) -> str:
    """SHA-256 over the bit patterns of ``names``' tensors, in that order: equal only when every bit is."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode())
        digest.update(bits(weight(name)).cpu().numpy().tobytes())
    return digest.hexdigest()


def _members(engine: Any) -> list[Any]:
    """The engines behind ``engine``: an `EnginePool`'s serving and joining members, or itself."""
    members = getattr(engine, "members", None)
    return [m.engine for m in members.values()] if members is not None else [engine]


def _exposes_weights(engine: Any) -> bool:
    return type(engine).current_weight is not RolloutEngine.current_weight


def engine_digests(engine: Any, names: list[str]) -> dict[str, str]:
    """Each serving engine's `weights_digest` that exposes its weights (``current_weight``), by name."""
    members = getattr(engine, "members", None)
    pairs = ([(m.name, m.engine) for m in members.values() if m.state == "serving"] if members is not None
             else [("engine", engine)])
    return {name: weights_digest(names, e.current_weight) for name, e in pairs if _exposes_weights(e)}


def delta_base(engine: Any) -> int | None:
    """The version a delta sync to ``engine`` (a `RolloutEngine`, or an `EnginePool` of them) builds on: the
    version every engine behind it holds, when each can take a delta (`loads_delta_buckets`, or
    `current_weight` to rebuild from); None otherwise (the sync is full)."""
    members = _members(engine)
    if not all(e.loads_delta_buckets or _exposes_weights(e) for e in members):
        return None
    versions = {e.weight_version for e in members}
    return versions.pop() if len(versions) == 1 else None


@dataclass
class SyncStats:
    """What one sync moved (the step's ``weights/*`` metrics)."""

    version: int = 0
    delta: bool = False  # sent against the engines' version (else: every tensor in full)
    numel: int = 0
    changed: int = 0
    bytes_moved: int = 0
    full_bytes: int = 0
    encodings: dict[str, int] = field(default_factory=dict)  # tensors sent by each encoding

    def metrics(self) -> dict[str, float]:
        out = {"weights/delta": float(self.delta), "weights/bytes_moved": float(self.bytes_moved),
               "weights/full_bytes": float(self.full_bytes),
               "weights/changed_fraction": self.changed / self.numel if self.numel else 0.0}
        out.update({f"weights/tensors_{k}": float(v) for k, v in self.encodings.items()})
        return out


class DeltaEncoder:
    """The trainer side: the last synced version's tensors on the host, and buckets as deltas onto them.

    `encode` is given the version every engine reports holding (None: they differ, or one is new); it sends
    deltas only when that is the version kept here, and full tensors otherwise. Either way the kept copy
    becomes ``version``: a sync that fails part-way leaves the engines on another version, which the next
    sync sees and answers in full."""

    def __init__(self, encodings: tuple[str, ...] = ENCODINGS, *, measure_only_every: int = 0):
        self.encodings = encodings
        # >0: never send deltas; keep every n-th element only, enough to estimate the change fraction
        # (a full-sync run's metric) at 1/n of the host memory
        self.measure_only_every = measure_only_every
        self.kept: dict[str, torch.Tensor] = {}
        self.kept_version: int | None = None
        self.last = SyncStats()

    def encode(self, buckets: Iterator[NamedTensors], *, version: int, engines_hold: int | None
               ) -> Iterator[NamedTensors]:
        as_delta = engines_hold is not None and engines_hold == self.kept_version and not self.measure_only_every
        stats = self.last = SyncStats(version=version, delta=as_delta)
        self.kept_version = None  # until every bucket is through
        for bucket in buckets:
            out: NamedTensors = [header(engines_hold, version)] if as_delta else []
            for name, tensor in bucket:
                if self.measure_only_every:
                    self._measure(name, tensor, stats)
                    out.append((name, tensor))
                    continue
                host = tensor.detach().to("cpu", copy=True)
                # a full sync still counts what changed against the kept copy (the step's change fraction)
                delta = encode_tensor(name, host, self.kept.get(name), self.encodings if as_delta else ())
                self.kept[name] = host
                out.extend(delta.parts if as_delta else [(name, tensor)])
                stats.numel += delta.numel
                stats.changed += delta.changed
                stats.full_bytes += host.numel() * host.element_size()
                stats.bytes_moved += delta.nbytes
                stats.encodings[delta.encoding] = stats.encodings.get(delta.encoding, 0) + 1
            yield out
        self.kept_version = version

    def kept_digest(self) -> tuple[list[str], str] | None:
        """The names and `weights_digest` of the version kept (delta mode: the bytes the engines hold)."""
        if self.measure_only_every or self.kept_version is None:
            return None
        names = sorted(self.kept)
        return names, weights_digest(names, self.kept.__getitem__)

    def _measure(self, name: str, tensor: torch.Tensor, stats: SyncStats) -> None:
        """A full sync's tensor: counted as sent whole, its change estimated from every n-th element."""
        sample = tensor.detach().reshape(-1)[::self.measure_only_every].to("cpu", copy=True)
        old = self.kept.get(name)
        changed = (int((bits(sample) != bits(old)).sum()) if old is not None and old.shape == sample.shape
                   and old.dtype == sample.dtype else sample.numel())
        self.kept[name] = sample
        nbytes = tensor.numel() * tensor.element_size()
        stats.numel += tensor.numel()
        stats.changed += round(changed * tensor.numel() / max(1, sample.numel()))
        stats.full_bytes += nbytes
        stats.bytes_moved += nbytes
        stats.encodings["full"] = stats.encodings.get("full", 0) + 1
