"""What a node leaves behind once its handler is shut down and closed, as torchrun's agent
does it (``shutdown()``, then ``close()``): no connection to etcd (a pooled one or a watch
stream's), none of the library's threads, and, on v3, no lease of its own that holds
nothing (each of those would live two hours on the server).

Connections are counted from ``/proc`` with the garbage collector off, since it would
close what the library forgot to.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.layout import DEFAULT_PREFIX, LegacyLayout, member_name
from etcd_rendezvous.registry import get_rendezvous_handler
from support import v3_gateway
from support.net import own_tcp_connections
from support.wait import wait_until

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["etcd", "etcd-v2"]

#: How long the library may take to end its threads and connections after ``close()``.
_BOUND = 5.0
#: Leases at least this long are the shared clean-up leases (shorter ones lapse soon).
_SHARED_TTL = 60


def _params(server: EtcdServer, backend: str, api: str, run_id: str, nodes: int) -> Any:
    return RendezvousParameters(
        backend=backend,
        endpoint=server.get_endpoint(),
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        etcd_api=api,
        read_timeout=10,
        timeout=30,
        join_timeout=30,
        last_call_timeout=1,
        torch_store="false",
    )


def _established(port: int) -> set[str]:
    """The inodes of this process's ESTABLISHED TCP connections to ``port``."""
    return {c.inode for c in own_tcp_connections() if c.state == "ESTABLISHED" and c.port == port}


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _use(handler: Any) -> None:
    """A round, its store, and ``num_nodes_waiting()`` (the legacy backend's watch)."""
    info = handler.next_rendezvous()
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    info.store.add("n", 1)
    assert handler.num_nodes_waiting() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_a_handler_leaves_no_connection_to_etcd(
    etcd_server: EtcdServer, api: str, backend: str, run_id: str, no_gc: None
) -> None:
    port = etcd_server.get_port()
    before = _established(port)
    handler = get_rendezvous_handler(_params(etcd_server, backend, api, run_id, 1))
    _use(handler)
    assert _established(port) - before, "the handler should have connected to etcd"
    handler.shutdown()
    handler.close()
    wait_until(
        lambda: not (_established(port) - before),
        _BOUND,
        f"the connections of a closed {backend} handler to etcd to be closed",
    )


def _library_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shutdown_ends_the_library_threads(
    etcd_server: EtcdServer, api: str, backend: str, run_id: str
) -> None:
    """torchrun's agent calls ``shutdown()`` alone: the threads end with it."""
    before = set(threading.enumerate())
    handler = get_rendezvous_handler(_params(etcd_server, backend, api, run_id, 1))
    try:
        _use(handler)
        assert handler.shutdown()
        wait_until(
            lambda: not _library_threads(before),
            _BOUND,
            f"the threads of a {backend} handler to end after shutdown(): "
            f"{_library_threads(before)}",
        )
    finally:
        handler.close()


def _leases(server: EtcdServer) -> list[tuple[int, int]]:
    """``(TTL left, keys held)`` of every lease of ``server``."""
    found = []
    for entry in v3_gateway.call(server.client_url, "/v3/lease/leases", {}).get("leases", []):
        answer = v3_gateway.call(
            server.client_url, "/v3/lease/timetolive", {"ID": entry["ID"], "keys": True}
        )
        found.append((int(answer.get("TTL", -1)), len(answer.get("keys", []))))
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_leaves_no_shared_lease_holding_nothing(
    private_etcd_server: EtcdServer, backend: str, run_id: str
) -> None:
    """Three nodes of one run, shut down and closed: the two-hour leases they granted
    are revoked where they hold no key; the leases of the run's keys stay (an etcd of
    its own: no other test's leases)."""
    nodes = 3
    server = private_etcd_server
    handlers = [
        get_rendezvous_handler(_params(server, backend, "v3", run_id, nodes)) for _ in range(nodes)
    ]
    try:
        with ThreadPoolExecutor(nodes) as pool:
            list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert handlers[0].shutdown()
    finally:
        for handler in handlers:
            handler.close()
    leases = _leases(server)
    assert [ttl for ttl, keys in leases if ttl > _SHARED_TTL and keys], "the run's keys' lease"
    orphans = [ttl for ttl, keys in leases if ttl > _SHARED_TTL and not keys]
    assert not orphans, f"long leases holding no key after the nodes closed: {orphans}"


def test_a_legacy_worker_that_shuts_down_deletes_its_own_keys(
    etcd_server: EtcdServer, api: str, run_id: str
) -> None:
    """``shutdown()`` closes the run, then deletes the worker's member key at once (it
    would otherwise live on for its TTL, 10 s); another worker's key, and the run's
    directory (on v3 a key of its own, kept alive like a member key), are not touched."""
    handlers = [get_rendezvous_handler(_params(etcd_server, "etcd", api, run_id, 2)) for _ in "ab"]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda h: h.next_rendezvous(), handlers))
        conn = handlers[0].rendezvous.connection
        layout = LegacyLayout(DEFAULT_PREFIX, run_id)
        version = json.loads(conn.get(layout.state_key).value or "{}")["version"]

        def members() -> list[str]:
            listing = conn.list_dir(layout.version_dir(version))
            return sorted(c.key for c in listing.children if member_name(c.key) is not None)

        before = members()
        assert len(before) == 2, before
        assert handlers[0].shutdown()
        after = members()  # at once: shutdown() returned
        assert len(after) == 1, (before, after)
        assert after[0] in before, (before, after)
        assert handlers[1].shutdown()
        assert members() == []
        assert conn.try_get(layout.run_dir) is not None
    finally:
        for handler in handlers:
            handler.close()
