"""TEST DOUBLE (CPU tests only): the stand-in server's side of SGLang's weight-update group
(``/init_weights_update_group``, ``/update_weights_from_distributed``), a real torch.distributed group
(gloo on CPU) joined and received on as SGLang's engines do."""

from __future__ import annotations

from datetime import timedelta

import torch


def join_group(body: dict):
    """Join the trainer's weight-update group as ranks rank_offset.. (SGLang's init_custom_process_group)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    world_size, rank = int(body["world_size"]), int(body["rank_offset"])
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timedelta(seconds=60)))
    store = PrefixStore(body.get("group_name", "weight_update_group"), store)
    group, _ = _new_process_group_helper(world_size, rank, [], torch.distributed.Backend(body.get("backend", "nccl")),
                                         store, group_name=body.get("group_name", "weight_update_group"),
                                         timeout=timedelta(seconds=60))
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def receive_broadcast(group, body: dict) -> list[tuple[str, torch.Tensor]]:
    shapes = [torch.Size(s) for s in body["shapes"]]
    dtypes = [getattr(torch, d) for d in body["dtypes"]]
    if body.get("load_format") == "flattened_bucket":
        sizes = [int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=group)
        named, offset = [], 0
        for name, shape, dtype, size in zip(body["names"], shapes, dtypes, sizes, strict=True):
            named.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
            offset += size
        return named
    named = []
    for name, shape, dtype in zip(body["names"], shapes, dtypes, strict=True):
        tensor = torch.empty(shape, dtype=dtype)
        torch.distributed.broadcast(tensor, src=0, group=group)
        named.append((name, tensor))
    return named
