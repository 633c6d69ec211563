"""Weights into SGLang servers, three ways, each step with a timeout and an error that names
the engine and the step:

- tensor (colocated): buckets serialised with torch's multiprocessing pickler, so CUDA
  tensors travel as CUDA-IPC handles (no copy), through ``/update_weights_from_tensor``;
- nccl (disaggregated): the trainer joins a process group with the engines
  (``/init_weights_update_group``) and broadcasts each bucket while the engines receive
  it (``/update_weights_from_distributed``);
- disk: an HF folder written shard by shard, loaded with ``/update_weights_from_disk``.

Plain blocking functions: the trainer process calls them directly; the async engine
runs them in a thread. Buckets travel as one flat byte tensor plus metadata (SGLang's
``load_format="flattened_bucket"``), one transfer per bucket instead of one per tensor.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import httpx
import torch

from slime_rl.core.infra.net import bound_tcp_store
from slime_rl.rollout_sglang.keys import bearer

NamedTensors = list[tuple[str, torch.Tensor]]
logger = logging.getLogger(__name__)

GROUP_NAME = "slime_rl_weight_sync"
_GROUP_SOCKETS: dict[Any, tuple[Any, socket.socket]] = {}  # weight-update group -> its store and listening socket


class WeightSyncError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    """An engine as a sync sees it."""

    name: str  # for messages, e.g. "sglang engine 0 (http://127.0.0.1:30001)"
    url: str
    tp_size: int = 1
    admin_key: str | None = field(default=None, repr=False)  # the server's --admin-api-key (keys.py)
    api_key: str | None = field(default=None, repr=False)  # its --api-key, for the endpoints SGLang marks NORMAL

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.admin_key)


# ---------------------------------------------------------------- HTTP


def post(target: Target, path: str, body: dict[str, Any] | None, *, timeout: float, step: str,
         ok_status: tuple[int, ...] = (200,), api_key: bool = False) -> Any:
    """POST and check SGLang's answer (HTTP 200 and, where present, ``success: true``). The admin key goes
    with it, or with ``api_key`` the API key (SGLang takes only that one on its NORMAL endpoints, such
    as ``/load_lora_adapter_from_tensors``, when both are set)."""
    headers = bearer(target.api_key) if api_key else target.headers
    try:
        resp = httpx.post(f"{target.url}{path}", json=body if body is not None else {}, headers=headers,
                          timeout=timeout)
    except httpx.TimeoutException:
        raise WeightSyncError(f"{target.name}: {step}: {path} timed out after {timeout:.0f} s") from None
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: {type(err).__name__}: {err}") from None
    if resp.status_code not in ok_status:
        raise WeightSyncError(f"{target.name}: {step}: {path} answered HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        data = resp.json()
    except ValueError:
        return resp.text
    if isinstance(data, dict) and data.get("success") is False:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: "
                              f"{data.get('message') or data.get('error_message')}")
    return data


def reachable(target: Target, timeout: float = 5.0) -> bool:
    """Whether the server accepts connections at all (any answer to ``/health``, even 503, counts)."""
    try:
        httpx.get(f"{target.url}/health", timeout=timeout)
    except httpx.TransportError:
        return False
    return True


def post_all(targets: list[Target], path: str, body: Callable[[int, Target], dict] | dict | None, *,
             timeout: float, step: str) -> list[Any]:
    """The same call on every engine at once; the first failure is raised after all returned."""
    if not targets:
        return []
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = [pool.submit(post, t, path, body(i, t) if callable(body) else body, timeout=timeout, step=step)
                   for i, t in enumerate(targets)]
        return [f.result() for f in futures]


def pause_generation(targets: list[Target], *, timeout: float, step: str, mode: str = "abort") -> None:
    """Stop generating until `continue_generation`: ``abort`` (SGLang's default) aborts in-flight requests
    (they return what they have); ``in_place`` (fully async) holds them where they are, KV cache and all,
    and they go on with the new weights, without a re-prefill. New requests wait either way."""
    post_all(targets, "/pause_generation", {"mode": mode}, timeout=timeout, step=step)


def continue_generation(targets: list[Target], *, timeout: float, step: str) -> None:
    post_all(targets, "/continue_generation", {}, timeout=timeout, step=step)


def flush_cache(targets: list[Target], *, timeout: float, step: str) -> None:
    """Drop the prefix cache (its KV came from the old weights). SGLang refuses (HTTP 400)
    while requests are pending, so poll until it succeeds. A server that refuses the connection is
    gone (no retry brings it back; its restart flushes anyway): that fails at once."""
    for target in targets:
        deadline = time.monotonic() + timeout
        while True:
            try:
                resp = httpx.post(f"{target.url}/flush_cache", headers=target.headers, timeout=timeout)
                if resp.status_code == 200:
                    break
                problem = f"HTTP {resp.status_code}: {resp.text.strip()[:200]}"
            except httpx.ConnectError as err:
                raise WeightSyncError(f"{target.name}: {step}: /flush_cache failed: {type(err).__name__}: {err}") from None
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"{target.name}: {step}: /flush_cache did not succeed within "
                                      f"{timeout:.0f} s; last: {problem}")
            time.sleep(0.1)


def release_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/release_memory_occupation", {"tags": tags}, timeout=timeout, step="release memory")


def resume_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/resume_memory_occupation", {"tags": tags}, timeout=timeout, step="resume memory")


# ---------------------------------------------------------------- buckets


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
    payloads = [serialize_bucket(named_tensors) for _ in range(target.tp_size)]
    body = {"serialized_named_tensors": payloads, "load_format": "flattened_bucket", "flush_cache": False}
    if version is not None:
        body["weight_version"] = str(version)
    post(target, "/update_weights_from_tensor", body, timeout=timeout, step=step)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # the engine has loaded the bucket: release the shared blocks


def push_tensor_bucket(targets: list[Target], named_tensors: NamedTensors, *, version: int | None,
                       timeout: float, step: str) -> None:
    """Trainer side of a colocated sync: one bucket into every engine. Pass ``version`` with the
    last bucket only, so an engine reports the new version once it has all of it."""
    for target in targets:
        update_from_tensor(target, named_tensors, version=version, timeout=timeout, step=step)


# ---------------------------------------------------------------- NCCL


def local_address_for(url: str) -> str:
    """This host's address as seen from the engine at ``url`` (loopback for local engines)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 80))  # no packet is sent; this only picks the outgoing interface
        return sock.getsockname()[0]


def _join_group(store, *, world_size: int, rank: int, group_name: str, backend: str, timeout: float):
    """A process group apart from the default one (the trainer's own stays untouched), made the way
    SGLang's engines make theirs (a ``tcp://`` rendezvous, then a group over a PrefixStore), so both
    sides meet in the same store."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    store.set_timeout(timedelta(seconds=timeout))
    group, _ = _new_process_group_helper(world_size, rank, [], torch.distributed.Backend(backend),
                                         PrefixStore(group_name, store), group_name=group_name,
                                         timeout=timedelta(seconds=timeout))
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _wait_with_posts(work: Any, futures: list[tuple[Target, Future]], *, timeout: float, step: str,
                     what: str) -> None:
    """Wait for a collective and the engines' HTTP answers together; the first failure or the
    deadline raises (an engine that refused would otherwise leave the collective hanging)."""
    deadline = time.monotonic() + timeout
    while True:
        for _, fut in futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()
        if (work is None or work.is_completed()) and all(f.done() for _, f in futures):
            if work is not None:
                work.wait()
            return
        if time.monotonic() >= deadline:
            pending = [t.name for t, f in futures if not f.done()] or ["this trainer process"]
            raise WeightSyncError(f"{step}: {what} timed out after {timeout:.0f} s waiting for {', '.join(pending)}")
        time.sleep(0.005)


def _match_engine_nccl_memory() -> None:
    """SGLang's servers run NCCL with cuMem allocations off (NCCL_CUMEM_ENABLE=0); a peer with them
    on never completes the first broadcast. NCCL reads the variable at its first communicator, so
    trainer processes set it at start (`trainer_megatron.device.init_distributed`); this covers a
    process that syncs without having used NCCL before."""
    value = os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    if value != "0":
        logger.warning("NCCL_CUMEM_ENABLE=%s in the trainer, but SGLang's engines run with 0: the weight-update "
                       "broadcast may hang; unset it or set it to 0", value)


def init_nccl_group(targets: list[Target], *, timeout: float, backend: str = "nccl", group_name: str = GROUP_NAME,
                    master_addr: str | None = None, master_port: int | None = None):
    """Trainer side: create the weight-update group (trainer = rank 0, engine TP ranks after it).
    Every engine's ``/init_weights_update_group`` blocks until all ranks joined, so the calls
    go out in threads while this process joins."""
    _match_engine_nccl_memory()
    master_addr = master_addr or local_address_for(targets[0].url)
    world_size = 1 + sum(t.tp_size for t in targets)
    # The store listens on master_addr only (a plain tcp:// rendezvous would listen on all interfaces).
    store, master_port, listen_sock = bound_tcp_store(master_addr, world_size, timeout, port=master_port or 0)
    offsets = [1 + sum(t.tp_size for t in targets[:i]) for i in range(len(targets))]
    step = f"init weight-update group {group_name} (world size {world_size}, {backend})"
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = [(t, pool.submit(post, t, "/init_weights_update_group", {
            "master_address": master_addr, "master_port": master_port, "rank_offset": offsets[i],
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout=timeout, step=step))
            for i, t in enumerate(targets)]
        try:
            group = _join_group(store, world_size=world_size, rank=0, group_name=group_name, backend=backend,
                                timeout=timeout)
        except Exception as err:
            listen_sock.close()
            for _, f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception() from None
            raise WeightSyncError(f"{step}: the trainer could not join at {master_addr}:{master_port}: {err}") from None
        _wait_with_posts(None, futures, timeout=timeout, step=step, what="engines joining")
    _GROUP_SOCKETS[group] = (store, listen_sock)  # the store serves on this socket while the group lives
    return group


def broadcast_bucket(group, targets: list[Target], named_tensors: NamedTensors, *, version: int | None,
                     timeout: float, step: str, group_name: str = GROUP_NAME) -> None:
    """Trainer side of a disaggregated sync: every engine posts a receive for the bucket, and
    this process broadcasts it as one flat byte tensor (rank 0 of ``group``)."""
    flat, metadata = flatten_bucket(named_tensors)
    body = {"names": [m.name for m in metadata], "dtypes": [str(m.dtype).removeprefix("torch.") for m in metadata],
            "shapes": [list(m.shape) for m in metadata], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": False}
    if version is not None:
        body["weight_version"] = str(version)
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = [(t, pool.submit(post, t, "/update_weights_from_distributed", body, timeout=timeout, step=step))
                   for t in targets]
        work = torch.distributed.broadcast(flat, src=0, group=group, async_op=True)
        _wait_with_posts(work, futures, timeout=timeout, step=step, what="broadcast")


def destroy_nccl_group(group, targets: list[Target], *, timeout: float, group_name: str = GROUP_NAME) -> None:
    """Leave the group on both sides (after an engine restart the group must be made anew)."""
    for target in targets:
        try:
            post(target, "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout,
                 step="destroy weight-update group")
        except WeightSyncError:
            pass  # a dead engine has no group left to destroy
    if group is not None:
        close_group(group)


def close_group(group) -> None:
    """This side of the group, and the store's listening socket when this process hosts it."""
    try:
        torch.distributed.destroy_process_group(group)
    finally:
        _, listen_sock = _GROUP_SOCKETS.pop(group, (None, None))
        if listen_sock is not None:
            listen_sock.close()


# ---------------------------------------------------------------- disk


_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def write_shard(folder: str | Path, index: int, named_tensors: NamedTensors) -> Path:
    """One bucket as ``model-{index:05d}.safetensors`` in ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"model-{index:05d}.safetensors"
    save_file({name: t.detach().to("cpu").contiguous() for name, t in named_tensors}, str(path))
    return path


def finish_hf_folder(folder: str | Path, base_model_path: str | Path) -> Path:
    """Make ``folder`` a loadable HF model: the base model's config and tokenizer files and
    a ``model.safetensors.index.json`` over the shards written so far."""
    from safetensors import safe_open

    folder, base = Path(folder), Path(base_model_path)
    for name in _HF_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, folder / name)
    weight_map, total = {}, 0
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = shard.name
        total += shard.stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder


def save_hf_folder(named_tensors: NamedTensors, folder: str | Path, base_model_path: str | Path) -> Path:
    write_shard(folder, 0, named_tensors)
    return finish_hf_folder(folder, base_model_path)


def update_from_disk(target: Target, folder: str | Path, *, version: int | None, timeout: float, step: str) -> None:
    body: dict[str, Any] = {"model_path": str(folder), "flush_cache": False}
    if version is not None:
        body["weight_version"] = str(version)
    post(target, "/update_weights_from_disk", body, timeout=timeout, step=step)


# ---------------------------------------------------------------- check

# SGLang loads these into fused parameters (qkv_proj, gate_up_proj), whose checksum no single
# trainer tensor has; the check compares the parameters both sides hold under one name.
_FUSED_IN_SGLANG = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A tensor's checksum as SGLang's ``/weights_checker`` reports it (``weight_checker._hash_tensor``:
    its GPU hash kernel for CUDA tensors, the first 8 bytes of SHA-256 over the raw bytes otherwise)."""
    flat = tensor.detach().contiguous()
    if flat.is_cuda:
        try:
            from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash
        except ImportError as err:
            raise WeightSyncError("rollout.check_weight_update: checksums of CUDA weights use SGLang's GPU hash "
                                  "kernel, and sglang is not importable in this process; install it here or "
                                  "set rollout.check_weight_update=false") from err
        return f"{gpu_tensor_hash(flat):016x}"
    digest = hashlib.sha256(flat.reshape(-1).view(torch.uint8).numpy()).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def widest_tp(targets: list[Target]) -> int:
    return max((t.tp_size for t in targets), default=1)


def _comparable(name: str, tensor: torch.Tensor, tp_size: int) -> bool:
    """Whether an engine holds this tensor whole under the same name: not fused by SGLang and, with
    tensor parallelism, replicated on every rank (the norms; the other weights are sharded)."""
    if any(part in name for part in _FUSED_IN_SGLANG):
        return False
    return tp_size == 1 or (tensor.dim() == 1 and "norm" in name)


def check_sample(named_tensors: NamedTensors, *, tp_size: int = 1, every: bool = False) -> dict[str, str]:
    """What `check_weights` compares after a sync: the checksums of a bucket's first and last tensors
    that an engine of ``tp_size`` holds whole (``every``: all of them)."""
    candidates = [(n, t) for n, t in named_tensors if _comparable(n, t, tp_size)]
    picked = candidates if every else candidates[:1] + candidates[-1:]
    return {name: tensor_checksum(tensor) for name, tensor in picked}


def check_weights(target: Target, expected: dict[str, str], *, timeout: float, step: str) -> int:
    """Compare the engine's parameters with the trainer's by checksum (SGLang's ``/weights_checker``,
    which hashes every parameter on every TP rank; ``/get_weights_by_name`` does not serve Qwen2/Qwen3).
    Returns how many tensors were compared; raises when one differs or none could be compared."""
    answer = post(target, "/weights_checker", {"action": "checksum"}, timeout=timeout, step=f"{step}: checksums")
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not ranks:
        raise WeightSyncError(f"{target.name}: {step}: /weights_checker returned no checksums: {str(answer)[:300]}")
    problems, compared = [], 0
    for rank in ranks:
        held = rank.get("checksums", {})
        for name, want in expected.items():
            if name not in held:
                continue  # a tied or renamed parameter: the engine holds it under another name
            compared += 1
            if held[name] != want:
                problems.append(f"{name} (TP rank {rank.get('parallelism_info', {}).get('tp_rank', '?')}): "
                                f"engine checksum {held[name]} != trainer's {want}")
    if problems:
        raise WeightSyncError(f"{target.name}: {step}: engine weights differ from the trainer's: "
                              + "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    if expected and not compared:
        raise WeightSyncError(f"{target.name}: {step}: none of the {len(expected)} sampled tensors "
                              f"({', '.join(sorted(expected)[:3])}...) is a parameter of the engine under that name")
    return compared
