"""A silent endpoint costs ``request_timeout`` per request and ``silence_timeout`` per wait.

The connection lists a fault proxy first, then the etcd behind it. The proxy stops
answering (it forwards requests but holds every answer back, keeping the connections
open: a frozen member, as far as the client can tell). A read, a watch stream that was
open through it, and a single wait must move on to the etcd itself within
``request_timeout`` / ``silence_timeout`` (short here), on the API under test. The
3-member version with a real SIGSTOP is ``test_silent_member.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import Deadline, RendezvousConnectionError
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.metrics import MetricsCollector
from support.faultproxy import FaultProxy

REQUEST_TIMEOUT = 0.5
SILENCE_TIMEOUT = 1.0
#: What a wait may take: the bounds above, with a wide margin for a loaded machine, and
#: far below the read timeout (the wait's own timeout) it took before.
BOUND = 6.0
READ_TIMEOUT = 20.0


@pytest.fixture
def proxy(etcd_server: EtcdServer, fault_proxy_factory: Callable[..., FaultProxy]) -> FaultProxy:
    made: FaultProxy = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    return made


@pytest.fixture
def conn(proxy: FaultProxy, etcd_server: EtcdServer) -> Iterator[Transport]:
    """A connection to the proxy first, then to the etcd behind it."""
    endpoints = [proxy.endpoint, (etcd_server.get_host(), etcd_server.get_port())]
    with open_transport(
        endpoints,
        read_timeout=READ_TIMEOUT,
        request_timeout=REQUEST_TIMEOUT,
        silence_timeout=SILENCE_TIMEOUT,
    ) as connection:
        yield connection


@pytest.fixture
def writer(etcd_server: EtcdServer) -> Iterator[Transport]:
    with open_transport([(etcd_server.get_host(), etcd_server.get_port())]) as connection:
        yield connection


def test_a_read_goes_to_the_next_endpoint_after_request_timeout(
    conn: Transport, writer: Transport, proxy: FaultProxy, etcd_prefix: str
) -> None:
    writer.set(f"{etcd_prefix}/k", "v")
    proxy.drop_responses()
    started = time.monotonic()
    assert conn.get(f"{etcd_prefix}/k").value == "v"
    took = time.monotonic() - started
    assert REQUEST_TIMEOUT * 0.9 <= took < BOUND, took


def test_a_watch_stream_on_a_silent_endpoint_is_re_armed_on_the_next(
    conn: Transport, writer: Transport, proxy: FaultProxy, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/k"
    with conn.watch_stream(key, 0) as stream:
        proxy.drop_responses()
        writer.set(key, "1")
        started = time.monotonic()
        change = stream.next(Deadline(READ_TIMEOUT))
        took = time.monotonic() - started
        assert change is not None
        assert change.value == "1"
        assert took < BOUND, took
        # The stream stays on the next endpoint: the following change comes on the
        # same answer, with no watch request of its own.
        with MetricsCollector() as collected:
            writer.set(key, "2")
            change = stream.next(Deadline(READ_TIMEOUT))
        assert change is not None
        assert change.value == "2"
        assert collected.counter("transport.watch_restarts") == 0
        assert collected.counter("transport.silent_rearms") == 0
        assert collected.counter("transport.failovers") == 0


def test_a_single_wait_on_a_silent_endpoint_moves_on_within_silence_timeout(
    conn: Transport, writer: Transport, proxy: FaultProxy, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/k"
    index = writer.set(key, "0").etcd_index
    proxy.drop_responses()
    written = writer.set(key, "1")
    started = time.monotonic()
    change = conn.watch(key, index + 1, Deadline(READ_TIMEOUT))
    took = time.monotonic() - started
    assert change is not None
    assert change.value == "1"
    assert change.modified_index == written.modified_index
    assert took < BOUND, took


def test_an_idle_wait_on_a_live_endpoint_returns_nothing_at_its_timeout(
    conn: Transport, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Re-arming a wait that heard nothing delivers no change that did not happen, and
    is no failover: it is counted apart and logged at DEBUG only."""
    key = f"{etcd_prefix}/quiet"
    with caplog.at_level(logging.DEBUG, logger="etcd_rendezvous"), MetricsCollector() as collected:
        with conn.watch_stream(key, 0) as stream:
            started = time.monotonic()
            assert stream.next(Deadline(SILENCE_TIMEOUT * 2.5)) is None
            assert time.monotonic() - started >= SILENCE_TIMEOUT * 2.5 * 0.9
        assert conn.watch(key, conn.last_index + 1, Deadline(SILENCE_TIMEOUT * 2.5)) is None
    assert collected.counter("transport.silent_rearms", api=conn.api) >= 2  # one per wait
    assert collected.counter("transport.failovers") == 0
    said_nothing = [r for r in caplog.records if "said nothing for" in r.getMessage()]
    assert said_nothing
    assert all(r.levelno == logging.DEBUG for r in said_nothing)


def test_a_lone_slow_endpoint_is_asked_again_with_more_patience(
    proxy: FaultProxy, etcd_prefix: str
) -> None:
    """The only endpoint answers nothing (an etcd overloaded by thousands of clients
    looks the same): each further attempt waits twice as long as the last, instead of
    sending a copy of the request every ``request_timeout``, which the member would
    have to work through as well."""
    deadline = 7 * REQUEST_TIMEOUT  # attempts of 0.5, 1 and 2 s, with pauses between
    with open_transport(
        [proxy.endpoint], read_timeout=deadline, request_timeout=REQUEST_TIMEOUT
    ) as lone:
        proxy.drop_responses()
        started = time.monotonic()
        with MetricsCollector() as collected, pytest.raises(RendezvousConnectionError):
            lone.get(f"{etcd_prefix}/k")
        took = time.monotonic() - started
    attempts = collected.counter("transport.requests", op="read")
    assert attempts == 3, f"{attempts:g} attempts in {took:.1f} s"
    assert took < deadline + BOUND
