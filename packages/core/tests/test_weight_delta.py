"""Delta weight syncs (core/weights/delta.py): every encoding rebuilds the new tensor bit for bit, the
encoder falls back to full tensors when a delta is not smaller or the engines hold another version,
and a delta onto the wrong base version is refused."""

from __future__ import annotations

import pytest
import torch

from slime_rl.core.weights.delta import (
    HEADER,
    DeltaChainBroken,
    DeltaEncoder,
    apply_delta_bucket,
    bits,
    encode_tensor,
    is_delta_bucket,
)


def _moved(old: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    new_bits = bits(old).clone()
    new_bits[torch.rand(old.numel(), generator=gen) < fraction] += 1
    return new_bits.view(old.dtype).reshape(old.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("encoding", ["sparse", "xor"])
def test_each_encoding_rebuilds_the_tensor_bit_for_bit(dtype, encoding):
    old = (torch.randn(64, 48) * 0.02).to(dtype)
    new = _moved(old, 0.01)
    delta = encode_tensor("w", new, old, ("full", encoding))
    assert delta.encoding == encoding and delta.nbytes < new.numel() * new.element_size()
    rebuilt = apply_delta_bucket([(HEADER, torch.tensor([3, 4])), *delta.parts], {"w": old}.__getitem__, held_version=3)
    assert rebuilt[0][0] == "w" and torch.equal(bits(rebuilt[0][1]), bits(new))
    assert torch.equal(bits(old), bits(_moved(old, 0.0)))  # the engine's tensor is left as it was


def test_full_when_no_delta_is_smaller_or_no_comparable_base():
    old = torch.randn(32, 32).to(torch.bfloat16)
    everything = _moved(old, 1.0)
    assert encode_tensor("w", everything, old, ("full", "sparse")).encoding == "full"
    assert encode_tensor("w", old, None).encoding == "full"
    assert encode_tensor("w", old, old.float()).encoding == "full"  # another dtype: nothing to diff against
    unchanged = encode_tensor("w", old.clone(), old)
    assert unchanged.changed == 0 and unchanged.encoding != "full"


def test_encoder_sends_deltas_only_onto_the_version_it_kept():
    weights = {"a": (torch.randn(256, 64) * 0.02).to(torch.bfloat16), "norm": torch.ones(64, dtype=torch.bfloat16)}
    enc = DeltaEncoder()
    first = list(enc.encode(iter([list(weights.items())]), version=1, engines_hold=0))
    assert not enc.last.delta and not is_delta_bucket(first[0]) and enc.last.changed == enc.last.numel
    weights["a"] = _moved(weights["a"], 0.02)
    second = list(enc.encode(iter([list(weights.items())]), version=2, engines_hold=1))
    assert enc.last.delta and is_delta_bucket(second[0])
    assert enc.last.bytes_moved < enc.last.full_bytes
    assert 0.01 < enc.last.metrics()["weights/changed_fraction"] < 0.03
    engine = {k: v.clone() for k, v in weights.items()}
    # an engine that missed a version (or restarted, or joined late) is not at the encoder's kept version
    third = list(enc.encode(iter([list(weights.items())]), version=3, engines_hold=0))
    assert not enc.last.delta and not is_delta_bucket(third[0])
    assert enc.last.metrics()["weights/changed_fraction"] == 0.0  # measured against the kept copy all the same
    fourth = list(enc.encode(iter([list(weights.items())]), version=4, engines_hold=3))
    applied = dict(apply_delta_bucket(fourth[0], engine.__getitem__, held_version=3))
    assert all(torch.equal(bits(applied[k]), bits(weights[k])) for k in weights)


def test_a_delta_onto_another_version_is_refused():
    old = torch.randn(16).to(torch.bfloat16)
    delta = encode_tensor("w", _moved(old, 0.5), old)
    with pytest.raises(DeltaChainBroken, match="version 5 reached an engine at version 4"):
        apply_delta_bucket([(HEADER, torch.tensor([5, 6])), *delta.parts], {"w": old}.__getitem__, held_version=4)


def test_a_failed_sync_leaves_no_kept_version():
    enc = DeltaEncoder()
    list(enc.encode(iter([[("w", torch.zeros(4))]]), version=1, engines_hold=None))

    def broken():
        yield [("w", torch.ones(4))]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError):
        list(enc.encode(broken(), version=2, engines_hold=1))
    assert enc.kept_version is None  # the next sync is full, whatever the engines report
