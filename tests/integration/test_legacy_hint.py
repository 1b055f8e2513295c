"""The legacy backend's ``progress`` hint against a real etcd: a hint is never needed for
a rendezvous to complete, only for it to be cheap.

Workers waiting on the hint read the state after a silence; candidates admit after
their stagger whatever the hint says. So a hint key overwritten with garbage, or
deleted, all through the rendezvous (a vandal, a crash between a state write and its
hint, PyTorch's workers, which never write it) only slows the rendezvous down. The mixed
fleets of ``test_interop_torch.py`` cover PyTorch's own workers writing the state.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_rendezvous._legacy.feed import StateFeed
from etcd_rendezvous._legacy.join import BatchJoin
from etcd_rendezvous._legacy.state import Hint, parse_state
from etcd_rendezvous._transport.interface import KeyNotFoundError, Transport
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.layout import LegacyLayout
from etcd_rendezvous.metrics import MetricsCollector
from etcd_rendezvous.registry import get_rendezvous_handler
from support.wait import wait_until

PREFIX = "/torchelastic/p2p"
WORKERS = 4


def _handler(etcd_server: EtcdServer, run_id: str, n: int) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        backend="etcd",
        endpoint=etcd_server.get_endpoint(),
        run_id=run_id,
        min_nodes=n,
        max_nodes=n,
        local_addr="127.0.0.1",
        timeout="60",
        last_call_timeout="1",
        torch_store="false",
    )
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, EtcdRendezvousHandler)
    return handler


class _Vandal:
    """Overwrites the version's hint with ``value`` (or deletes it, if ``None``) every
    few milliseconds until stopped; counts its successful vandalisms."""

    def __init__(self, conn: Transport, key: str, value: str | None) -> None:
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(conn, key, value), name="hint-vandal", daemon=True
        )
        self._thread.start()

    def _run(self, conn: Transport, key: str, value: str | None) -> None:
        while not self._stop.wait(0.02):
            try:
                if value is None:
                    conn.delete(key)
                else:
                    conn.set(key, value)
                self.done += 1
            except KeyNotFoundError:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def legacy_handlers(etcd_server: EtcdServer, run_id: str) -> Iterator[list[EtcdRendezvousHandler]]:
    """``WORKERS`` legacy handlers of one run, closed after the test."""
    made = [_handler(etcd_server, run_id, WORKERS) for _ in range(WORKERS)]
    yield made
    for handler in made:
        handler.close()


@pytest.mark.parametrize("value", ["{not json", '{"index": 99999999}', None])
def test_a_garbled_or_deleted_hint_does_not_stop_the_rendezvous(
    etcd_server: EtcdServer,
    run_id: str,
    conn: Transport,
    legacy_handlers: list[EtcdRendezvousHandler],
    value: str | None,
) -> None:
    """The first worker makes version 1 (and its hint); from then on a vandal garbles or
    deletes the hint all the time; the other workers still join, with distinct ranks."""
    assert Hint.decode(value) is None
    hint_key = LegacyLayout(PREFIX, run_id).progress_key("1")
    first, *others = legacy_handlers
    with ThreadPoolExecutor(WORKERS) as pool:
        started = pool.submit(first.next_rendezvous)
        wait_until(lambda: conn.try_get(hint_key) is not None, what="the hint of version 1")
        vandal = _Vandal(conn, hint_key, value)
        try:
            began = time.monotonic()
            infos = [started, *(pool.submit(h.next_rendezvous) for h in others)]
            results = [f.result(timeout=90) for f in infos]
            took = time.monotonic() - began
        finally:
            vandal.stop()
    assert vandal.done > 0
    assert sorted(info.rank for info in results) == list(range(WORKERS))
    assert {info.world_size for info in results} == {WORKERS}
    # Without hints the silence (2 s, then 4) and the candidates' stagger still act.
    assert took < 45, took


def test_num_nodes_waiting_follows_the_state_without_reading_it_per_call(
    etcd_server: EtcdServer, run_id: str, conn: Transport
) -> None:
    """num_nodes_waiting() reads the state once, then only takes in its changes: many
    calls cost no request, and a change (a waiter counted by a PyTorch worker, which
    writes no hint) shows at the next call."""
    with _handler(etcd_server, run_id, 1) as handler:
        handler.next_rendezvous()
        assert handler.num_nodes_waiting() == 0
        with MetricsCollector() as collected:
            for _ in range(50):
                assert handler.num_nodes_waiting() == 0
        assert collected.counter("transport.requests") == 0
        key = LegacyLayout(PREFIX, run_id).state_key
        node = conn.get(key)
        state = json.loads(node.value or "")
        state["num_workers_waiting"] = 2  # as PyTorch's announce_self_waiting does
        conn.compare_and_swap(key, json.dumps(state), node)
        wait_until(lambda: handler.num_nodes_waiting() == 2, what="the waiters counted")


def test_a_worker_left_out_of_a_frozen_version_joins_the_next(
    etcd_server: EtcdServer, run_id: str, conn: Transport
) -> None:
    """A worker waiting in version 1 finds it frozen without it (PyTorch's last call, a
    worker whose member key lapsed under load): it waits for the frozen state to end
    on the state itself, not on version 1's hint, which no one writes again. When the
    frozen state lapses (no hint tells of that), it starts version 2 with the next
    worker well before its timeout."""
    layout = LegacyLayout(PREFIX, run_id)
    with (
        _handler(etcd_server, run_id, 2) as first,
        _handler(etcd_server, run_id, 2) as second,
        ThreadPoolExecutor(2) as pool,
    ):
        started = pool.submit(first.next_rendezvous)
        wait_until(
            lambda: conn.try_get(layout.progress_key("1")) is not None,
            what="version 1 and its hint",
        )
        node = conn.get(layout.state_key)
        frozen = {
            "status": "frozen",
            "version": "1",
            "participants": [0, 1],
            "keep_alives": [],
            "members": {"node_00000000000000aa": 0, "node_00000000000000bb": 1},
        }
        conn.compare_and_swap(layout.state_key, json.dumps(frozen), node, ttl=3)

        def lapsed() -> bool:
            node = conn.try_get(layout.state_key)
            return node is None or json.loads(node.value or "{}").get("status") != "frozen"

        wait_until(lapsed, timeout=15, what="the frozen state to lapse")
        began = time.monotonic()
        joined = pool.submit(second.next_rendezvous)
        results = [started.result(timeout=90), joined.result(timeout=90)]
        took = time.monotonic() - began
    assert sorted(info.rank for info in results) == [0, 1]
    assert {info.world_size for info in results} == {2}
    assert took < 20, took


def test_num_nodes_waiting_hears_no_state_write_of_the_next_rendezvous(
    etcd_server: EtcdServer, run_id: str, conn: Transport
) -> None:
    """The stream num_nodes_waiting() keeps on the state is closed when the worker enters
    the next rendezvous: the states written meanwhile reach the worker through its join
    only (a follower reads few of them), not a second time through that stream."""
    layout = LegacyLayout(PREFIX, run_id)
    with (
        _handler(etcd_server, run_id, 2) as first,
        _handler(etcd_server, run_id, 2) as second,
        ThreadPoolExecutor(2) as pool,
    ):
        for info in pool.map(lambda h: h.next_rendezvous(), [first, second]):
            assert info.world_size == 2
        assert first.num_nodes_waiting() == 0  # (its stream on the state is open)
        conn.delete(layout.state_key)  # version 1 ends
        with MetricsCollector() as collected:
            again = pool.submit(first.next_rendezvous)
            wait_until(
                lambda: conn.try_get(layout.progress_key("2")) is not None,
                what="version 2 and its hint",
            )
            # A large state, as a PyTorch worker may write it (an unknown field kept):
            # every copy of it that a stream brings shows in the bytes.
            node = conn.get(layout.state_key)
            state = {**json.loads(node.value or ""), "note": "x" * 100_000}
            conn.compare_and_swap(layout.state_key, json.dumps(state), node)
            joined = pool.submit(second.next_rendezvous)
            results = [again.result(timeout=90), joined.result(timeout=90)]
        assert sorted(info.rank for info in results) == [0, 1]
        streamed = collected.counter("transport.bytes_received", op="watch")
        # (the waiting stream kept open would bring the large state twice, or more)
        assert streamed < 50_000, streamed
        assert first.num_nodes_waiting() == 0


def test_a_late_hint_does_not_replace_a_newer_one(run_id: str, conn: Transport) -> None:
    """Two workers hint at once and the older state's hint lands last: the key keeps
    the newer one. A stored hint of an index etcd has not reached (a lie) is replaced."""
    layout = LegacyLayout(PREFIX, run_id)
    join = BatchJoin(
        conn,
        layout,
        StateFeed(conn, layout.state_key, parse_state),
        min_workers=4,
        max_workers=4,
        keep_alive=lambda key, lease: pytest.fail("no key to keep alive"),
        timeout_error=lambda: AssertionError("no deadline"),
    )
    state = {"status": "joinable", "version": "1", "participants": [0]}
    older = conn.set(layout.state_key, json.dumps(state))
    newer_state = {**state, "participants": [0, 1]}
    newer = conn.set(layout.state_key, json.dumps(newer_state))
    hint_key = layout.progress_key("1")

    def stored() -> tuple[int, int] | None:
        hint = Hint.decode(conn.get(hint_key).value)
        return None if hint is None else (hint.index, hint.count)

    join.publish("1", newer, newer_state)
    assert stored() == (newer.modified_index, 2)
    join.publish("1", older, state)  # late
    assert stored() == (newer.modified_index, 2)
    lie = Hint(10**12, "joinable", "1", 10**12, 9, 0)
    conn.set(hint_key, lie.encode())
    join.publish("1", older, state)
    assert stored() == (older.modified_index, 1)
