"""The metrics hook (:mod:`etcd_rendezvous.metrics`) without etcd: handlers that fail,
no torch import, the forwarding to PyTorch's metrics, and the transports' byte counters
against recorded gateway answers and a fake pool (the counters during real failures are
in ``tests/integration/test_metrics.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import urllib3

from etcd_rendezvous._transport.stream import iter_objects
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.metrics import (
    Metric,
    MetricKind,
    MetricsCollector,
    add_metrics_handler,
    record_metric,
    remove_metrics_handler,
)

RECORDED = Path(__file__).parent / "recorded"


def test_a_failing_handler_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Metric] = []

    def broken(metric: Metric) -> None:
        raise RuntimeError("boom")

    add_metrics_handler(broken)
    add_metrics_handler(seen.append)
    try:
        record_metric("test.metric", 2.0, MetricKind.GAUGE, where="here")
    finally:
        remove_metrics_handler(broken)
        remove_metrics_handler(seen.append)
    assert seen == [Metric("test.metric", 2.0, MetricKind.GAUGE, {"where": "here"})]
    assert "boom" in caplog.text
    with pytest.raises(ValueError, match="not a registered"):
        remove_metrics_handler(broken)


def test_importing_the_library_does_not_import_torch() -> None:
    code = (
        "import sys, etcd_rendezvous, etcd_rendezvous.metrics, etcd_rendezvous.etcd_rendezvous\n"
        "etcd_rendezvous.metrics.record_metric('x')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.torch
def test_metrics_reach_torch_elastic_metrics_once_loaded() -> None:
    torch_metrics = pytest.importorskip("torch.distributed.elastic.metrics")
    received: list[tuple[str, str, int]] = []

    class Handler(torch_metrics.MetricHandler):  # type: ignore[misc,name-defined]
        def emit(self, metric_data: Any) -> None:
            received.append((metric_data.group_name, metric_data.name, metric_data.value))

    torch_metrics.configure(Handler(), group="etcd_rendezvous")
    try:
        record_metric("transport.retries", op="write", outcome="unsent")
        record_metric("rendezvous.time_to_form", 1.5, MetricKind.TIMING, backend="etcd")
    finally:
        torch_metrics.configure(torch_metrics.NullMetricHandler(), group="etcd_rendezvous")
    assert received == [
        ("etcd_rendezvous", "transport.retries.write", 1),
        ("etcd_rendezvous", "rendezvous.time_to_form.duration.ms", 1500),
    ]


def _recorded_body(name: str, version: str = "3.5.1") -> bytes:
    """The body of the gateway's recorded answer ``name``, as etcd sent it."""
    answers = json.loads((RECORDED / f"gateway-{version}.json").read_text())["answers"]
    answer = next(answer for answer in answers if answer["name"] == name)
    return json.dumps(answer["body"]).encode()


class _FakePool:
    """A urllib3 pool that answers every request with ``answer`` and keeps the bodies
    sent."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sent: list[bytes] = []
        self.pools: dict[Any, Any] = {}  # no per-host pool: nothing to close

    def request(self, method: str, url: str, body: bytes | None = None, **kw: Any) -> Any:
        self.sent.append(body or b"")
        return SimpleNamespace(status=200, data=self.answer, headers={})

    def clear(self) -> None:
        pass


def test_v3_requests_count_the_bytes_of_the_body_sent_and_the_answer_by_op() -> None:
    answer = _recorded_body("range_prefix")
    pool = _FakePool(answer)
    conn = EtcdV3Connection([("127.0.0.1", 1)], read_timeout=2.0)
    conn._session.pool = pool  # type: ignore[assignment]
    with conn, MetricsCollector() as collected:
        conn.list_dir("/empty")
        conn.get("/k")

    assert len(pool.sent) == 2
    list_sent, read_sent = (len(body) for body in pool.sent)
    assert collected.counter("transport.bytes_received", op="list", api="v3") == len(answer)
    assert collected.counter("transport.bytes_received", op="read", api="v3") == len(answer)
    assert collected.counter("transport.bytes_sent", op="list", api="v3") == list_sent
    assert collected.counter("transport.bytes_sent", op="read", api="v3") == read_sent
    assert collected.counter("transport.bytes_received") == 2 * len(answer)


def test_v2_requests_count_the_answer_python_etcd_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """python-etcd asks for unread bodies; the pool manager reads (and counts) them,
    and python-etcd still finds the body."""
    answer = json.dumps(
        {"action": "get", "node": {"key": "/k", "value": "v" * 100, "modifiedIndex": 3}}
    ).encode()
    sent: list[Any] = []

    def urlopen(self: Any, method: str, url: str, redirect: bool = True, **kw: Any) -> Any:
        sent.append(kw.get("body"))
        return urllib3.HTTPResponse(
            body=answer,
            status=200,
            headers={"X-Etcd-Index": "3", "Content-Type": "application/json"},
            preload_content=kw.get("preload_content", True),
        )

    monkeypatch.setattr(urllib3.PoolManager, "urlopen", urlopen)
    conn = EtcdConnection([("127.0.0.1", 1)], read_timeout=2.0)
    with conn, MetricsCollector() as collected:
        node = conn.get("/k")
        conn.set("/k", "w" * 50)

    assert node.value == "v" * 100
    put_body = sent[1]
    assert collected.counter("transport.bytes_received", op="read", api="v2") == len(answer)
    assert collected.counter("transport.bytes_received", op="write", api="v2") == len(answer)
    assert collected.counter("transport.bytes_sent", op="read", api="v2") == 0
    assert collected.counter("transport.bytes_sent", op="write", api="v2") == len(put_body) > 50


def test_a_watch_stream_counts_every_chunk_as_watch_bytes() -> None:
    chunks = [b'{"a": 1}  {"b"', b": 2}\n", b"   "]
    with MetricsCollector() as collected:
        assert list(iter_objects(chunks, "v3")) == [{"a": 1}, {"b": 2}]

    total = sum(len(chunk) for chunk in chunks)
    assert collected.counter("transport.bytes_received", op="watch", api="v3") == total
    assert collected.counter("transport.bytes_sent") == 0
