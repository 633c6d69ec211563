"""A bucket of a weight sync as one flat byte tensor plus per-tensor metadata (SGLang's
``load_format="flattened_bucket"``): one transfer per bucket instead of one per tensor. The CUDA-IPC
payload (ipc.py), the NCCL broadcast (nccl.py) and the adapter folders' host copy (adapters.py) use it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slime_rl.core.contracts import NamedTensors


def flatten_bucket(named_tensors: NamedTensors) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """All tensors of a bucket as one byte tensor (on their device) and per-tensor metadata,
    laid out as SGLang's FlattenedTensorBucket expects."""
    if not named_tensors:
        raise ValueError("empty weight bucket")
    try:  # SGLang's own bucket, when it is importable here (same layout)
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach().contiguous()) for n, t in named_tensors])
        return bucket.get_flattened_tensor(), bucket.get_metadata()
    except ImportError:
        pass
    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(flat)
        # SimpleNamespace: SGLang's SafeUnpickler allows ``types.*``; it reads these attributes.
        metadata.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                        end_idx=offset + flat.numel(), numel=flat.numel()))
        offset += flat.numel()
    return torch.cat(parts), metadata
