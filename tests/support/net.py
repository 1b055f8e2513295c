"""Loopback endpoints for tests: a server's, and ports nothing listens on."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import NamedTuple

from etcd_rendezvous.etcd_server import EtcdServer

__all__ = ["TcpConnection", "closed_port", "closed_ports", "endpoint_of", "own_tcp_connections"]


def endpoint_of(server: EtcdServer) -> tuple[str, int]:
    """``(host, port)`` of ``server``'s client URL."""
    return (server.get_host(), server.get_port())


def closed_ports(count: int) -> list[int]:
    """Distinct loopback ports that nothing listens on (connections are refused)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def closed_port() -> int:
    """A loopback port that nothing listens on."""
    return closed_ports(1)[0]


class TcpConnection(NamedTuple):
    """One TCP connection of this process, as ``/proc`` shows it."""

    remote: str  #: the peer's IPv4 address (hex for IPv6)
    port: int  #: the peer's port
    state: str  #: ESTABLISHED, CLOSE_WAIT, ...
    inode: str  #: the socket's inode: the same connection in two listings


def own_tcp_connections() -> list[TcpConnection]:
    """The TCP connections of this process's open sockets (``/proc/self/fd`` matched by
    inode with ``/proc/self/net/tcp`` and ``tcp6``): no garbage collection is needed to
    see one the process forgot to close."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in list(fh)[1:]:
                fields = line.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if inode not in inodes:
                    continue
                address, port = remote.rsplit(":", 1)
                found.append(
                    TcpConnection(
                        _address(address), int(port, 16), _TCP_STATES.get(state, state), inode
                    )
                )
    return found


_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0B": "CLOSING",
}


def _address(hexaddr: str) -> str:
    if len(hexaddr) == 8:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexaddr)[::-1])
    return hexaddr
