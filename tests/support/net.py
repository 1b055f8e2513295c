"""Loopback endpoints for tests: a server's, and ports nothing listens on."""

from __future__ import annotations

import socket

from etcd_rendezvous.etcd_server import EtcdServer

__all__ = ["closed_port", "closed_ports", "endpoint_of"]


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
