"""Named tensors from one process to another: through Ray's object store without
pickling their bytes, or, between actors on one machine, through a shared-memory file.

Ray stores numpy arrays out of band (one copy in, zero-copy views out), while a
torch tensor is pickled byte by byte. bf16 has no numpy dtype, so such tensors
travel as their int16 bit pattern and are viewed back: exact, no conversion.

The object store's pages stay mapped in every process that wrote or read them, so a
weight sync through it leaves the weights' size resident in both the trainer and the
engine for the rest of the run. A file in /dev/shm that the reader deletes is gone, pages
and all, once the tensors read from it are freed (`write_bucket_file`, `read_bucket_file`).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.infra.leftovers import shared_memory_dir  # noqa: F401  (where buckets go; re-exported)

HostArrays = list[tuple[str, str, np.ndarray]]  # (name, torch dtype name, array)
_BIT_VIEWS = {torch.bfloat16: torch.int16}


def to_host_arrays(named_tensors: NamedTensors) -> HostArrays:
    out = []
    for name, tensor in named_tensors:
        tensor = tensor.detach().cpu()
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype in _BIT_VIEWS:
            tensor = tensor.view(_BIT_VIEWS[tensor.dtype])
        out.append((name, dtype_name, tensor.numpy()))
    return out


def from_host_arrays(arrays: HostArrays) -> NamedTensors:
    """Tensors over the arrays' memory (read-only views from Ray: copy them in, do not write)."""
    out = []
    for name, dtype_name, array in arrays:
        dtype = getattr(torch, dtype_name)
        tensor = torch.from_numpy(np.asarray(array))
        out.append((name, tensor.view(dtype) if dtype in _BIT_VIEWS else tensor))
    return out


def write_bucket_file(named_tensors: NamedTensors, folder: str | Path) -> str:
    """One bucket as a safetensors file in ``folder``; returns its path."""
    from safetensors.torch import save_file

    path = Path(folder) / f"bucket-{uuid.uuid4().hex}.safetensors"
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors}
    # safetensors sorts its entries; the order the trainer sent travels in the metadata
    save_file(tensors, str(path), metadata={"order": json.dumps(list(tensors))})
    path.chmod(0o600)  # the model's weights: the user's only (its folder is 0700 too, see leftovers)
    return str(path)


def read_bucket_file(path: str | Path) -> NamedTensors:
    """The bucket `write_bucket_file` wrote, in its order. The file is deleted at once; its
    tensors map it, so its memory goes when they are freed (copy them in, then drop them)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as bucket:
            return [(name, bucket.get_tensor(name)) for name in json.loads(bucket.metadata()["order"])]
    finally:
        Path(path).unlink(missing_ok=True)
