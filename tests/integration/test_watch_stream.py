"""The contract of :meth:`Transport.watch_stream` on both transports, against a real etcd.

Every test runs once per transport: :class:`EtcdConnection` (v2, where the server serves
v2) and :class:`EtcdV3Connection` (v3, always). A stream delivers every change of its
key (or below it) from its start index on, in order, none twice; ``None`` when nothing
came in time; :class:`WatchHistoryLostError` when etcd no longer holds the changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from etcd_rendezvous._transport.interface import (
    Node,
    Transport,
    TransportClosedError,
    WatchHistoryLostError,
    WatchStream,
)
from etcd_rendezvous.api import Deadline, RendezvousConnectionError
from etcd_rendezvous.etcd_cluster import EtcdCluster
from etcd_rendezvous.etcd_server import EtcdServer
from support.etcd_requests import counter, read_metrics
from support.faultproxy import FaultProxy
from support.history import forget_history
from support.processes import process_state
from support.threads import InThread
from support.wait import wait_until


@pytest.fixture
def conn(connect: Callable[..., Transport]) -> Transport:
    """The connection that reads the stream."""
    return connect()


@pytest.fixture
def writer(connect: Callable[..., Transport]) -> Transport:
    """Another connection: "another worker" writing the keys watched."""
    return connect()


def deletion(api: str) -> set[str]:
    """The actions a stream may report for a deletion on ``api``."""
    return {"delete"} if api == "v3" else {"delete", "compareAndDelete"}


def watch_requests(api: str, client_url: str) -> float:
    """How many watches the etcd at ``client_url`` has started: v2 store watchers, or
    v3 ``Watch`` gRPC streams (one per ``POST /v3/watch``)."""
    values = read_metrics(client_url)
    if api == "v2":
        return counter(values, "etcd_debugging_store_watch_requests_total")
    return counter(values, "grpc_server_started_total", grpc_method="Watch")


def drain(stream: WatchStream, count: int, timeout: float = 10.0) -> list[Node]:
    """The next ``count`` changes of ``stream``, failing if they take over ``timeout``."""
    deadline = Deadline(timeout)
    changes: list[Node] = []
    while len(changes) < count:
        change = stream.next(deadline)
        if change is None:
            pytest.fail(f"only {len(changes)} of {count} changes came within {timeout}s")
        changes.append(change)
    return changes


# -- delivery ----------------------------------------------------------------------------


def test_watch_stream_delivers_every_change_in_order(
    conn: Transport, writer: Transport, key: str
) -> None:
    first = writer.set(key, "0")
    with conn.watch_stream(key, first.modified_index) as stream:
        assert stream.next_index == first.modified_index
        written = [first] + [writer.set(key, str(i)) for i in range(1, 5)]
        changes = drain(stream, 5)
    assert [c.value for c in changes] == ["0", "1", "2", "3", "4"]
    assert [c.modified_index for c in changes] == [w.modified_index for w in written]
    assert all(c.key == key for c in changes)
    assert all(c.etcd_index >= c.modified_index for c in changes)
    assert stream.next_index == written[-1].modified_index + 1


def test_watch_stream_delivers_all_writes_made_between_two_nexts(
    conn: Transport, writer: Transport, key: str
) -> None:
    start = writer.set(key, "start")
    stream = conn.watch_stream(key, start.modified_index + 1)
    try:
        writer.set(key, "a")
        assert drain(stream, 1)[0].value == "a"
        for value in "bcdefg":
            writer.set(key, value)
        assert [c.value for c in drain(stream, 6)] == list("bcdefg")
        assert stream.next(Deadline(0.2)) is None
    finally:
        stream.close()


def test_watch_stream_waits_for_a_change_made_by_another_thread(
    conn: Transport, writer: Transport, key: str
) -> None:
    start = writer.set(key, "start")
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        thread = threading.Thread(target=writer.set, args=(key, "later"), name="test-writer")
        thread.start()
        change = stream.next(Deadline(10))
        thread.join(10)
    assert change is not None
    assert (change.action, change.value) == ("set", "later")


def test_watch_stream_next_returns_none_promptly_on_timeout(conn: Transport, key: str) -> None:
    start = conn.set(key, "v")
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        started = time.monotonic()
        assert stream.next(Deadline(0.3)) is None
        assert 0.25 <= time.monotonic() - started < 1.3
        assert stream.next_index == start.modified_index + 1


def test_watch_stream_delivers_a_deletion_and_an_expiry(
    api: str, conn: Transport, writer: Transport, key: str
) -> None:
    start = writer.set(key, "v")
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        writer.delete(key)
        deleted = drain(stream, 1)[0]
        writer.set(key, "short-lived", ttl=1)
        created, expired = drain(stream, 2, timeout=15)
    assert (deleted.value, deleted.action in deletion(api)) == (None, True)
    assert created.value == "short-lived"
    assert expired.value is None
    assert expired.action == ("expire" if api == "v2" else "delete")
    assert expired.modified_index > created.modified_index


def test_recursive_watch_stream_delivers_changes_below_and_not_beside(
    conn: Transport, writer: Transport, etcd_prefix: str
) -> None:
    directory = f"{etcd_prefix}/dir"
    start = writer.set(f"{etcd_prefix}/marker", "m")
    with conn.watch_stream(directory, start.modified_index + 1, recursive=True) as stream:
        assert stream.recursive
        writer.set(f"{directory}/a", "1")
        writer.set(f"{etcd_prefix}/dir-sibling", "s")
        writer.set(f"{directory}/sub/b", "2")
        writer.set(f"{etcd_prefix}/dirsibling/x", "s")
        writer.delete(f"{directory}/a")
        changes = drain(stream, 3)
        assert stream.next(Deadline(0.2)) is None
    assert [(c.key, c.value) for c in changes] == [
        (f"{directory}/a", "1"),
        (f"{directory}/sub/b", "2"),
        (f"{directory}/a", None),
    ]


# -- deadlines and lifetimes -------------------------------------------------------------


def test_watch_stream_next_keeps_to_its_deadline(conn: Transport, key: str) -> None:
    start = conn.set(key, "v")
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        started = time.monotonic()
        assert stream.next(Deadline(0.3)) is None
        assert time.monotonic() - started < 1.3


def test_a_closed_watch_stream_refuses_next(conn: Transport, key: str) -> None:
    start = conn.set(key, "v")
    stream = conn.watch_stream(key, start.modified_index)
    stream.close()
    stream.close()
    assert stream.closed
    with pytest.raises(TransportClosedError, match="watch stream"):
        stream.next(Deadline(1))


def test_closing_the_transport_ends_its_watch_streams(
    conn: Transport, writer: Transport, key: str
) -> None:
    start = writer.set(key, "v")
    stream = conn.watch_stream(key, start.modified_index)
    assert drain(stream, 1)[0].value == "v"
    conn.close()
    with pytest.raises(TransportClosedError):
        stream.next(Deadline(1))


# -- lost history ------------------------------------------------------------------------


@pytest.mark.usefixtures("cleared_history")
def test_watch_stream_from_a_forgotten_index_raises_history_lost(conn: Transport, key: str) -> None:
    latest = conn.set(key, "v")
    started = time.monotonic()
    with conn.watch_stream(key, 1) as stream, pytest.raises(WatchHistoryLostError) as info:
        stream.next(Deadline(10))
    assert time.monotonic() - started < 2
    assert info.value.key == key
    assert info.value.index == 1
    assert repr(key) in str(info.value)
    # As the error says: re-read, then stream from the read's index + 1.
    read = conn.get(key)
    assert read.modified_index == latest.modified_index
    with conn.watch_stream(key, read.etcd_index + 1) as stream:
        conn.set(key, "after")
        assert drain(stream, 1)[0].value == "after"


@pytest.mark.usefixtures("cleared_history")
def test_a_stream_that_breaks_after_its_history_was_lost_raises_history_lost(
    api: str,
    connect: Callable[..., Transport],
    writer: Transport,
    etcd_server: EtcdServer,
    fault_proxy_factory: Callable[..., FaultProxy],
    etcd_prefix: str,
    key: str,
) -> None:
    proxy = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    conn = connect(proxy.endpoint, read_timeout=2)
    start = writer.set(key, "0")
    stream = conn.watch_stream(key, start.modified_index)
    assert drain(stream, 1)[0].value == "0"
    writer.set(key, "1")
    assert drain(stream, 1)[0].value == "1"
    # The stream breaks; while it is down, its key changes and etcd forgets.
    proxy.refuse()
    writer.set(key, "2")
    forget_history(writer, etcd_server.client_url, f"{etcd_prefix}/other")
    proxy.forward()
    with pytest.raises(WatchHistoryLostError) as info:
        stream.next(Deadline(10))
    assert info.value.index == stream.next_index
    with pytest.raises(WatchHistoryLostError):
        stream.next(Deadline(1))
    stream.close()


def test_a_watcher_that_gives_up_learns_that_etcd_is_gone(
    connect: Callable[..., Transport],
    writer: Transport,
    etcd_server: EtcdServer,
    fault_proxy_factory: Callable[..., FaultProxy],
    key: str,
) -> None:
    """etcd unreachable: a wait returns ``None`` at its deadline, retrying until then; with
    ``give_up_after`` (an operator's tool with a long deadline), it raises once etcd has
    been unreachable that long, well before its deadline."""
    proxy = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    conn = connect(proxy.endpoint, read_timeout=2)
    start = writer.set(key, "0")
    stream = conn.watch_stream(key, start.modified_index + 1)
    proxy.refuse()
    assert stream.next(Deadline(2)) is None
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        stream.next(Deadline(120), give_up_after=2)
    assert time.monotonic() - started < 60  # (its deadline: 120 s)
    stream.close()


# -- one request for every change --------------------------------------------------------


def test_twenty_changes_over_one_stream_cost_one_watch_request(
    api: str, connect: Callable[..., Transport], private_etcd_server: EtcdServer, key: str
) -> None:
    endpoint = (private_etcd_server.get_host(), private_etcd_server.get_port())
    conn, writer = connect(endpoint), connect(endpoint)
    start = writer.set(key, "start")
    before = watch_requests(api, private_etcd_server.client_url)
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        values = []
        for i in range(20):
            writer.set(key, str(i))
            if i % 5 == 4:
                values += [c.value for c in drain(stream, 5)]
    assert values == [str(i) for i in range(20)]
    assert watch_requests(api, private_etcd_server.client_url) - before == 1


def test_a_stream_from_now_delivers_only_the_changes_after_it_opened(
    conn: Transport, writer: Transport, key: str
) -> None:
    old = writer.set(key, "old")
    with conn.watch_stream(key, 0) as stream:
        assert stream.next_index > old.modified_index
        new = writer.set(key, "new")
        (change,) = drain(stream, 1)
    assert (change.value, change.modified_index) == ("new", new.modified_index)


def test_a_stream_from_now_costs_one_watch_request_while_the_key_changes_fast(
    api: str, connect: Callable[..., Transport], private_etcd_server: EtcdServer, key: str
) -> None:
    """Opened from an index, a v2 stream that etcd's history has moved past answers with
    one change and ends, once per change until it catches up: a key written without
    pause keeps it reopening. From now, it is registered at once."""
    endpoint = (private_etcd_server.get_host(), private_etcd_server.get_port())
    conn, writer = connect(endpoint), connect(endpoint)
    writer.set(key, "0")
    stop = threading.Event()

    def write() -> None:
        for i in range(1, 400):  # bounded: at most a few seconds
            if stop.is_set():
                return
            writer.set(key, str(i))

    burst = threading.Thread(target=write)
    burst.start()
    try:
        # As under load: by the time the stream opens, the key changed a few times more.
        seen = int(conn.get(key).value or "")
        wait_until(lambda: int(conn.get(key).value or "") >= seen + 5, 10, "five more changes")
        before = watch_requests(api, private_etcd_server.client_url)
        with conn.watch_stream(key, 0) as stream:
            read = conn.get(key)
            later = [c for c in drain(stream, 20) if c.modified_index > read.modified_index]
        opened = watch_requests(api, private_etcd_server.client_url) - before
    finally:
        stop.set()
        burst.join()
    assert later, "no change after the read came over the stream"
    first = int(later[0].value or "")
    assert [int(c.value or "") for c in later] == list(range(first, first + len(later)))
    assert opened == 1


# -- failures ----------------------------------------------------------------------------


def test_closing_a_stream_from_another_thread_wakes_its_blocked_next(
    conn: Transport, key: str
) -> None:
    stream = conn.watch_stream(key, conn.set(key, "v").modified_index + 1)
    blocked = InThread(lambda: stream.next(Deadline(30)), name="test-next")
    assert stream.next_index > 0
    started = time.monotonic()
    stream.close()
    with pytest.raises(TransportClosedError):
        blocked.result(5)
    assert time.monotonic() - started < 1


def test_closing_the_transport_wakes_a_blocked_next(conn: Transport, key: str) -> None:
    stream = conn.watch_stream(key, conn.set(key, "v").modified_index + 1)
    blocked = InThread(lambda: stream.next(Deadline(30)), name="test-next")
    started = time.monotonic()
    conn.close()
    with pytest.raises(TransportClosedError):
        blocked.result(5)
    assert time.monotonic() - started < 1
    assert stream.closed


def test_a_stream_rides_out_a_sigstop_of_etcd(
    api: str, connect: Callable[..., Transport], private_etcd_server: EtcdServer, key: str
) -> None:
    server = private_etcd_server
    endpoint = (server.get_host(), server.get_port())
    conn, writer = connect(endpoint, read_timeout=2), connect(endpoint, read_timeout=30)
    start = writer.set(key, "start")
    before = watch_requests(api, server.client_url)
    stream = conn.watch_stream(key, start.modified_index + 1)
    writer.set(key, "0")
    assert drain(stream, 1)[0].value == "0"
    server.suspend()
    pid = server.pid
    wait_until(lambda: process_state(pid) == "T", 10, "etcd to stop")
    writes = threading.Thread(
        target=lambda: [writer.set(key, v) for v in ("1", "2", "3")], name="test-writer"
    )
    writes.start()
    started = time.monotonic()
    assert stream.next(Deadline(0.5)) is None
    assert time.monotonic() - started < 1.5
    server.resume()
    changes = drain(stream, 3, timeout=30)
    writes.join(30)
    writer.set(key, "4")
    changes += drain(stream, 1)
    assert [c.value for c in changes] == ["1", "2", "3", "4"]
    assert stream.next(Deadline(0.2)) is None
    stream.close()
    assert watch_requests(api, server.client_url) - before == 1


def test_a_stream_moves_to_another_member_when_its_member_dies(
    connect: Callable[..., Transport], etcd_cluster: EtcdCluster, key: str
) -> None:
    members = list(etcd_cluster.members)
    endpoints = [(m.host, m.port) for m in members]
    conn = connect(*endpoints, read_timeout=10)
    writer = connect(*endpoints[1:], read_timeout=30)
    start = writer.set(key, "0")
    stream = conn.watch_stream(key, start.modified_index)
    changes = drain(stream, 1)
    for value in ("1", "2"):
        writer.set(key, value)
    changes += drain(stream, 2)
    members[0].kill()
    for value in ("3", "4", "5"):
        writer.set(key, value)
    changes += drain(stream, 3, timeout=60)
    writer.set(key, "6")
    changes += drain(stream, 1)
    assert [c.value for c in changes] == [str(i) for i in range(7)]
    indexes = [c.modified_index for c in changes]
    assert indexes == sorted(set(indexes))
    assert stream.next(Deadline(0.2)) is None
    stream.close()


def test_a_stream_over_tls_with_client_certificates(
    connect: Callable[..., Transport],
    tls_etcd_server: EtcdServer,
    tls_certs: dict[str, str],
    key: str,
) -> None:
    endpoint = (tls_etcd_server.get_host(), tls_etcd_server.get_port())
    tls = {
        "protocol": "https",
        "cacert": tls_certs["ca.crt"],
        "cert": tls_certs["node.crt"],
        "key": tls_certs["node.key"],
    }
    conn, writer = connect(endpoint, **tls), connect(endpoint, **tls)
    start = writer.set(key, "start")
    with conn.watch_stream(key, start.modified_index + 1) as stream:
        for value in ("a", "b"):
            writer.set(key, value)
        assert [c.value for c in drain(stream, 2)] == ["a", "b"]
