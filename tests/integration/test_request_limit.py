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

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.metrics import MetricsCollector
from etcd_rendezvous.registry import get_rendezvous_handler
from support.net import endpoint_of

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


def _params(backend: str, server: EtcdServer, run_id: str, index: int) -> RendezvousParameters:
    options: dict[str, Any] = {"etcd_api": "v3"}
    if backend == "etcd":
        options.update(timeout=TIMEOUT, last_call_timeout=1)
    else:
        options.update(join_timeout=TIMEOUT, last_call_timeout=1, torch_store="false")
    return RendezvousParameters(
        backend, server.get_endpoint(), run_id, NODES, NODES, local_addr=_host(index), **options
    )


def _rendezvous(
    backend: str,
    server: EtcdServer,
    run_id: str,
    monkeypatch: pytest.MonkeyPatch,
    shut_down: list[bool] | None = None,
) -> list[tuple[BaseException | None, float]]:
    """NODES handlers join together; each one's error (``None``: it joined) and when it
    came (``time.monotonic()``). Every handler is closed afterwards (not shut down: the
    rendezvous is not closed for the others), unless ``shut_down`` is given: then each
    is shut down once all are done (as torch's agent does when it fails), and what its
    ``shutdown()`` returned is appended to it."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    handlers = [get_rendezvous_handler(_params(backend, server, run_id, i)) for i in range(NODES)]

    def join(handler: RendezvousHandler) -> tuple[BaseException | None, float]:
        try:
            handler.next_rendezvous()
        except Exception as exc:
            return exc, time.monotonic()
        return None, time.monotonic()

    try:
        with ThreadPoolExecutor(NODES, thread_name_prefix="node") as pool:
            futures = [pool.submit(join, handler) for handler in handlers]
            results = [future.result(timeout=TIMEOUT + 30) for future in futures]
        if shut_down is not None:
            shut_down.extend(handler.shutdown() for handler in handlers)
        return results
    finally:
        for handler in handlers:
            handler.close()  # type: ignore[attr-defined]


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
    (same data), rendezvouses. The report the failed round left in the progress key
    predates the new nodes' keys: they check etcd's limit before believing it."""
    data = str(tmp_path / "etcd")
    small = EtcdServer(
        data,
        etcd_binary=etcd_server.binary,
        enable_v2=etcd_server.enable_v2,
        extra_args=["--max-request-bytes", str(LIMIT)],
    )
    with small:
        _assert_all_refused(_rendezvous(backend, small, run_id, monkeypatch))
    raised = EtcdServer(data, etcd_binary=etcd_server.binary, enable_v2=etcd_server.enable_v2)
    with raised:
        results = _rendezvous(backend, raised, run_id, monkeypatch)
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
