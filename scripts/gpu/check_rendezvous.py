"""GPU check: trainer-like ranks (one per GPU, two at most) init NCCL through slime_rl.core.infra.distributed on 127.0.0.1,
all-reduce, and print every TCP socket they listen on (all must be loopback).

    python3 scripts/gpu/check_rendezvous.py
"""

import os
import socket
import subprocess
import sys
from pathlib import Path


def listening_sockets(pid: int) -> list[str]:
    """host:port of the TCP sockets ``pid`` listens on, from /proc (no ss or psutil needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # little-endian words
                found.append(f"{socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw)}:{int(port, 16)}")
    return found


def rank_main(rank: int) -> None:
    import datetime

    import torch

    from slime_rl.core.infra import distributed

    torch.cuda.set_device(rank)
    distributed.init_process_group("nccl", datetime.timedelta(minutes=2))
    x = torch.ones(1, device="cuda") * (rank + 1)
    torch.distributed.all_reduce(x)
    mine = listening_sockets(os.getpid())
    print(f"rank {rank}: all_reduce={x.item()} GLOO/NCCL_SOCKET_IFNAME="
          f"{os.environ.get('GLOO_SOCKET_IFNAME')}/{os.environ.get('NCCL_SOCKET_IFNAME')}", flush=True)
    for address in mine:
        print(f"rank {rank} listens: {address}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(int(sys.argv[1]))
        sys.exit(0)
    from slime_rl.core.infra.net import free_port

    port = free_port()
    import torch

    world = max(1, min(2, torch.cuda.device_count()))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    ranks = [subprocess.Popen([sys.executable, __file__, str(r)], env={**env, "RANK": str(r)}) for r in range(world)]
    sys.exit(max(p.wait() for p in ranks))
