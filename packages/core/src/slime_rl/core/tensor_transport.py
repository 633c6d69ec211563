"""Named tensors through Ray's object store without pickling their bytes.

Ray stores numpy arrays out of band (one copy in, zero-copy views out), while a
torch tensor is pickled byte by byte. bf16 has no numpy dtype, so such tensors
travel as their int16 bit pattern and are viewed back: exact, no conversion.
"""

from __future__ import annotations

import numpy as np
import torch

from slime_rl.core.contracts import NamedTensors

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
