"""torch.distributed for the trainer ranks, listening on the run's address only.

torch's ``env://`` rendezvous has rank 0's TCPStore listen on every interface (``::``)
whatever MASTER_ADDR says, and gloo listens on the address of the interface it picks from the
host name (the machine's external one, unless GLOO_SOCKET_IFNAME names another; NCCL's
bootstrap likewise with NCCL_SOCKET_IFNAME). So rank 0 binds the store's socket to
MASTER_ADDR itself and hands it over (``master_listen_fd``), and each rank points gloo and
NCCL at the interface that holds the address it should use (`net.use_interface_of`).
"""

from __future__ import annotations

import datetime
import os

import torch

from slime_rl.core.infra.net import is_loopback, listening_socket, use_interface_of


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE; rank 0
    serves the store on MASTER_ADDR only."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if is_loopback(address):  # one machine (on a cluster the Ray launcher names each rank's interface)
        use_interface_of(address)
    listen_fd = listening_socket(address, port, backlog=128).detach() if rank == 0 else None
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                                       master_listen_fd=listen_fd)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
