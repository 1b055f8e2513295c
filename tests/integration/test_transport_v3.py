"""The v3 transport against real etcd servers: leases, directories, watches, auth, TLS.

Every etcd since 3.4 serves the v3 gateway, with or without ``--enable-v2``, so these
run in every pass. The behaviour both transports share (lost answers, failover, TLS
errors) is tested for both in ``test_client.py``; the whole suite also runs on v3 in CI
(``ETCD_RENDEZVOUS_ETCD_API=v3``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import urllib3

from etcd_rendezvous._transport.interface import (
    KeyExistsError,
    KeyNotFoundError,
    TransportClosedError,
)
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous._transport.v3_wire import b64
from etcd_rendezvous.api import Deadline, RendezvousConnectionError
from etcd_rendezvous.etcd_server import EtcdServer
from support.etcd_requests import read_metrics, requests_since
from support.faultproxy import FaultProxy
from support.net import endpoint_of
from support.wait import wait_until

Connect = Callable[..., EtcdV3Connection]


@pytest.fixture
def api() -> str:
    """This module tests the v3 transport alone: ``connect`` opens v3 connections."""
    return "v3"


@pytest.fixture
def v3(etcd_server: EtcdServer, connect: Connect) -> EtcdV3Connection:
    return connect(endpoint_of(etcd_server))


def gateway(server: EtcdServer, path: str, body: dict[str, Any], token: str = "") -> Any:
    """One raw request to ``server``'s gateway (test set-up, outside the code under test)."""
    headers = {"Authorization": token} if token else {}
    # A PoolManager rather than urllib3.request(), which urllib3 1.26 lacks.
    response = urllib3.PoolManager().request(
        "POST", server.client_url + path, body=json.dumps(body).encode(), headers=headers
    )
    assert response.status == 200, (path, response.status, response.data)
    return json.loads(response.data)


# -- leases ------------------------------------------------------------------------------


def test_a_key_with_a_ttl_lapses_and_a_refreshed_one_does_not(
    v3: EtcdV3Connection, etcd_prefix: str
) -> None:
    lapsing, kept = f"{etcd_prefix}/lapsing", f"{etcd_prefix}/kept"
    v3.set(lapsing, "a", ttl=1)
    v3.set(kept, "b", ttl=1)
    assert v3.time_to_live(v3.get(kept)) in (0, 1)

    def lapsed_while_kept_refreshed() -> bool:
        v3.refresh(kept, 1)
        return v3.try_get(lapsing) is None

    wait_until(lapsed_while_kept_refreshed, 5, "the 1 s lease to lapse")
    # The refreshed key outlived its first TTL, and keeps its value.
    assert v3.get(kept).value == "b"
    with pytest.raises(KeyNotFoundError):
        v3.refresh(lapsing, 1)


