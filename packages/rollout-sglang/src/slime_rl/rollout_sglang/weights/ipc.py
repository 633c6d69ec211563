"""The ``tensor`` transport (colocated engines): a bucket serialised with torch's multiprocessing
pickler, so CUDA tensors travel as CUDA-IPC handles (no copy), through ``/update_weights_from_tensor``;
CPU tensors go by value.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from typing import Any

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.weights.buckets import flatten_bucket
from slime_rl.rollout_sglang.weights.server_api import Target, post, post_all


def serialize_bucket(named_tensors: NamedTensors) -> str:
    """One bucket as base64 text for ``/update_weights_from_tensor`` (load_format
    ``flattened_bucket``). CUDA tensors go as CUDA-IPC handles (SGLang's MultiprocessingSerializer
    format, the GPU named by UUID so an engine that numbers its GPUs differently maps the right
    one): the engine maps them without a copy, and the caller must keep them alive until the
    POST returns. CPU tensors go by value (another process cannot map them)."""
    flat, metadata = flatten_bucket(named_tensors)
    payload = {"flattened_tensor": flat, "metadata": metadata}
    if not flat.is_cuda:
        return base64.b64encode(pickle.dumps(payload)).decode("ascii")
    try:  # the engine's own serializer and device-UUID patch, when SGLang is importable here
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        return base64.b64encode(_dumps_cuda_ipc(payload)).decode("ascii")
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(payload, output_str=True)


def _dumps_cuda_ipc(obj: Any) -> bytes:
    """torch's ForkingPickler, with each CUDA tensor's device index replaced by its GPU's UUID,
    which SGLang's patched ``rebuild_cuda_tensor`` maps back to its own index."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    def reduce_with_uuid(tensor: torch.Tensor):
        rebuild, args = reductions.reduce_tensor(tensor)
        if tensor.is_cuda and isinstance(args[6], int):  # args[6]: the device (torch's reduce_tensor layout)
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return rebuild, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = reduce_with_uuid
    pickler.dump(obj)
    return buf.getvalue()


def update_from_tensor(target: Target, named_tensors: NamedTensors, *, version: int | None, timeout: float,
                       step: str) -> None:
    """Load one bucket into one engine; one payload per TP rank (each rank maps its own handles)."""
    post(target, "/update_weights_from_tensor", _update_body(target, named_tensors, version, {}), timeout=timeout,
         step=step)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the engine has loaded the bucket: release the shared blocks


def _update_body(target: Target, named_tensors: NamedTensors, version: int | None, by_value: dict) -> dict | bytes:
    """``/update_weights_from_tensor``'s body for ``target``. CUDA buckets get a payload per TP rank (each
    rank's handles are its own: torch counts every share of a CUDA block); a CPU bucket's body is the same
    for every engine of a TP size, serialised and JSON-encoded once into ``by_value``."""
    def body(payloads: list[str]) -> dict:
        out = {"serialized_named_tensors": payloads, "load_format": "flattened_bucket", "flush_cache": False}
        if version is not None:
            out["weight_version"] = str(version)
        return out

    if any(t.is_cuda for _, t in named_tensors):
        return body([serialize_bucket(named_tensors) for _ in range(target.tp_size)])
    if "payload" not in by_value:
        by_value["payload"] = serialize_bucket(named_tensors)
    if target.tp_size not in by_value:
        by_value[target.tp_size] = json.dumps(body([by_value["payload"]] * target.tp_size)).encode()
    return by_value[target.tp_size]


def push_tensor_bucket(targets: list[Target], named_tensors: NamedTensors, *, version: int | None,
                       timeout: float, step: str) -> None:
    """Trainer side of a colocated sync: one bucket into every engine, posted to all at once (each POST
    waits for its engine's load; one after another, a sync's time and rank 0's CPU grew with the engines:
    docs/scale.md). Payloads are made here, in order, before any POST. Pass ``version`` with the last
    bucket only, so an engine reports the new version once it has all of it."""
    by_value: dict = {}
    bodies = [_update_body(target, named_tensors, version, by_value) for target in targets]
    post_all(targets, "/update_weights_from_tensor", lambda i, _target: bodies[i], timeout=timeout, step=step)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # every engine has loaded the bucket: release the shared blocks
