"""A torch TCPStore served through `bound_tcp_store` listens on the chosen address only (a plain
TCPStore listens on every interface whatever host it is given)."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest
import torch.distributed as dist

from slime_rl.core.infra.net import bound_tcp_store, listening_socket


def listening_on(port: int) -> list[str]:
    """Addresses listening on ``port``, from the kernel's socket tables (state 0A: LISTEN)."""
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:] if Path(table).exists() else []:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                raw = bytes.fromhex(addr)
                raw = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
                found.append(socket.inet_ntop(family, raw))
    return sorted(found)


def test_plain_tcpstore_listens_everywhere_bound_store_on_loopback_only():
    plain = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert listening_on(plain.port) in (["0.0.0.0"], ["::"])  # why the helper exists; if torch changes, revisit
    store, port, sock = bound_tcp_store("127.0.0.1", world_size=2, timeout=10)
    try:
        assert listening_on(port) == ["127.0.0.1"]
        client = dist.TCPStore("127.0.0.1", port, 2, False)
        client.set("weights", "v1")
        assert store.get("weights") == b"v1"
    finally:
        sock.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::"])
def test_all_interfaces_are_refused(host):
    with pytest.raises(ValueError, match="refusing to listen on all interfaces"):
        listening_socket(host)


def test_a_port_to_bind_later_lies_below_the_ephemeral_range_and_is_free():
    """A rendezvous port chosen now and bound seconds later in another process: no bind to port 0 can
    take it meanwhile, because those draw from the ephemeral range only."""
    from slime_rl.core.infra.net import ephemeral_port_range, listening_socket, port_to_bind_later

    low, high = ephemeral_port_range()
    assert 1024 < low < high
    ports = {port_to_bind_later() for _ in range(20)}
    assert all(port < low for port in ports)
    for port in list(ports)[:3]:
        with listening_socket("127.0.0.1", port):  # free to bind now
            pass


def test_ports_to_bind_later_are_never_the_same_twice_in_a_process():
    """Servers started together each get their own port, though none has bound its own yet (drawn at random
    from ~12,000 ports, 300 picks would repeat one with a probability of ~97%)."""
    from slime_rl.core.infra.net import port_to_bind_later

    ports = [port_to_bind_later() for _ in range(300)]
    assert len(set(ports)) == len(ports)
