"""The metrics hook (:mod:`etcd_rendezvous.metrics`) without etcd: handlers that fail,
no torch import, and the forwarding to PyTorch's metrics (the counters during real
failures are in ``tests/integration/test_metrics.py``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from etcd_rendezvous.metrics import (
    Metric,
    MetricKind,
    add_metrics_handler,
    record_metric,
    remove_metrics_handler,
)


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
