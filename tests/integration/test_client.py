"""Real-failure tests of the transport layer: the contract both transports keep.

Every test that opens a connection runs once per transport: :class:`EtcdConnection`
(v2, only where the server serves v2) and :class:`EtcdV3Connection` (v3, always: etcd
3.4+ serves the v3 gateway with or without v2). Everything runs against real etcd
processes. Faults are injected for real: lost responses and refused or reset
connections through :class:`faultproxy.FaultProxy`, closed ports, SIGKILL/SIGSTOP of a
private etcd, TLS mismatches, wrong-type keys. What only v3 does (leases, compaction,
auth tokens) is in ``test_transport_v3.py``.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from etcd_rendezvous._transport.interface import (
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    OperationRefusedError,
    Transport,
)
from etcd_rendezvous.api import Deadline, RendezvousConnectionError, RendezvousStateError
from etcd_rendezvous.etcd_server import EtcdServer
from support.faultproxy import FaultProxy, Mode
from support.history import forget_history
from support.net import closed_ports
from support.processes import process_state
from support.transports import Connect, only_v2
from support.wait import wait_until

#: Short timeouts (read 2 s, connect 1 s) so that failures are quick.
pytestmark = pytest.mark.connect_defaults(read_timeout=2.0, connect_timeout=1.0)

#: The action a v3 watch reports for a change v2 reports as the key's action.
_V3_ACTION = {
    "set": "set",
    "create": "create",
    "compareAndSwap": "set",
    "delete": "delete",
    "compareAndDelete": "delete",
    "expire": "delete",
}


# -- helpers -----------------------------------------------------------------------------


def url(endpoint: tuple[str, int], protocol: str = "http") -> str:
    return f"{protocol}://{endpoint[0]}:{endpoint[1]}"


def history(conn: Transport, key: str, after: int) -> list[tuple[str, str | None]]:
    """``(action, value)`` of every change of ``key`` after etcd index ``after``, read
    from etcd's event history up to the key's current state."""
    final = conn.get(key).modified_index
    changes: list[tuple[str, str | None]] = []
    index = after
    while index < final:
        change = conn.watch(key, index + 1, Deadline(5))
        assert change is not None, f"no change of {key} after index {index}"
        changes.append((change.action, change.value))
        index = change.modified_index
    return changes


def changes(api: str, *expected: tuple[str, str | None]) -> list[tuple[str, str | None]]:
    """``expected`` changes (in v2's action names) as :func:`history` reads them on ``api``."""
    if api == "v2":
        return list(expected)
    return [(_V3_ACTION[action], value) for action, value in expected]


def message_without(exc: BaseException, key: str) -> str:
    """The error message with ``key`` cut out (keys contain test names, which contain
    words such as "protocol" that a test looks for)."""
    return str(exc).replace(key, "<key>")


#: The requests that write, per API: v2 writes are PUT/DELETE on ``/v2/keys``; v3
#: writes are POSTs to these paths (a watch or a read is a POST too, so not by method).
_V3_WRITES = frozenset({"/v3/kv/txn", "/v3/kv/put", "/v3/kv/deleterange", "/v3/lease/grant"})


def writes(proxy: FaultProxy, api: str) -> int:
    """How many write requests reached the server through ``proxy``."""
    if api == "v2":
        return sum(
            1
            for r in proxy.requests
            if r.method in ("PUT", "DELETE") and r.path.startswith("/v2/keys/")
        )
    return sum(1 for r in proxy.requests if r.method == "POST" and r.path in _V3_WRITES)


@pytest.fixture
def direct(etcd_server: EtcdServer, connect: Connect) -> Transport:
    """A connection straight to ``etcd_server``: "another writer", and the test's eyes."""
    return connect((etcd_server.get_host(), etcd_server.get_port()))


# -- the fault proxy itself --------------------------------------------------------------


def test_proxy_forwards_and_counts_requests(
    etcd_proxy: FaultProxy, connect: Connect, api: str, key: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    conn.set(key, "v")
    assert conn.get(key).value == "v"
    requests = etcd_proxy.wait_for_requests(2, timeout=5)
    expected = {
        "v2": [("PUT", f"/v2/keys{key}"), ("GET", f"/v2/keys{key}")],
        "v3": [("POST", "/v3/kv/put"), ("POST", "/v3/kv/range")],
    }
    assert [(r.method, r.path) for r in requests] == expected[api]
    assert writes(etcd_proxy, api) == 1
    assert etcd_proxy.mode is Mode.FORWARD


def http_get(endpoint: tuple[str, int], path: str) -> bytes:
    """A raw one-shot HTTP GET; returns everything the server sent."""
    with socket.create_connection(endpoint, timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_proxy_refuse_closes_the_port_and_forward_reopens_it(etcd_proxy: FaultProxy) -> None:
    port = etcd_proxy.port
    etcd_proxy.refuse()
    assert etcd_proxy.mode is Mode.REFUSE
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(etcd_proxy.endpoint, timeout=5).close()
    etcd_proxy.forward()
    assert etcd_proxy.port == port
    assert b"etcdserver" in http_get(etcd_proxy.endpoint, "/version")


def test_proxy_reset_resets_open_and_new_connections(etcd_proxy: FaultProxy) -> None:
    with socket.create_connection(etcd_proxy.endpoint, timeout=5) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"etcdserver" in sock.recv(65536)  # the connection is established
        etcd_proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.recv(65536)
    # A new connection is reset as soon as it is accepted: at connect() or first read.
    with (
        pytest.raises(ConnectionResetError),
        socket.create_connection(etcd_proxy.endpoint, timeout=5) as sock,
    ):
        sock.recv(65536)


def test_proxy_drop_responses_holds_the_client(etcd_proxy: FaultProxy) -> None:
    etcd_proxy.drop_responses(count=1)
    with socket.create_connection(etcd_proxy.endpoint, timeout=0.3) as sock:
        sock.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        etcd_proxy.wait_for_dropped(1, timeout=5)
        with pytest.raises(socket.timeout):
            sock.recv(65536)
    # One response only: the next connection is served again.
    assert etcd_proxy.mode is Mode.FORWARD
    assert b"etcdserver" in http_get(etcd_proxy.endpoint, "/version")


# -- 1. an ambiguous conditional write is recognised as ours ------------------------------


def test_cas_on_an_index_compares_the_index_alone(direct: Transport, key: str) -> None:
    prev = direct.set(key, "v0")
    node = direct.compare_and_swap(key, "v1", prev.modified_index)
    assert (node.value, direct.get(key).value) == ("v1", "v1")
    with pytest.raises(CompareFailedError):
        direct.compare_and_swap(key, "v2", prev.modified_index)  # the key moved on
    assert direct.get(key).value == "v1"


def test_cas_whose_response_was_lost_is_recognised_as_ours(
    etcd_proxy: FaultProxy, connect: Connect, key: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "v0")
    etcd_proxy.clear_stats()
    # etcd applies the swap; the client sees the connection close without an answer,
    # sends the swap again and gets "compare failed" from the copy.
    etcd_proxy.drop_responses(count=1, close_client=True)

    node = conn.compare_and_swap(key, "ours", prev)

    assert node.value == "ours"
    assert etcd_proxy.dropped_responses == 1
    assert writes(etcd_proxy, api) == 2  # the lost one and our re-send
    assert history(conn, key, prev.modified_index) == changes(api, ("compareAndSwap", "ours"))
    assert node.modified_index == conn.get(key).modified_index


def test_cas_whose_response_timed_out_is_recognised_as_ours(
    etcd_proxy: FaultProxy, connect: Connect, key: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint, read_timeout=0.5)
    prev = conn.set(key, "v0")
    # The client socket is held open: the client sees a read timeout after etcd
    # applied the swap.
    etcd_proxy.drop_responses(count=1)

    node = conn.compare_and_swap(key, "ours", prev)

    assert node.value == "ours"
    assert history(conn, key, prev.modified_index) == changes(api, ("compareAndSwap", "ours"))


def test_cas_applied_then_overwritten_before_the_resend_is_still_ours(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "v0")
    # While the client is in the dark, another writer builds on our swap.
    etcd_proxy.drop_responses(count=1, close_client=True, on_drop=lambda: direct.set(key, "theirs"))

    node = conn.compare_and_swap(key, "ours", prev)

    assert etcd_proxy.hook_errors == []
    assert node.value == "ours"
    assert history(conn, key, prev.modified_index) == changes(
        api, ("compareAndSwap", "ours"), ("set", "theirs")
    )


def test_cas_lost_after_another_writer_won_raises_compare_failed(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "v0")
    direct.set(key, "theirs")  # the first change after prev is not ours
    etcd_proxy.clear_stats()
    etcd_proxy.drop_responses(count=1, close_client=True)

    with pytest.raises(CompareFailedError) as excinfo:
        conn.compare_and_swap(key, "ours", prev)

    assert excinfo.value.key == key
    assert not excinfo.value.outcome_unknown  # the first change after prev is not ours
    assert etcd_proxy.dropped_responses == 1  # so the outcome was ambiguous
    assert writes(etcd_proxy, api) == 2
    assert history(conn, key, prev.modified_index) == changes(api, ("set", "theirs"))


def test_cas_lost_whose_history_is_gone_is_refused_with_outcome_unknown(
    etcd_server: EtcdServer,
    etcd_proxy: FaultProxy,
    connect: Connect,
    direct: Transport,
    key: str,
    api: str,
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "v0")
    # While the client is in the dark, etcd forgets the change that would tell whether
    # the lost copy applied (other keys' writes push it out of its history).
    filler = f"{key}-filler"
    etcd_proxy.drop_responses(
        count=1,
        close_client=True,
        on_drop=lambda: forget_history(direct, etcd_server.client_url, filler),
    )

    with pytest.raises(CompareFailedError) as excinfo:
        conn.compare_and_swap(key, "ours", prev)

    assert etcd_proxy.hook_errors == []
    assert excinfo.value.outcome_unknown
    assert "no longer holds" in excinfo.value.unknown_because
    assert direct.get(key).value == "ours"  # it was applied: etcd could not tell


def test_create_whose_response_was_lost_is_recognised_as_ours(
    etcd_proxy: FaultProxy, connect: Connect, etcd_prefix: str, key: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    before = conn.set(f"{etcd_prefix}/marker", "m")
    etcd_proxy.clear_stats()
    etcd_proxy.drop_responses(count=1, close_client=True)

    node = conn.create(key, "ours")

    assert node.value == "ours"
    assert writes(etcd_proxy, api) == 2
    assert history(conn, key, before.modified_index) == changes(api, ("create", "ours"))


def test_create_lost_after_another_writer_created_the_key_raises_key_exists(
    etcd_proxy: FaultProxy,
    connect: Connect,
    direct: Transport,
    etcd_prefix: str,
    key: str,
    api: str,
) -> None:
    conn = connect(etcd_proxy.endpoint)
    before = conn.set(f"{etcd_prefix}/marker", "m")
    direct.create(key, "theirs")
    etcd_proxy.drop_responses(count=1, close_client=True)

    with pytest.raises(KeyExistsError):
        conn.create(key, "ours")

    assert etcd_proxy.dropped_responses == 1
    assert history(conn, key, before.modified_index) == changes(api, ("create", "theirs"))


@pytest.mark.usefixtures("cleared_history")
def test_create_on_a_fresh_connection_is_recognised_after_history_was_cleared(
    etcd_proxy: FaultProxy, connect: Connect, key: str
) -> None:
    conn = connect(etcd_proxy.endpoint)  # has not read anything: last_index == 0
    etcd_proxy.drop_responses(count=1, close_client=True)

    node = conn.create(key, "ours")

    assert node.value == "ours"


def test_compare_and_delete_whose_response_was_lost_returns_true(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "v0")
    etcd_proxy.drop_responses(count=1, close_client=True)

    assert conn.compare_and_delete(key, prev) is True

    assert etcd_proxy.dropped_responses == 1
    assert direct.try_get(key) is None


def test_many_compare_and_deletes_of_a_large_value_at_once_have_one_winner(
    etcd_server: EtcdServer, connect: Connect, direct: Transport, key: str
) -> None:
    """As when every worker waiting on a final state of 64 workers sees the same
    keep-alive key lapse: etcd 3.5 reset the connections of v2 DELETEs carrying the ~7 KB
    value as a condition (in the URL), so all but the winner failed as unreachable."""
    prev = direct.set(key, "x" * 7000)
    endpoint = (etcd_server.get_host(), etcd_server.get_port())
    conns = [connect(endpoint) for _ in range(64)]
    start = threading.Barrier(len(conns))
    results: list[object] = []

    def delete(conn: Transport) -> None:
        start.wait()
        try:
            results.append(conn.compare_and_delete(key, prev))
        except RendezvousConnectionError as exc:
            results.append(exc)

    threads = [threading.Thread(target=delete, args=(conn,)) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(map(str, results)) == ["False"] * 63 + ["True"]
    assert direct.try_get(key) is None


# -- 2. no silent re-sends ---------------------------------------------------------------


@pytest.mark.parametrize("close_client", [False, True], ids=["read-timeout", "connection-closed"])
def test_every_send_of_a_cas_is_one_our_code_decided(
    etcd_proxy: FaultProxy,
    connect: Connect,
    direct: Transport,
    key: str,
    caplog: pytest.LogCaptureFixture,
    close_client: bool,
    api: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="etcd_rendezvous._transport.endpoints")
    conn = connect(etcd_proxy.endpoint, read_timeout=0.5)
    prev = conn.set(key, "v0")
    etcd_proxy.clear_stats()
    caplog.clear()
    etcd_proxy.drop_responses(close_client=close_client)  # every answer is lost

    with pytest.raises(RendezvousConnectionError, match=re.escape(url(etcd_proxy.endpoint))):
        conn.compare_and_swap(key, "ours", prev)

    # Each re-send is one our retry loop logged; urllib3 added none.
    retries = sum(
        r.getMessage().endswith("; retrying")
        for r in caplog.records
        if r.name == "etcd_rendezvous._transport.endpoints"
    )
    assert writes(etcd_proxy, api) == 1 + retries
    if close_client:
        assert retries >= 1  # a fast failure is re-sent within the budget
    assert direct.get(key).value == "ours"  # the first copy was applied


# -- 3. failover -------------------------------------------------------------------------


def test_failover_past_a_closed_port(etcd_server: EtcdServer, connect: Connect, key: str) -> None:
    (dead,) = closed_ports(1)
    conn = connect(("127.0.0.1", dead), (etcd_server.get_host(), etcd_server.get_port()))
    started = time.monotonic()
    conn.set(key, "v")
    assert conn.get(key).value == "v"
    assert time.monotonic() - started < 1.0


def test_all_endpoints_down_names_each_endpoint(connect: Connect, key: str) -> None:
    endpoints = [("127.0.0.1", port) for port in closed_ports(2)]
    conn = connect(*endpoints, read_timeout=0.5)
    operations: list[Callable[[], object]] = [lambda: conn.get(key), lambda: conn.set(key, "v")]
    for operation in operations:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as excinfo:
            operation()
        elapsed = time.monotonic() - started
        assert 0.4 <= elapsed < 1.5
        message = str(excinfo.value)
        assert repr(key) in message
        for endpoint in endpoints:
            assert url(endpoint) in message


def test_failover_past_a_hung_endpoint(
    etcd_server: EtcdServer, etcd_proxy: FaultProxy, connect: Connect, key: str
) -> None:
    etcd_proxy.drop_responses()  # accepts and reads requests, never answers
    healthy = (etcd_server.get_host(), etcd_server.get_port())
    conn = connect(etcd_proxy.endpoint, healthy, read_timeout=0.5)
    assert conn.set(key, "v").value == "v"


# -- 4. recovery after every endpoint was down -------------------------------------------


def test_round_robin_failover_recovers_after_all_endpoints_were_down(
    etcd_server: EtcdServer,
    fault_proxy_factory: Callable[..., FaultProxy],
    connect: Connect,
    key: str,
    api: str,
) -> None:
    a = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    b = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    conn = connect(a.endpoint, b.endpoint, read_timeout=0.5)
    conn.set(key, "1")

    a.refuse()
    b.refuse()
    with pytest.raises(RendezvousConnectionError) as excinfo:
        conn.get(key)
    assert url(a.endpoint) in str(excinfo.value)
    assert url(b.endpoint) in str(excinfo.value)

    b.forward()
    assert conn.get(key).value == "1"
    assert b.request_count >= 1

    b.refuse()
    a.forward()
    a.clear_stats()
    assert conn.set(key, "2").value == "2"
    assert writes(a, api) == 1


def test_same_connection_works_after_etcd_was_killed_and_restarted(
    private_etcd_server: EtcdServer, connect: Connect, key: str
) -> None:
    server = private_etcd_server
    port = server.get_port()
    conn = connect((server.get_host(), port), read_timeout=0.5)
    conn.set(key, "v")

    server.kill()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=re.escape(server.client_url)):
        conn.get(key)
    assert time.monotonic() - started < 1.5

    server.restart()
    assert server.get_port() == port
    assert conn.get(key).value == "v"
    assert conn.set(key, "w").value == "w"


# -- 5. a hung (SIGSTOPped) etcd ---------------------------------------------------------


def test_suspended_etcd_times_out_in_bounded_time_then_recovers(
    private_etcd_server: EtcdServer, connect: Connect, key: str
) -> None:
    server = private_etcd_server
    conn = connect((server.get_host(), server.get_port()), read_timeout=0.5, connect_timeout=0.5)
    conn.set(key, "v")

    server.suspend()
    try:
        wait_until(lambda: process_state(server.pid) == "T", what="etcd to be stopped")
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=re.escape(server.client_url)):
            conn.get(key)
        assert time.monotonic() - started < 1.5
    finally:
        server.resume()

    assert conn.get(key).value == "v"


# -- 6. TLS ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(etcd_server: EtcdServer, tls_certs: dict[str, str]) -> Iterator[EtcdServer]:
    with EtcdServer(
        etcd_binary=etcd_server.binary,
        cert_file=tls_certs["node.crt"],
        key_file=tls_certs["node.key"],
        enable_v2=etcd_server.enable_v2,
    ) as server:
        yield server


def tls_endpoint(server: EtcdServer) -> tuple[str, int]:
    return (server.get_host(), server.get_port())


def test_https_with_the_right_ca_works(
    tls_server: EtcdServer, tls_certs: dict[str, str], connect: Connect, key: str
) -> None:
    conn = connect(tls_endpoint(tls_server), protocol="https", cacert=tls_certs["ca.crt"])
    assert conn.set(key, "v").value == "v"
    assert conn.get(key).value == "v"


def test_https_without_the_ca_fails_fast_naming_endpoint_and_cacert(
    tls_server: EtcdServer, connect: Connect, key: str
) -> None:
    conn = connect(tls_endpoint(tls_server), protocol="https", read_timeout=5)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as excinfo:
        conn.get(key)
    assert time.monotonic() - started < 2  # not retried: retrying cannot help
    message = message_without(excinfo.value, key)
    assert url(tls_endpoint(tls_server), "https") in message
    assert "cacert" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message


def test_https_to_a_plain_http_endpoint_fails_fast_hinting_at_protocol(
    etcd_server: EtcdServer, tls_certs: dict[str, str], connect: Connect, key: str
) -> None:
    endpoint = (etcd_server.get_host(), etcd_server.get_port())
    conn = connect(endpoint, protocol="https", cacert=tls_certs["ca.crt"], read_timeout=5)
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as excinfo:
        conn.set(key, "v")
    assert time.monotonic() - started < 2
    message = message_without(excinfo.value, key)
    assert url(endpoint, "https") in message
    assert re.search(r"\bprotocol\b", message, re.IGNORECASE)


def test_plain_http_to_an_https_endpoint_names_the_endpoint(
    tls_server: EtcdServer, connect: Connect, key: str
) -> None:
    conn = connect(tls_endpoint(tls_server), read_timeout=0.5)
    with pytest.raises(RendezvousConnectionError, match=re.escape(url(tls_endpoint(tls_server)))):
        conn.get(key)


def test_plain_http_to_an_https_endpoint_hints_at_protocol(
    tls_server: EtcdServer, connect: Connect, key: str
) -> None:
    conn = connect(tls_endpoint(tls_server), read_timeout=0.5)
    with pytest.raises(RendezvousConnectionError) as excinfo:
        conn.get(key)
    assert re.search(r"\bprotocol\b", message_without(excinfo.value, key), re.IGNORECASE)


# -- 7. TTL refresh: a directory's on etcd 3.4 vs 3.5 (v2), a key's -----------------------


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


@only_v2
def test_directory_ttl_refresh_works_on_34_and_is_refused_on_35(
    etcd_proxy: FaultProxy, connect: Connect, etcd_prefix: str, api: str
) -> None:
    conn = connect(etcd_proxy.endpoint)
    directory = f"{etcd_prefix}/dir"
    assert conn.mkdir(directory, ttl=30)
    etcd_proxy.clear_stats()

    if version_tuple(conn.server_version()) >= (3, 5):
        assert not conn.can_refresh_directory_ttl()
        with pytest.raises(OperationRefusedError, match=re.escape(repr(directory))):
            conn.refresh(directory, 60)
        assert writes(etcd_proxy, api) == 1  # a permanent refusal is not retried
    else:
        assert conn.can_refresh_directory_ttl()
        node = conn.refresh(directory, 60)
        assert node.is_dir
        assert node.ttl is not None
        assert 50 < node.ttl <= 60


def test_directory_ttl_refresh_keeps_the_directory_and_what_is_below_it(
    direct: Transport, etcd_prefix: str
) -> None:
    """Where :meth:`can_refresh_directory_ttl` says so (always on v3: the directory's
    TTL is a lease), a refresh puts the directory's TTL back to its full length."""
    if not direct.can_refresh_directory_ttl():
        pytest.skip(f"etcd {direct.server_version()} cannot refresh a directory's v2 TTL")
    directory = f"{etcd_prefix}/dir"
    assert direct.mkdir(directory, ttl=10)
    direct.set(f"{directory}/k", "v")
    full = direct.time_to_live(direct.get(directory))
    assert full is not None
    assert 8 <= full <= 10
    ran_down: list[int] = []

    def lower() -> bool:
        ran_down[:] = [direct.time_to_live(direct.get(directory)) or full]
        return ran_down[0] < full

    wait_until(lower, what="the directory's TTL to run down")
    direct.refresh(directory, 10)
    refreshed = direct.time_to_live(direct.get(directory))
    assert refreshed is not None
    assert ran_down[0] < refreshed <= 10
    assert direct.get(f"{directory}/k").value == "v"


def test_file_ttl_refresh_keeps_the_value(direct: Transport, key: str) -> None:
    written = direct.set(key, "v", ttl=30)
    direct.refresh(key, 60)
    node = direct.get(key)
    assert node.value == "v"
    ttl = direct.time_to_live(node)
    assert ttl is not None
    assert 50 < ttl <= 60
    assert node.created_index == written.created_index


def test_ttl_refresh_does_not_wake_watchers(direct: Transport, key: str) -> None:
    written = direct.set(key, "v", ttl=30)
    direct.refresh(key, 30)
    assert direct.watch(key, written.modified_index + 1, Deadline(0.3)) is None
    assert direct.get(key).value == "v"


def test_compare_and_refresh_refreshes_only_the_value_compared(direct: Transport, key: str) -> None:
    def ttl() -> int | None:
        return direct.time_to_live(direct.get(key))

    direct.set(key, "mine", ttl=30)
    with pytest.raises(CompareFailedError):
        direct.compare_and_refresh(key, "theirs", 60)
    assert 0 < (ttl() or 0) <= 30
    direct.compare_and_refresh(key, "mine", 60)  # (On v3, a longer TTL: a new lease.)
    assert 50 < (ttl() or 0) <= 60
    direct.set(key, "mine")  # No TTL: one is attached only to the value compared.
    with pytest.raises(CompareFailedError):
        direct.compare_and_refresh(key, "theirs", 30)
    assert ttl() is None
    direct.compare_and_refresh(key, "mine", 30)
    assert 0 < (ttl() or 0) <= 30
    assert direct.get(key).value == "mine"
    with pytest.raises(KeyNotFoundError):
        direct.compare_and_refresh(f"{key}-gone", "mine", 30)


# -- 8. watches --------------------------------------------------------------------------


def test_watch_returns_none_promptly_on_timeout(direct: Transport, key: str) -> None:
    node = direct.set(key, "v")
    started = time.monotonic()
    assert direct.watch(key, node.modified_index + 1, Deadline(0.3)) is None
    assert 0.25 <= time.monotonic() - started < 1.3


def test_watch_returns_a_change_made_by_another_thread(
    direct: Transport, connect: Connect, etcd_server: EtcdServer, key: str
) -> None:
    node = direct.set(key, "before")
    writer_conn = connect((etcd_server.get_host(), etcd_server.get_port()))
    # Watching from the next index catches the write whether it lands before or
    # after the watch request reaches etcd.
    writer = threading.Thread(
        target=writer_conn.set, args=(key, "after"), name="test-writer", daemon=True
    )
    writer.start()
    change = direct.watch(key, node.modified_index + 1, Deadline(10))
    writer.join(10)
    assert change is not None
    assert (change.action, change.value) == ("set", "after")
    assert change.modified_index > node.modified_index


def test_recursive_watch_sees_a_child_change(direct: Transport, etcd_prefix: str, key: str) -> None:
    marker = direct.set(f"{etcd_prefix}/marker", "m")
    child = f"{etcd_prefix}/dir/child"
    direct.set(child, "c")
    change = direct.watch(
        f"{etcd_prefix}/dir", marker.modified_index + 1, Deadline(10), recursive=True
    )
    assert change is not None
    assert (change.key, change.value) == (child, "c")


def test_recursive_watch_ignores_a_sibling_whose_name_starts_alike(
    direct: Transport, etcd_prefix: str
) -> None:
    marker = direct.set(f"{etcd_prefix}/marker", "m")
    direct.set(f"{etcd_prefix}/dir-sibling", "s")
    direct.set(f"{etcd_prefix}/dirsibling/x", "s")
    child = direct.set(f"{etcd_prefix}/dir/child", "c")
    change = direct.watch(
        f"{etcd_prefix}/dir", marker.modified_index + 1, Deadline(10), recursive=True
    )
    assert change is not None
    assert (change.key, change.value, change.modified_index) == (
        child.key,
        "c",
        child.modified_index,
    )


@pytest.mark.usefixtures("cleared_history")
def test_watch_from_a_cleared_index_returns_none_promptly(direct: Transport, key: str) -> None:
    direct.set(key, "v")
    started = time.monotonic()
    assert direct.watch(key, 1, Deadline(5)) is None
    assert time.monotonic() - started < 1.0


# -- 9. wrong-type keys (v2: v3 has no directories, only prefixes) ---------------------


@only_v2
def test_writing_below_a_file_is_a_state_error_naming_the_key(
    direct: Transport, etcd_prefix: str
) -> None:
    file_key = f"{etcd_prefix}/file"
    direct.set(file_key, "x")
    child = f"{file_key}/child"
    writes: list[Callable[[], object]] = [
        lambda: direct.set(child, "y"),
        lambda: direct.create(child, "y"),
        lambda: direct.mkdir(child),
    ]
    for write in writes:
        with pytest.raises(RendezvousStateError, match=re.escape(repr(child))):
            write()
    assert direct.get(file_key).value == "x"


@only_v2
def test_writing_a_value_to_a_directory_is_a_state_error_naming_the_key(
    direct: Transport, etcd_prefix: str
) -> None:
    directory = f"{etcd_prefix}/dir"
    direct.mkdir(directory)
    with pytest.raises(RendezvousStateError, match=re.escape(repr(directory))):
        direct.set(directory, "x")
    assert direct.get(directory).is_dir