def test_refresh_follows_the_lease_another_writer_attached(
    v3: EtcdV3Connection, connect: Connect, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The legacy backend's last-call worker refreshes the state key while others
    rewrite it (each write attaching a lease of its own): the refresh must keep the
    key's current lease alive, not the one this connection attached last."""
    key = f"{etcd_prefix}/state"
    v3.set(key, "a", ttl=2)
    other = connect(endpoint_of(etcd_server))
    other.compare_and_swap(key, "b", other.get(key), ttl=2)
    # A key of a 3 s lease granted after both: once it lapsed, either 2 s lease would
    # have too, but for the refreshes.
    other.set(f"{etcd_prefix}/control", "c", ttl=3)

    def control_lapsed_while_refreshing() -> bool:
        v3.refresh(key, 2)
        return other.try_get(f"{etcd_prefix}/control") is None

    wait_until(control_lapsed_while_refreshing, 10, "the 3 s lease of the control key")
    assert v3.get(key).value == "b"


def test_refresh_with_the_lease_of_our_own_write_is_one_request(
    connect: Connect, private_etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A key only we write (a node's heartbeat key, a member key): its lease is kept
    alive without reading the key first; the returned lease is the one to pass next."""
    v3 = connect(endpoint_of(private_etcd_server))
    key = f"{etcd_prefix}/ours"
    lease = v3.set(key, "v", ttl=30).lease
    before = read_metrics(private_etcd_server.client_url)
    for _ in range(3):
        lease = v3.refresh(key, 30, lease=lease).lease
    requests = requests_since(private_etcd_server.client_url, before)
    assert requests.by_method == {"v3 LeaseKeepAlive": 3}, requests.describe()
    assert v3.get(key).lease == lease


def test_refresh_with_a_lapsed_lease_reads_the_key(
    v3: EtcdV3Connection, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """The lease passed is gone (revoked, or lapsed with the key): the key is read, and
    its absence reported; a key rewritten with a longer TTL is refreshed by its lease."""
    key = f"{etcd_prefix}/ours"
    lease = v3.set(key, "v", ttl=5).lease
    v3.delete(key)
    gateway(etcd_server, "/v3/lease/revoke", {"ID": str(lease)})
    with pytest.raises(KeyNotFoundError):
        v3.refresh(key, 5, lease=lease)
    current = v3.set(key, "w", ttl=5).lease
    assert v3.refresh(key, 5, lease=lease).lease == current


def test_update_with_the_lease_of_our_own_write_is_one_request(
    connect: Connect, private_etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A node rewriting its own key (saying it leaves a round) keeps the key's lease and
    creation revision: one Txn, no new lease; a lease that is gone is replaced by a new
    one of ``ttl``; a key that is gone is not created."""
    v3 = connect(endpoint_of(private_etcd_server))
    key = f"{etcd_prefix}/ours"
    written = v3.create(key, "v", ttl=7)
    before = read_metrics(private_etcd_server.client_url)
    assert v3.update(key, "w", ttl=7, lease=written.lease).lease == written.lease
    requests = requests_since(private_etcd_server.client_url, before)
    assert requests.by_method == {"v3 Txn": 1}, requests.describe()
    current = v3.get(key)
    assert (current.value, current.lease) == ("w", written.lease)
    assert current.created_index == written.created_index
    gateway(private_etcd_server, "/v3/lease/revoke", {"ID": str(written.lease)})  # Key and all.
    with pytest.raises(KeyNotFoundError):
        v3.update(key, "x", ttl=7, lease=written.lease)
    assert v3.try_get(key) is None
    v3.set(key, "y", ttl=60)
    fresh = v3.update(key, "z", ttl=7, lease=written.lease).lease  # Our lease is gone.
    assert fresh not in (0, written.lease)
    assert v3.get(key).lease == fresh
    assert v3.time_to_live(v3.get(key)) in range(5, 8)


def test_a_directory_lease_reaches_every_key_written_below_it(
    v3: EtcdV3Connection, connect: Connect, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    run = f"{etcd_prefix}/run/"  # the legacy backend passes directories with a slash
    assert v3.mkdir(run, ttl=2) is True
    v3.set(f"{run}state", "s")
    other = connect(endpoint_of(etcd_server))
    assert other.mkdir(run.rstrip("/"), ttl=2) is False  # exists: its lease is adopted
    other.create(f"{run}store/k", "v")
    lease = v3.get(run).lease
    assert lease != 0
    tree = v3.list_dir(run, recursive=True)
    leaves = [c for c in tree.children if not c.is_dir]
    leaves += [g for c in tree.children if c.is_dir for g in c.children]
    assert {leaf.key for leaf in leaves} == {f"{run}state", f"{run}store/k"}
    assert {leaf.lease for leaf in leaves} == {lease}
    assert v3.get(f"{run}store/k").lease == lease
    # Keep-alive of the directory keeps everything; without it, everything goes.
    # A key of a 3 s lease granted after the run's 2 s one lapses first, but for the
    # refreshes.
    v3.set(f"{etcd_prefix}/control", "c", ttl=3)

    def control_lapsed_while_refreshing() -> bool:
        v3.refresh(run, 2)
        return v3.try_get(f"{etcd_prefix}/control") is None

    wait_until(control_lapsed_while_refreshing, 10, "the 3 s lease of the control key")
    assert v3.get(f"{run}store/k").value == "v"
    wait_until(lambda: v3.try_get(run) is None, 6, "the run's lease to lapse")
    assert v3.try_get(f"{run}state") is None
    assert v3.try_get(f"{run}store/k") is None


def test_writes_below_a_directory_whose_lease_was_revoked_still_land(
    v3: EtcdV3Connection, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    run = f"{etcd_prefix}/run"
    v3.mkdir(run, ttl=60)
    gateway(etcd_server, "/v3/lease/revoke", {"ID": str(v3.get(run).lease)})
    node = v3.set(f"{run}/k", "v")  # lease gone: written without it, not lost
    assert v3.get(f"{run}/k").value == "v"
    assert node.lease == 0


def test_mkdir_and_create_are_create_if_absent(v3: EtcdV3Connection, etcd_prefix: str) -> None:
    assert v3.mkdir(f"{etcd_prefix}/d") is True
    assert v3.mkdir(f"{etcd_prefix}/d") is False
    v3.create(f"{etcd_prefix}/d/k", "1")
    with pytest.raises(KeyExistsError):
        v3.create(f"{etcd_prefix}/d/k", "2")
    node = v3.list_dir(f"{etcd_prefix}/d")
    assert node.is_dir
    assert [(c.key, c.value) for c in node.children] == [(f"{etcd_prefix}/d/k", "1")]


def test_a_directory_read_shows_subdirectories_as_v2_does(
    v3: EtcdV3Connection, etcd_prefix: str
) -> None:
    v3.mkdir(f"{etcd_prefix}/a")
    v3.mkdir(f"{etcd_prefix}/a/sub")
    v3.set(f"{etcd_prefix}/a/sub/x", "1")
    v3.set(f"{etcd_prefix}/a/y", "2")
    v3.set(f"{etcd_prefix}/a-sibling", "not below a")
    flat = v3.list_dir(f"{etcd_prefix}/a")
    assert [(c.key.rsplit("/", 1)[1], c.is_dir, c.children) for c in flat.children] == [
        ("sub", True, ()),
        ("y", False, ()),
    ]
    deep = v3.list_dir(f"{etcd_prefix}/a", recursive=True)
    assert [g.value for g in deep.children[0].children] == ["1"]


def test_recursive_delete_takes_the_directory_and_nothing_beside_it(
    v3: EtcdV3Connection, etcd_prefix: str
) -> None:
    v3.mkdir(f"{etcd_prefix}/d")
    v3.set(f"{etcd_prefix}/d/k", "1")
    v3.set(f"{etcd_prefix}/d0", "neighbour")
    assert v3.delete(f"{etcd_prefix}/d", recursive=True) is True
    assert v3.try_get(f"{etcd_prefix}/d") is None
    assert v3.get(f"{etcd_prefix}/d0").value == "neighbour"
    assert v3.delete(f"{etcd_prefix}/d", recursive=True) is False


# -- watches -----------------------------------------------------------------------------


def test_watch_from_a_compacted_revision_returns_none_promptly(
    v3: EtcdV3Connection, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/k"
    first = v3.set(key, "1")
    latest = v3.set(key, "2")
    gateway(etcd_server, "/v3/kv/compaction", {"revision": str(latest.modified_index)})
    started = time.monotonic()
    assert v3.watch(key, first.modified_index, Deadline(10)) is None
    assert time.monotonic() - started < 2
    # From a revision that is still there, the history is replayed.
    change = v3.watch(key, latest.modified_index, Deadline(5))
    assert change is not None
    assert change.value == "2"


def test_watch_sees_a_deletion_and_a_lapsed_lease(v3: EtcdV3Connection, etcd_prefix: str) -> None:
    key = f"{etcd_prefix}/k"
    node = v3.set(key, "v", ttl=1)
    change = v3.watch(key, node.modified_index + 1, Deadline(5))
    assert change is not None
    assert (change.action, change.value) == ("delete", None)


def test_close_wakes_a_blocked_watch(
    etcd_proxy: FaultProxy, connect: Connect, etcd_prefix: str
) -> None:
    v3 = connect(etcd_proxy.endpoint)
    result: list[Any] = []

    def wait() -> None:
        try:
            result.append(
                v3.watch(
                    f"{etcd_prefix}/never",
                    v3.set(f"{etcd_prefix}/x", "1").etcd_index + 1,
                    Deadline(30),
                )
            )
        except TransportClosedError as exc:
            result.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    etcd_proxy.wait_for_requests(1, 5, where=lambda request: request.path == "/v3/watch")
    started = time.monotonic()
    v3.close()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - started < 2
    assert isinstance(result[0], TransportClosedError)


# -- auth and TLS ------------------------------------------------------------------------


@pytest.fixture
def auth_server(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """An etcd with auth enabled (user ``root``, password ``secret``) whose tokens
    expire after 1 s."""
    with EtcdServer(
        etcd_binary=etcd_server.binary,
        enable_v2=etcd_server.enable_v2,
        extra_args=["--auth-token-ttl=1"],
    ) as server:
        gateway(server, "/v3/auth/role/add", {"name": "root"})
        gateway(server, "/v3/auth/user/add", {"name": "root", "password": "secret"})
        gateway(server, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        gateway(server, "/v3/auth/enable", {})
        yield server


def test_a_wrong_password_is_a_clear_error_within_two_seconds(
    auth_server: EtcdServer, connect: Connect
) -> None:
    conn = connect(endpoint_of(auth_server), username="root", password="wrong", read_timeout=30)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        conn.get("/k")
    assert time.monotonic() - started < 2
    assert "'root'" in str(info.value)
    assert "password" in str(info.value)
    assert auth_server.client_url in str(info.value)


def _authentications(proxy: FaultProxy) -> int:
    """How many times the client authenticated through ``proxy``."""
    return sum(request.path == "/v3/auth/authenticate" for request in proxy.requests)


def test_an_expired_token_is_renewed_without_the_caller_noticing(
    auth_server: EtcdServer, connect: Connect, fault_proxy_factory: Callable[..., FaultProxy]
) -> None:
    proxy = fault_proxy_factory(auth_server.get_host(), auth_server.get_port())
    conn = connect(proxy.endpoint, username="root", password="secret")
    first = conn.set("/k", "1")
    assert _authentications(proxy) == 1
    # The server's token TTL is 1 s. Nothing shows that the token expired without using
    # it, and any request with it renews its TTL: the wait itself is what is tested.
    time.sleep(2.5)
    watch = conn.watch("/k", first.modified_index, Deadline(5))
    assert watch is not None
    assert conn.compare_and_swap("/k", "2", conn.get("/k")).value == "2"
    assert _authentications(proxy) == 2  # once more, for the expired token


def test_a_watch_stream_reopened_with_a_stale_token_renews_it(
    auth_server: EtcdServer, connect: Connect, fault_proxy_factory: Callable[..., FaultProxy]
) -> None:
    proxy = fault_proxy_factory(auth_server.get_host(), auth_server.get_port())
    conn = connect(proxy.endpoint, username="root", password="secret")
    writer = connect(endpoint_of(auth_server), username="root", password="secret")
    first = conn.set("/s", "1")
    stream = conn.watch_stream("/s", first.modified_index)
    change = stream.next(Deadline(5))
    assert change is not None
    assert change.value == "1"
    authenticated = _authentications(proxy)
    # The stream breaks; meanwhile etcd drops root's tokens (a password change does).
    proxy.refuse()
    root = gateway(auth_server, "/v3/auth/authenticate", {"name": "root", "password": "secret"})
    password = {"name": "root", "password": "secret"}
    gateway(auth_server, "/v3/auth/user/changepw", password, token=root["token"])
    writer.set("/s", "2")
    proxy.forward()
    change = stream.next(Deadline(10))
    assert change is not None
    assert change.value == "2"
    assert _authentications(proxy) > authenticated  # a fresh token for the reopened stream
    stream.close()


def test_without_credentials_auth_is_refused_clearly(
    auth_server: EtcdServer, connect: Connect
) -> None:
    conn = connect(endpoint_of(auth_server))
    with pytest.raises(RendezvousConnectionError, match="username"):
        conn.set("/k", "v")


def test_client_certificates(
    tls_etcd_server: EtcdServer, tls_certs: dict[str, str], connect: Connect
) -> None:
    conn = connect(
        endpoint_of(tls_etcd_server),
        protocol="https",
        cacert=tls_certs["ca.crt"],
        cert=tls_certs["node.crt"],
        key=tls_certs["node.key"],
    )
    node = conn.set("/tls/k", "v", ttl=5)
    conn.refresh("/tls/k", 5)
    assert conn.get("/tls/k").value == "v"
    assert conn.watch("/tls/k", node.modified_index, Deadline(5)) is not None
    without = connect(endpoint_of(tls_etcd_server), protocol="https", cacert=tls_certs["ca.crt"])
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"TLS|cert"):
        without.get("/tls/k")
    assert time.monotonic() - started < 3


# -- outages -----------------------------------------------------------------------------


def test_an_operation_rides_out_an_eight_second_sigstop(
    private_etcd_server: EtcdServer, connect: Connect
) -> None:
    conn = connect(endpoint_of(private_etcd_server), read_timeout=30)
    prev = conn.set("/k", "0")
    private_etcd_server.suspend()
    timer = threading.Timer(8, private_etcd_server.resume)
    timer.start()
    try:
        node = conn.compare_and_swap("/k", "1", prev)
    finally:
        timer.cancel()
        if private_etcd_server.suspended:
            private_etcd_server.resume()
    assert node.value == "1"
    assert conn.get("/k").value == "1"


def test_a_refused_port_fails_within_the_callers_deadline(connect: Connect) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conn = connect(("127.0.0.1", port), read_timeout=60)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        conn.get("/k", deadline=Deadline(1.0))
    assert time.monotonic() - started < 3
    assert f"127.0.0.1:{port}" in str(info.value)


def test_values_and_keys_are_stored_as_v2_would(
    v3: EtcdV3Connection, etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/état"
    v3.set(key, '{"status": "final"}')
    raw = gateway(etcd_server, "/v3/kv/range", {"key": b64(key)})
    assert raw["kvs"][0]["value"] == b64('{"status": "final"}')
