"""Delta syncs into SGLang 0.5.17, which has no delta API: a custom weight loader (core/weights/delta.py).

SGLang calls ``--custom-weight-loader`` functions as ``loader(model, named_tensors)`` when
``/update_weights_from_tensor`` names one as its ``load_format`` (weight_updater.py). `load_weights` is
that loader. In each TP worker it keeps the HF-named tensors of the version it loaded last, on the host,
and turns every bucket into full HF tensors for the model's own ``load_weights`` (which fuses q/k/v,
gate/up and shards by TP as for any load):

- a bucket whose ``#delta`` header says base -1 is full: kept and loaded;
- a bucket onto base ``b`` is rebuilt from the kept tensors, only when this worker last loaded version
  ``b`` (or is part-way through the same sync); otherwise it raises `DeltaChainBroken`;
- a bucket may be a ``#file`` pointer: the path (uint8) of a safetensors file holding the bucket's
  parts, written by the sender (the ``disk`` transport: only the delta crosses the disk or the network).

SGLang moves the request's tensors to the GPU before calling the loader; the delta is applied on the host,
where the kept copy lives (a second copy of the weights on the GPU would cost the KV cache), and the full
tensors go back to the GPU for ``load_weights``.

SGLang 0.5.17 does not catch a custom loader's exception: its scheduler logs it and the server exits
unanswered. So the sender never sends a delta to a server that does not report the delta's base as its
weight version (`DeltaPusher`: a restarted or new server reports ``default`` and gets the full version);
the refusal here is the last guard, which trades the server (the engine recovery restarts it, and its next
sync is full) for never serving weights built on the wrong base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.weights.delta import HEADER, DeltaChainBroken, apply_delta_bucket

LOADER = "slime_rl.rollout_sglang.weights.delta_loader.load_weights"
FILE_POINTER = "#file"
FULL = -1  # a header's base for full tensors


class _Kept:
    """This worker's last loaded version: its HF tensors on the host, and the sync in progress."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None  # the version whose last bucket arrived... or is arriving
        self.base: int | None = None  # the base of the sync in progress


KEPT = _Kept()


def load_weights(model: Any, named_tensors: NamedTensors) -> None:
    """SGLang's custom loader: full HF tensors from this bucket (see the module doc) into ``model``."""
    full = rebuild(named_tensors, KEPT)
    model.load_weights(full)


def rebuild(named_tensors: NamedTensors, kept: _Kept) -> NamedTensors:
    """The full tensors a (delta) bucket stands for; updates ``kept``. Raises `DeltaChainBroken`."""
    device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
    if named_tensors and named_tensors[0][0] == FILE_POINTER:
        named_tensors = read_delta_file(bytes(named_tensors[0][1].tolist()).decode())
    named_tensors = [(name, t.detach().to("cpu")) for name, t in named_tensors]
    if not named_tensors or named_tensors[0][0] != HEADER:
        raise ValueError(f"{LOADER}: a bucket without a #delta header; send it with load_format=flattened_bucket")
    base, version = (int(v) for v in named_tensors[0][1].tolist())
    same_sync = kept.version == version and kept.base == base
    if base == FULL:
        full = list(named_tensors[1:])
    else:
        held = kept.base if same_sync else kept.version
        if not same_sync and kept.version != base:
            raise DeltaChainBroken(f"a delta onto weight version {base} reached a server that loaded "
                                   f"{'nothing through ' + LOADER if kept.version is None else f'version {held}'}"
                                   "; it needs a full sync")
        full = apply_delta_bucket([(HEADER, torch.tensor([base, version])), *named_tensors[1:]],
                                  kept.tensors.__getitem__, held_version=base)
    for name, tensor in full:
        kept.tensors[name] = tensor.clone() if base == FULL else tensor  # a delta's result is already a new tensor
    kept.version, kept.base = version, base
    return [(name, tensor.to(device)) for name, tensor in full]


def write_delta_file(named_tensors: NamedTensors, path: str | Path) -> Path:
    """A delta bucket (header first) as a safetensors file; its order travels in the metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    save_file(tensors, str(path), metadata={"order": json.dumps(list(tensors))})
    path.chmod(0o600)
    return path


def read_delta_file(path: str | Path) -> NamedTensors:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in json.loads(f.metadata()["order"])]


def file_pointer(path: str | Path) -> NamedTensors:
    """The bucket that tells the loader to read ``path``: one small uint8 tensor."""
    return [(FILE_POINTER, torch.tensor(list(str(path).encode()), dtype=torch.uint8))]
