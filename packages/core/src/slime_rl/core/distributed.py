"""torch.distributed for the trainer ranks, listening on the run's address only.

torch's ``env://`` rendezvous has rank 0's TCPStore listen on every interface (``::``)
whatever MASTER_ADDR says, and gloo listens on the address of the interface it picks from the
host name (the machine's external one, unless GLOO_SOCKET_IFNAME names another; NCCL's
bootstrap likewise with NCCL_SOCKET_IFNAME). So rank 0 binds the store's socket to
MASTER_ADDR itself and hands it over (``master_listen_fd``), and each rank points gloo and
NCCL at the interface that holds the address it should use (`use_interface_of`).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct

import torch

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (IPv4, Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def use_interface_of(address: str) -> None:
    """Have gloo and NCCL open their sockets on the interface holding ``address`` (unless the
    user named one). With loopback, nothing of the trainer is reachable from another machine."""
    name = interface_of(address)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def _listening_socket(address: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen(128)
    return sock


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE; rank 0
    serves the store on MASTER_ADDR only."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if is_loopback(address):  # one machine (on a cluster the Ray launcher names each rank's interface)
        use_interface_of(address)
    listen_fd = _listening_socket(address, port).detach() if rank == 0 else None
    store = torch.distributed.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout,
                                       master_listen_fd=listen_fd)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
