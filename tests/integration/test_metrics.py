"""The metrics hook (:mod:`etcd_rendezvous.metrics`): transport counters during injected
failures (an endpoint going down, a lost answer) and rendezvous metrics of real rounds,
on the API under test (the hook itself, without etcd: ``tests/unit/test_metrics.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import CompareFailedError
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.metrics import (
    Metric,
    MetricsCollector,
    add_metrics_handler,
    remove_metrics_handler,
)
from support.faultproxy import FaultProxy
from support.handlers import join_in
from support.transports import Connect


def test_the_hook_sees_retries_and_a_failover(
    etcd_server: EtcdServer, etcd_prefix: str, fault_proxy_factory: Callable[..., FaultProxy]
) -> None:
    host, port = etcd_server.get_host(), etcd_server.get_port()
    first, second = fault_proxy_factory(host, port), fault_proxy_factory(host, port)
    conn = open_transport([first.endpoint, second.endpoint], read_timeout=2, connect_timeout=1)
    try:
        conn.set(f"{etcd_prefix}/before", "1")
        first.refuse()  # the endpoint in use goes down
        with MetricsCollector() as collected:
            conn.set(f"{etcd_prefix}/during", "2")
        assert conn.get(f"{etcd_prefix}/during").value == "2"
    finally:
        conn.close()
    assert collected.counter("transport.failovers", api=conn.api) == 1
    # Refused ("unsent"), or, when the write went out on a kept-alive connection that the
    # proxy then closed, of unknown outcome: a retry either way.
    assert collected.counter("transport.retries", op="write") >= 1
    # The refused attempt and the one that went through.
    assert collected.counter("transport.requests", op="write", api=conn.api) >= 2
    count, total, longest = collected.timings("transport.request_seconds", op="write")
    assert count == 1
    assert 0 < longest == total


def test_a_handler_may_use_the_connection_that_records_the_metric(
    etcd_server: EtcdServer, etcd_prefix: str, fault_proxy_factory: Callable[..., FaultProxy]
) -> None:
    """Metrics are recorded outside the connection's locks: a handler that sends a
    request on the same connection while a failover is recorded does not deadlock."""
    host, port = etcd_server.get_host(), etcd_server.get_port()
    first, second = fault_proxy_factory(host, port), fault_proxy_factory(host, port)
    conn = open_transport([first.endpoint, second.endpoint], read_timeout=5, connect_timeout=1)
    read_inside: list[str | None] = []

    def reads_on_failover(metric: Metric) -> None:
        if metric.name == "transport.failovers" and not read_inside:
            read_inside.append(conn.get(f"{etcd_prefix}/before").value)

    written: list[str | None] = []
    writer = threading.Thread(
        target=lambda: written.append(conn.set(f"{etcd_prefix}/during", "2").value),
        daemon=True,  # a deadlocked one must not hold up the test run
    )
    try:
        conn.set(f"{etcd_prefix}/before", "1")
        first.refuse()
        add_metrics_handler(reads_on_failover)
        try:
            writer.start()
            writer.join(timeout=30)
        finally:
            remove_metrics_handler(reads_on_failover)
    finally:
        if not writer.is_alive():  # a deadlocked connection cannot be closed
            conn.close()
    assert not writer.is_alive(), "the write deadlocked in its metrics handler"
    assert written == ["2"]
    assert read_inside == ["1"]


def test_the_hook_sees_a_lost_answer_resolved(etcd_proxy: FaultProxy, etcd_prefix: str) -> None:
    conn = open_transport([etcd_proxy.endpoint], read_timeout=2, connect_timeout=1)
    key = f"{etcd_prefix}/lost"
    try:
        prev = conn.set(key, "v0")
        # etcd applies the swap, the answer is lost; the re-sent copy finds it applied.
        etcd_proxy.drop_responses(count=1, close_client=True)
        with MetricsCollector() as collected:
            node = conn.compare_and_swap(key, "ours", prev)
        assert node.value == "ours"
    finally:
        conn.close()
    assert collected.counter("transport.retries", op="compare_and_swap", outcome="unknown") == 1
    assert collected.counter("transport.outcome_unknown", op="compare_and_swap") == 1
    assert collected.counter("transport.outcome_resolved", result="applied") == 1
    assert collected.counter("transport.outcome_resolved", result="not_applied") == 0


def test_rendezvous_metrics_of_a_round(
    handlers: Callable[..., list[DynamicRendezvousHandler]], pool: ThreadPoolExecutor
) -> None:
    group = handlers(2, 2, 2, last_call_timeout=1)
    with MetricsCollector() as collected:
        infos = [future.result(60) for future in join_in(pool, group)]
    assert sorted(info.rank for info in infos) == [0, 1]
    assert collected.counter("rendezvous.rounds", backend="etcd-v2") == 2
    # Each node saw two nodes admitted (itself and the other), none removed.
    assert collected.counter("rendezvous.nodes_admitted", backend="etcd-v2") == 4
    assert collected.counter("rendezvous.nodes_removed", backend="etcd-v2") == 0
    assert collected.gauge("rendezvous.world_size", backend="etcd-v2") == 2
    assert collected.counter("rendezvous.state_reads", backend="etcd-v2") >= 1
    assert collected.counter("rendezvous.state_decodes", backend="etcd-v2") >= 1
    count, _, longest = collected.timings("rendezvous.time_to_form", backend="etcd-v2")
    assert count == 2
    assert 0 < longest < 60
    assert collected.counter("transport.requests") > 0


def test_a_lost_compare_and_swap_and_a_watched_change_are_counted(
    connect: Connect, etcd_prefix: str
) -> None:
    conn = connect()
    key = f"{etcd_prefix}/counted"
    first = conn.set(key, "1")
    stream = conn.watch_stream(key, 0)
    try:
        with MetricsCollector() as collected:
            conn.compare_and_swap(key, "2", first)
            with pytest.raises(CompareFailedError):
                conn.compare_and_swap(key, "3", first)  # lost: the key changed
            assert stream.next(Deadline(10)) is not None
    finally:
        stream.close()
    assert collected.counter("transport.refusals", op="compare_and_swap", api=conn.api) == 1
    assert collected.counter("transport.refusals") == 1
    assert collected.counter("transport.watch_events", api=conn.api) == 1
