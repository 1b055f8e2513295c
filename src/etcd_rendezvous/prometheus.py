"""The library's metrics (:mod:`etcd_rendezvous.metrics`) as Prometheus series, served
from the process that records them.

:class:`PrometheusExporter` is a metrics handler that turns each metric into a series of
``prometheus_client`` (counters ``etcd_rendezvous_<name>_total``, gauges, timings as
histograms ``etcd_rendezvous_<name>_seconds``); :func:`serve_metrics` registers it and
serves the series over HTTP. Setting ``ETCD_RENDEZVOUS_METRICS_PORT`` does both when
the process creates its first rendezvous handler (:func:`serve_metrics_from_environment`,
called by the backends' creators, so ``torchrun``'s agent serves them too).
``prometheus_client`` is needed only then (the ``[dashboard]`` extra has it). See
:doc:`dashboard`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from .metrics import Metric, MetricKind, add_metrics_handler

__all__ = [
    "METRICS_ADDR_ENV",
    "METRICS_PORT_ENV",
    "TIMING_BUCKETS",
    "PrometheusExporter",
    "serve_metrics",
    "serve_metrics_from_environment",
]

logger = logging.getLogger(__name__)

#: The port to serve the metrics on (``http://<host>:<port>/metrics``); unset: none.
METRICS_PORT_ENV = "ETCD_RENDEZVOUS_METRICS_PORT"
#: The address to serve them on (default ``0.0.0.0``, for Prometheus on another host).
METRICS_ADDR_ENV = "ETCD_RENDEZVOUS_METRICS_ADDR"
#: The histogram buckets of timings, in seconds: up to 15 min, as a rendezvous may wait.
TIMING_BUCKETS = (0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 900)

_started_lock = threading.Lock()
_started: tuple[str, int] | None = None


class PrometheusExporter:
    """A metrics handler that records every metric in ``prometheus_client``'s
    ``registry`` (its default registry if ``None``), each name as one series created at
    its first measurement, with the labels of that measurement (the library always gives
    a metric the same labels).

    Raises:
        ImportError: ``prometheus_client`` is not installed.
    """

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client  # noqa: PLC0415  (optional: the [dashboard] extra)

        self._client = prometheus_client
        self._registry = registry if registry is not None else prometheus_client.REGISTRY
        self._lock = threading.Lock()
        self._series: dict[str, Any] = {}

    def _series_of(self, metric: Metric) -> Any:
        name = "etcd_rendezvous_" + metric.name.replace(".", "_")
        with self._lock:
            series = self._series.get(name)
            if series is None:
                labels = sorted(metric.labels)
                client, registry = self._client, self._registry
                if metric.kind is MetricKind.COUNTER:
                    series = client.Counter(name, metric.name, labels, registry=registry)
                elif metric.kind is MetricKind.GAUGE:
                    series = client.Gauge(name, metric.name, labels, registry=registry)
                else:
                    series = client.Histogram(
                        name + "_seconds",
                        metric.name,
                        labels,
                        buckets=TIMING_BUCKETS,
                        registry=registry,
                    )
                self._series[name] = series
        return series

    def __call__(self, metric: Metric) -> None:
        series = self._series_of(metric)
        child = series.labels(**metric.labels) if metric.labels else series
        if metric.kind is MetricKind.COUNTER:
            child.inc(metric.value)
        elif metric.kind is MetricKind.GAUGE:
            child.set(metric.value)
        else:
            child.observe(metric.value)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> PrometheusExporter:
    """Record the library's metrics with a :class:`PrometheusExporter` and serve
    ``prometheus_client``'s default registry on ``http://<addr>:<port>/metrics`` (a
    daemon thread of ``prometheus_client``). Once per process: a second call returns a
    new exporter but serves nothing more.

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        OSError: the port cannot be listened on.
    """
    global _started  # noqa: PLW0603  (one server per process)
    exporter = PrometheusExporter()
    with _started_lock:
        if _started is None:
            exporter._client.start_http_server(port, addr=addr)
            _started = (addr, port)
            add_metrics_handler(exporter)
            logger.info("Serving the rendezvous metrics on http://%s:%d/metrics", addr, port)
    return exporter


def serve_metrics_from_environment(environ: Mapping[str, str] | None = None) -> None:
    """:func:`serve_metrics` on the port ``ETCD_RENDEZVOUS_METRICS_PORT`` names (and the
    address of ``ETCD_RENDEZVOUS_METRICS_ADDR``), if set; nothing otherwise. A port in
    use is logged (another process of this host may serve it) and the rendezvous goes
    on: monitoring never stops a rendezvous.

    Raises:
        ValueError: the variable is not a port number, or ``prometheus_client`` is not
            installed (the message names the variable).
    """
    env = os.environ if environ is None else environ
    text = env.get(METRICS_PORT_ENV, "").strip()
    if not text or _started is not None:
        return
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{METRICS_PORT_ENV}: expected a port number (1-65535), got {text!r}.")
    try:
        serve_metrics(int(text), env.get(METRICS_ADDR_ENV) or "0.0.0.0")
    except ImportError:
        raise ValueError(
            f"{METRICS_PORT_ENV} is set but prometheus_client is not installed: "
            "pip install 'etcd-rendezvous[dashboard]' (or prometheus-client)."
        ) from None
    except OSError as exc:
        logger.warning("Cannot serve the rendezvous metrics on port %s: %s", text, exc)
