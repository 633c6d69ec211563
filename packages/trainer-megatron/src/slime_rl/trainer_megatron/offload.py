"""Moving a trainer's GPU memory to the host and back without replacing any tensor.

Colocated with rollout engines, the trainer hands its GPU memory over between phases.
Assigning ``param.data = param.data.cpu()`` (what Megatron's own offload does) swaps the
tensor's device, and autograd then drops the parameter's gradient accumulator: the hooks
Megatron's DDP registered on it stop firing, backward no longer reaches ``main_grad``,
and every later grad norm is 0 (seen on the H200, docs/gpu-results.md). So this moves
*storages*: their bytes go to pinned host memory and the device storage shrinks to 0;
onload grows it back and copies the bytes in. Every tensor, view and hook stays as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class OffloadedStorage:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # pinned uint8 copy; None: the contents were not kept (restored as zeros)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload_storages(tensors: Iterable[torch.Tensor], *, keep: bool = True) -> list[OffloadedStorage]:
    """Free the device memory behind ``tensors`` (each storage once, however many views share it).
    With ``keep=False`` the contents are dropped (gradient buffers that are zeroed before use)."""
    offloaded: dict[int, OffloadedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in offloaded:
            continue
        host = None
        if keep:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes_view(storage), non_blocking=True)
        offloaded[storage.data_ptr()] = OffloadedStorage(storage, storage.nbytes(), host)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies must land before the memory is freed
    for item in offloaded.values():
        item.storage.resize_(0)
    return list(offloaded.values())


def onload_storages(offloaded: list[OffloadedStorage]) -> None:
    """Give every storage its memory back, with the bytes it had (or zeros)."""
    for item in offloaded:
        item.storage.resize_(item.nbytes)
        view = _bytes_view(item.storage)
        if item.host is None:
            view.zero_()
        else:
            view.copy_(item.host, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
