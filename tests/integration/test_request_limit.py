"""A rendezvous state that outgrows etcd's request limit (``--max-request-bytes``).

etcd refuses a request over its limit (v3: "request is too large", or gRPC's own
"received message larger than max" past the limit plus 512 KiB; v2: Go's 10 MiB form
limit, which no flag raises). The transport raises
:class:`~etcd_rendezvous.api.RequestTooLargeError` at once, naming the key, the size,
etcd's answer, the endpoint and the flag, and never sends the request again. In a
rendezvous, the node whose state write was refused reports it in the progress key, and
every node waiting for that write raises the same error within seconds, instead of
waiting for its own timeout.

The rendezvous run on a server of the test's own, started with a small limit, over
etcd's v3 API (``etcd_api=v3``: the v2 API has no such limit), with enough nodes (threads
of this process) that the state outgrows it.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous._transport.interface import KeyNotFoundError, Transport
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
    RequestTooLargeError,
)
from etcd_rendezvous.dynamic_rendezvous import decode_state
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.layout import ETCD_V2_STATE_PREFIX, etcd_v2_state_key
from etcd_rendezvous.metrics import MetricsCollector
from etcd_rendezvous.registry import get_rendezvous_handler
from support.net import endpoint_of
from support.wait import wait_until

#: The small server's ``--max-request-bytes``.
LIMIT = 4096
#: Nodes of a rendezvous: a state of that many outgrows LIMIT on both backends (with the
#: host names below for etcd-v2; with the legacy backend's member keys, once frozen),
#: while each node's own keys fit.
NODES = 40
#: Each node's own timeout: far beyond BOUND, so that a node that waits for it fails
#: the test.
TIMEOUT = 60
#: Seconds after the first node's error within which every node raises it: the silence
#: after which a worker that missed the report looks again (2 s, then 4 s), a candidate's
#: turn (under 2 s) and a margin for a loaded machine.
BOUND = 15.0


def _host(index: int) -> str:
    """A Kubernetes pod's host name, as our nodes report it (about 50 characters)."""
    return f"worker-{index}.pytorchjob-limit.default.svc.cluster.local"


