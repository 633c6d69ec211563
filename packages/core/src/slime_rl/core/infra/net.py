"""Sockets that bind only the address a run chose, and the interface that holds it.

torch's ``TCPStore`` server listens on every interface (``*:PORT``) whatever host it is
given, and so does a ``tcp://`` rendezvous (measured with torch 2.13: ``ss -ltn`` shows
``*:PORT`` for ``TCPStore("127.0.0.1", ...)``). Handing it a socket we bound ourselves
(``master_listen_fd``) is the way to keep it on loopback, or on a node's private address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import socket
import struct
from datetime import timedelta
from pathlib import Path

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def node_address() -> str:
    """This node's address in the Ray cluster this process belongs to; loopback outside one."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS reports free on ``host`` right now (bind to port 0)."""
    with listening_socket(host) as sock:
        return sock.getsockname()[1]


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for a bind to port 0 or an outgoing connection."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_HANDED_OUT: set[tuple[str, int]] = set()  # ports this process chose for a later bind: never chosen twice


def port_to_bind_later(host: str = LOOPBACK) -> int:
    """A port free on ``host`` now, for a server that binds it seconds later in another process (the
    trainer ranks' rendezvous store, the SGLang servers). Picked below the ephemeral range, so no bind to
    port 0 and no outgoing connection meanwhile (an engine's server, Ray's workers) can take it: one from
    `free_port` was taken so in a CI run ("Address already in use" at the store), and two servers started
    together got the same one from it (neither had bound it yet). Never the same port twice in one process.
    Falls back to `free_port` where that range leaves no room below it."""
    low, _ = ephemeral_port_range()
    first = max(10000, low - 12000)
    for _ in range(64):
        port = random.randrange(first, low) if first < low else 0
        if port == 0:
            break
        if (host, port) in _HANDED_OUT:
            continue
        try:
            with listening_socket(host, port):
                _HANDED_OUT.add((host, port))
                return port
        except OSError:  # in use: another try
            continue
    return free_port(host)


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


def use_interface_of(address: str) -> None:
    """Have gloo and NCCL open their sockets on the interface holding ``address`` (unless the
    user named one): gloo otherwise takes the host name's interface (the machine's external
    one) and NCCL any non-loopback one. With loopback, nothing is reachable from another machine."""
    name = interface_of(address)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def listening_socket(host: str, port: int = 0, backlog: int = 512) -> socket.socket:
    """A TCP socket bound to ``host`` (never all interfaces) and listening; port 0 picks a free one."""
    if host in ("", "0.0.0.0", "::"):
        raise ValueError(f"refusing to listen on all interfaces ({host!r}); give loopback or the node's address")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def bound_tcp_store(host: str, world_size: int, timeout: float, port: int = 0):
    """The server side of a torch ``TCPStore`` listening on ``host`` only. Returns ``(store, port,
    sock)``; keep ``sock`` open as long as the store lives (the store serves on its descriptor).
    Clients connect as to any TCPStore, e.g. through a ``tcp://host:port`` rendezvous."""
    import torch.distributed as dist

    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    return store, port, sock
