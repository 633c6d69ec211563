"""Listening sockets that bind only the address a run chose.

torch's ``TCPStore`` server listens on every interface (``*:PORT``) whatever host it is
given, and so does a ``tcp://`` rendezvous (measured with torch 2.13: ``ss -ltn`` shows
``*:PORT`` for ``TCPStore("127.0.0.1", ...)``). Handing it a socket we bound ourselves
(``master_listen_fd``) is the way to keep it on loopback, or on a node's private address.
"""

from __future__ import annotations

import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


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