@pytest.fixture
def small_etcd(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """An etcd of the test's own (the session's binary) accepting requests of up to
    LIMIT bytes."""
    server = EtcdServer(
        etcd_binary=etcd_server.binary,
        enable_v2=etcd_server.enable_v2,
        extra_args=["--max-request-bytes", str(LIMIT)],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _params(
    backend: str,
    server: EtcdServer,
    run_id: str,
    index: int,
    nodes: int = NODES,
    **more: Any,
) -> RendezvousParameters:
    options: dict[str, Any] = {"etcd_api": "v3", **more}
    if backend == "etcd":
        options.update(timeout=TIMEOUT, last_call_timeout=1)
    else:
        options.update(join_timeout=TIMEOUT, last_call_timeout=1, torch_store="false")
    return RendezvousParameters(
        backend, server.get_endpoint(), run_id, nodes, nodes, local_addr=_host(index), **options
    )


def _rendezvous(
    backend: str,
    server: EtcdServer,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
    shut_down: list[bool] | None = None,
    **options: Any,
) -> list[tuple[BaseException | None, float]]:
    """NODES handlers join together; each one's error (``None``: it joined) and when it
    came (``time.monotonic()``). Every handler is closed afterwards (not shut down: the
    rendezvous is not closed for the others), unless ``shut_down`` is given: then each
    is shut down once all are done (as torch's agent does when it fails), and what its
    ``shutdown()`` returned is appended to it. ``options``: more handler options."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = [
        get_rendezvous_handler(_params(backend, server, run_id, i, **options)) for i in range(NODES)
    ]

    try:
        with ThreadPoolExecutor(NODES, thread_name_prefix="node") as pool:
            futures = [pool.submit(_join, handler) for handler in handlers]
            results = [future.result(timeout=TIMEOUT + 30) for future in futures]
        if shut_down is not None:
            shut_down.extend(handler.shutdown() for handler in handlers)
        return results
    finally:
        for handler in handlers:
            handler.close()  # type: ignore[attr-defined]


def _join(handler: RendezvousHandler) -> tuple[BaseException | None, float]:
    """``handler.next_rendezvous()``: its error (``None``: it joined), and when."""
    try:
        handler.next_rendezvous()
    except Exception as exc:
        return exc, time.monotonic()
    return None, time.monotonic()


def _assert_all_refused(results: list[tuple[BaseException | None, float]]) -> None:
    errors = [error for error, _ in results]
    kinds = sorted({type(error).__name__ for error in errors})
    assert all(isinstance(error, RequestTooLargeError) for error in errors), kinds
    times = [at for _, at in results]
    assert max(times) - min(times) < BOUND, sorted(round(t - min(times), 2) for t in times)
    for error in errors:
        message = str(error)
        assert "--max-request-bytes" in message, message
        assert "request is too large" in message or "larger than max" in message, message


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_every_node_raises_the_refusal_within_seconds_of_the_first(
    backend: str, small_etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node whose state write etcd refused raises; every other node of the round,
    waiting for that write, raises the same error within BOUND, not at its timeout."""
    _assert_all_refused(_rendezvous(backend, small_etcd, run_id, monkeypatch))


def test_workers_waiting_on_a_complete_version_raise_the_refusal_of_their_count(
    small_etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``etcd``: a complete version whose state nearly fills the limit, and workers that
    arrive late: the count of their wait keys in the state is refused for its size, and
    every waiting worker raises it (they wait for the version to end, which their count
    would have told its members), not at its timeout."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    members, late = 30, 20  # a final state of 30 fits in LIMIT; 20 more names do not
    made = [
        get_rendezvous_handler(_params("etcd", small_etcd, run_id, i, members))
        for i in range(members + late)
    ]
    try:
        with ThreadPoolExecutor(members + late, thread_name_prefix="node") as pool:
            first = list(pool.map(_join, made[:members]))
            assert [error for error, _ in first] == [None] * members
            _assert_all_refused(list(pool.map(_join, made[members:])))
    finally:
        for handler in made:
            handler.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_the_nodes_close_the_run_after_the_refusal(
    backend: str, small_etcd: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's agent shuts the rendezvous down when it fails: that closes the run, though
    the node's own changes were refused (they are not sent again)."""
    shut_down: list[bool] = []
    _assert_all_refused(_rendezvous(backend, small_etcd, run_id, monkeypatch, shut_down))
    assert shut_down == [True] * NODES
    late = get_rendezvous_handler(_params(backend, small_etcd, run_id, NODES))
    try:
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()
    finally:
        late.close()  # type: ignore[attr-defined]


#: etcd-v2 heartbeats that lapse soon (3 s): the nodes of the failed attempt, in the
#: state, are dropped before the next one (as PyTorch drops a dead node).
QUICK_HEARTBEATS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3}


def _lapsed(server: EtcdServer, run_id: str) -> bool:
    """Whether every heartbeat in the run's etcd-v2 state is older than QUICK_HEARTBEATS
    allow (or there is no state)."""
    with _connect("v3", server) as conn:
        node = conn.try_get(etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX))
    if node is None or node.value is None:
        return True
    state = decode_state(base64.b64decode(node.value), "the test")
    lifetime = QUICK_HEARTBEATS["keep_alive_interval"] * QUICK_HEARTBEATS["keep_alive_max_attempt"]
    oldest_alive = datetime.now(timezone.utc) - timedelta(seconds=lifetime)
    return all(beat < oldest_alive for beat in state.last_heartbeats.values())


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_run_rendezvouses_once_the_limit_is_raised(
    backend: str,
    etcd_server: EtcdServer,
    run_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The operator's fix: the same run, after etcd was restarted with a larger limit
    (same data), rendezvouses. The report the failed attempt left in the progress key
    predates the new nodes' keys: they check etcd's limit before believing it. (The
    failed attempt's nodes are dropped first: the ``etcd`` backend's version lapses,
    ``etcd-v2``'s heartbeats do.)"""
    data = str(tmp_path / "etcd")
    small = EtcdServer(
        data,
        etcd_binary=etcd_server.binary,
        enable_v2=etcd_server.enable_v2,
        extra_args=["--max-request-bytes", str(LIMIT)],
    )
    options = QUICK_HEARTBEATS if backend == "etcd-v2" else {}
    with small:
        _assert_all_refused(_rendezvous(backend, small, run_id, monkeypatch, **options))
    raised = EtcdServer(data, etcd_binary=etcd_server.binary, enable_v2=etcd_server.enable_v2)
    with raised:
        wait_until(lambda: _lapsed(raised, run_id), what="the failed nodes' heartbeats lapse")
        results = _rendezvous(backend, raised, run_id, monkeypatch, **options)
    assert [error for error, _ in results] == [None] * NODES


# -- the transport ----------------------------------------------------------------------------


def _connect(api: str, server: EtcdServer) -> Transport:
    kind = EtcdConnection if api == "v2" else EtcdV3Connection
    return kind([endpoint_of(server)], read_timeout=10)


@pytest.mark.parametrize(
    ("size", "answer"),
    [(LIMIT + 100, "request is too large"), (LIMIT + 600_000, "larger than max")],
    ids=["over-the-limit", "over-grpc-s-limit"],
)
def test_a_v3_write_too_large_is_refused_once_naming_the_flag(
    small_etcd: EtcdServer, size: int, answer: str
) -> None:
    """Both of etcd's answers: over --max-request-bytes, and over gRPC's own limit (which
    answers RESOURCE_EXHAUSTED, no overload): one request, never sent again."""
    with _connect("v3", small_etcd) as conn, MetricsCollector() as collected:
        node = conn.create("/limit/state", "small")
        with pytest.raises(RequestTooLargeError) as info:
            conn.compare_and_swap("/limit/state", "x" * size, node)
        swaps = collected.counter("transport.requests", op="compare_and_swap")
    error = info.value
    assert swaps == 1
    assert (error.key, error.api, error.endpoint) == ("/limit/state", "v3", small_etcd.client_url)
    assert size <= error.size < size + 100
    message = str(error)
    for part in ("'/limit/state'", small_etcd.client_url, answer, "--max-request-bytes"):
        assert part in message, message
    if answer == "larger than max":
        assert f"this member's is {LIMIT} bytes" in message
    with _connect("v3", small_etcd) as conn:
        assert conn.get("/limit/state").value == "small"  # nothing applied


def test_a_size_check_writes_nothing(small_etcd: EtcdServer) -> None:
    with _connect("v3", small_etcd) as conn:
        conn.check_size("/limit", LIMIT // 2)
        with pytest.raises(RequestTooLargeError):
            conn.check_size("/limit", LIMIT)
        with pytest.raises(KeyNotFoundError):
            conn.list_dir("/limit")


@pytest.mark.v2_only(reason="the v2 API's own limit")
def test_a_v2_write_over_10_mib_is_refused_naming_the_v3_flag(small_etcd: EtcdServer) -> None:
    """--max-request-bytes does not apply to the v2 API: only Go's 10 MiB form limit
    does. The error says so, and points to the v3 API and its flag."""
    with _connect("v2", small_etcd) as conn, MetricsCollector() as collected:
        node = conn.set("/limit/state", "x" * (2 * LIMIT))  # over LIMIT: v2 takes it
        with pytest.raises(RequestTooLargeError) as info:
            conn.compare_and_swap("/limit/state", "x" * (11 * 1024 * 1024), node)
        swaps = collected.counter("transport.requests", op="compare_and_swap")
        assert conn.get("/limit/state").value == "x" * (2 * LIMIT)
    assert swaps == 1
    message = str(info.value)
    for part in ("POST too large", "10 MiB", "--max-request-bytes", "etcd_api=v3"):
        assert part in message, message
    assert info.value.api == "v2"
