"""Counters and timings of the etcd transport and of the rendezvous, for monitoring.

Every :class:`Metric` goes, in the thread that produced it, to the callbacks of
:func:`add_metrics_handler` (a :class:`MetricsCollector` adds them up) and to PyTorch's
``torch.distributed.elastic.metrics`` when the process has already loaded it (PyTorch is
never imported for a metric). Recording never breaks a rendezvous: a callback that
raises is logged and ignored. Each metric, its labels and a Prometheus export:
:doc:`metrics`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

__all__ = [
    "Metric",
    "MetricKind",
    "MetricsCollector",
    "MetricsHandler",
    "add_metrics_handler",
    "record_metric",
    "remove_metrics_handler",
    "timed",
]

logger = logging.getLogger(__name__)

#: The module PyTorch publishes metrics through; used only once loaded.
_TORCH_METRICS = "torch.distributed.elastic.metrics"
#: The metric group of ours in PyTorch's metrics.
TORCH_METRIC_GROUP = "etcd_rendezvous"


class MetricKind(str, enum.Enum):
    """What a :class:`Metric`'s value is."""

    COUNTER = "counter"
    """An increment (usually 1)."""
    TIMING = "timing"
    """A duration, in seconds."""
    GAUGE = "gauge"
    """A value that replaces the previous one."""


@dataclasses.dataclass(frozen=True)
class Metric:
    """One measurement."""

    name: str
    """The metric's name, e.g. ``transport.retries`` (see the module's table)."""
    value: float
    """The increment (counter), seconds (timing) or current value (gauge)."""
    kind: MetricKind
    """Whether the value is an increment, a duration or a level."""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What the measurement is about: ``op``, ``api``, ``backend``, ..."""


#: A callback that receives every metric recorded in this process.
MetricsHandler = Callable[[Metric], None]


class _Handlers:
    """The registered callbacks: a tuple replaced under a lock, read without it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: tuple[MetricsHandler, ...] = ()

    def add(self, handler: MetricsHandler) -> None:
        with self._lock:
            self.current = (*self.current, handler)

    def remove(self, handler: MetricsHandler) -> None:
        with self._lock:
            if handler not in self.current:
                raise ValueError(f"handler: {handler!r} is not a registered metrics handler.")
            index = self.current.index(handler)
            self.current = self.current[:index] + self.current[index + 1 :]


_handlers = _Handlers()


def add_metrics_handler(handler: MetricsHandler) -> None:
    """Call ``handler`` with every metric recorded in this process, in the thread that
    records it (so it should return quickly). Adding a handler twice calls it twice."""
    _handlers.add(handler)


def remove_metrics_handler(handler: MetricsHandler) -> None:
    """Stop calling ``handler`` (one registration of it).

    Raises:
        ValueError: ``handler`` is not registered.
    """
    _handlers.remove(handler)


def record_metric(
    name: str,
    value: float = 1.0,
    kind: MetricKind = MetricKind.COUNTER,
    /,
    **labels: str,
) -> None:
    """Record one measurement: deliver it to the callbacks and, if loaded, PyTorch's
    metrics (see the module documentation)."""
    torch_metrics = sys.modules.get(_TORCH_METRICS)
    handlers = _handlers.current
    if torch_metrics is None and not handlers:
        return
    metric = Metric(name, value, kind, labels)
    if torch_metrics is not None:
        _deliver(_to_torch, torch_metrics, metric)
    for handler in handlers:
        _deliver(handler, metric)


@contextmanager
def timed(name: str, **labels: str) -> Iterator[None]:
    """Record how long the block took as a timing ``name`` (also when it raises)."""
    started = time.monotonic()
    try:
        yield
    finally:
        record_metric(name, time.monotonic() - started, MetricKind.TIMING, **labels)


def _to_torch(torch_metrics: ModuleType, metric: Metric) -> None:
    """Hand ``metric`` to ``torch.distributed.elastic.metrics.put_metric``."""
    if metric.kind == MetricKind.TIMING:
        name, value = f"{metric.name}.duration.ms", round(metric.value * 1000)
    else:
        op = metric.labels.get("op")
        name, value = (f"{metric.name}.{op}" if op else metric.name), round(metric.value)
    torch_metrics.put_metric(name, value, TORCH_METRIC_GROUP)


def _deliver(handler: Callable[..., Any], *args: Any) -> None:
    """Call ``handler``; log, but never raise, what it raises."""
    try:
        handler(*args)
    except Exception:
        logger.warning("The metrics handler %r raised; ignoring it", handler, exc_info=True)


_Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclasses.dataclass
class _Timing:
    count: int = 0
    total: float = 0.0
    maximum: float = 0.0


class MetricsCollector:
    """A metrics handler that adds the metrics up: counters summed, timings as count,
    total and maximum, gauges as their last value, each per name and labels.

    Use it as a context manager to register and unregister it::

        with MetricsCollector() as collected:
            handler.next_rendezvous()
        collected.counter("transport.retries")   # all labels summed
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[_Key, float] = {}
        self._gauges: dict[_Key, float] = {}
        self._timings: dict[_Key, _Timing] = {}

    def __call__(self, metric: Metric) -> None:
        key = (metric.name, tuple(sorted(metric.labels.items())))
        with self._lock:
            if metric.kind == MetricKind.COUNTER:
                self._counters[key] = self._counters.get(key, 0.0) + metric.value
            elif metric.kind == MetricKind.GAUGE:
                self._gauges[key] = metric.value
            else:
                timing = self._timings.setdefault(key, _Timing())
                timing.count += 1
                timing.total += metric.value
                timing.maximum = max(timing.maximum, metric.value)

    def __enter__(self) -> MetricsCollector:
        add_metrics_handler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        remove_metrics_handler(self)

    def counter(self, name: str, **labels: str) -> float:
        """The sum of counter ``name`` over the label sets that contain ``labels``."""
        with self._lock:
            return sum(v for key, v in self._counters.items() if _matches(key, name, labels))

    def timings(self, name: str, **labels: str) -> tuple[int, float, float]:
        """``(count, total seconds, longest)`` of timing ``name`` over the label sets that
        contain ``labels``."""
        with self._lock:
            found = [t for key, t in self._timings.items() if _matches(key, name, labels)]
        return (
            sum(t.count for t in found),
            sum(t.total for t in found),
            max((t.maximum for t in found), default=0.0),
        )

    def gauge(self, name: str, **labels: str) -> float | None:
        """The last value of gauge ``name`` with ``labels`` among its labels, if any."""
        with self._lock:
            found = [v for key, v in self._gauges.items() if _matches(key, name, labels)]
        return found[-1] if found else None

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Everything collected, JSON-serialisable: ``counters``, ``gauges`` and
        ``timings``, each a list of ``{"name", "labels", ...}``."""
        with self._lock:
            return {
                "counters": [
                    {"name": n, "labels": dict(labels), "value": v}
                    for (n, labels), v in sorted(self._counters.items())
                ],
                "gauges": [
                    {"name": n, "labels": dict(labels), "value": v}
                    for (n, labels), v in sorted(self._gauges.items())
                ],
                "timings": [
                    {
                        "name": n,
                        "labels": dict(labels),
                        "count": t.count,
                        "total": t.total,
                        "max": t.maximum,
                    }
                    for (n, labels), t in sorted(self._timings.items(), key=lambda item: item[0])
                ],
            }


def _matches(key: _Key, name: str, labels: Mapping[str, str]) -> bool:
    have = dict(key[1])
    return key[0] == name and all(have.get(k) == v for k, v in labels.items())
