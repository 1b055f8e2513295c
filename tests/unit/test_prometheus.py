"""The library's metrics in Prometheus' format (``etcd_rendezvous.prometheus``)."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from etcd_rendezvous.metrics import Metric, MetricKind  # noqa: E402
from etcd_rendezvous.prometheus import (  # noqa: E402
    METRICS_PORT_ENV,
    PrometheusExporter,
    serve_metrics_from_environment,
)


def test_each_kind_of_metric_becomes_its_series() -> None:
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(registry)
    exporter(Metric("transport.requests", 1, MetricKind.COUNTER, {"op": "read", "api": "v3"}))
    exporter(Metric("transport.requests", 2, MetricKind.COUNTER, {"op": "read", "api": "v3"}))
    exporter(Metric("rendezvous.world_size", 8, MetricKind.GAUGE, {"backend": "etcd"}))
    exporter(Metric("rendezvous.time_to_form", 3.5, MetricKind.TIMING, {"backend": "etcd"}))
    value = registry.get_sample_value
    assert value("etcd_rendezvous_transport_requests_total", {"op": "read", "api": "v3"}) == 3
    assert value("etcd_rendezvous_rendezvous_world_size", {"backend": "etcd"}) == 8
    labels = {"backend": "etcd", "le": "5.0"}
    assert value("etcd_rendezvous_rendezvous_time_to_form_seconds_bucket", labels) == 1


@pytest.mark.parametrize("bad", ["http", "0", "65536", "-1"])
def test_a_bad_port_names_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=METRICS_PORT_ENV):
        serve_metrics_from_environment({METRICS_PORT_ENV: bad})


def test_nothing_is_served_without_the_variable() -> None:
    serve_metrics_from_environment({})  # no port, no server, no error
