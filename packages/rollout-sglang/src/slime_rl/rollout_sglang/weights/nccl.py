"""The ``nccl`` transport (disaggregated engines): the trainer joins a process group with the engines
(``/init_weights_update_group``) and broadcasts each bucket as one flat byte tensor while the engines
receive it (``/update_weights_from_distributed``). Gloo for CPU tensors, through the same code.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.infra.net import bound_tcp_store
from slime_rl.rollout_sglang.weights.buckets import flatten_bucket
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError, post

logger = logging.getLogger(__name__)

GROUP_NAME = "slime_rl_weight_sync"
_GROUP_SOCKETS: dict[Any, tuple[Any, socket.socket]] = {}  # weight-update group -> its store and listening socket


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
