"""The labels of the transport's metrics: the ``op`` an operation is counted under, and
the byte counters ``transport.bytes_sent`` / ``transport.bytes_received``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..metrics import record_metric

__all__ = ["count_bytes", "op_name", "sending"]

#: The ``op`` label of an operation's metrics, by the verb its messages use.
_OPS = {
    "refresh the TTL of": "refresh",
    "create the directory": "mkdir",
    "grant a lease for": "lease_grant",
    "read the lease of": "lease_read",
    "query the version of": "version",
    "query the status of": "status",
}


#: The metric labels (``op``, ``api``) of the operation the current thread is sending:
#: set by :func:`sending` around each attempt, read by :func:`count_bytes`.
_sending = threading.local()


@contextlib.contextmanager
def sending(labels: dict[str, str]) -> Iterator[None]:
    """Count the bytes this thread sends inside the block under ``labels``."""
    outer, _sending.labels = getattr(_sending, "labels", None), labels
    try:
        yield
    finally:
        _sending.labels = outer


def count_bytes(api: str, sent: int, received: int, op: str | None = None) -> None:
    """Count the HTTP body bytes of one request (``sent``) and of its answer
    (``received``) as the metrics ``transport.bytes_sent`` and
    ``transport.bytes_received``, labelled with the ``op`` and ``api`` of the operation
    this thread is sending (``op``, when given, wins; ``other`` outside any)."""
    labels: dict[str, str] = dict(getattr(_sending, "labels", None) or {"api": api})
    labels["op"] = op or labels.get("op", "other")
    if sent:
        record_metric("transport.bytes_sent", sent, **labels)
    if received:
        record_metric("transport.bytes_received", received, **labels)


def op_name(what: str) -> str:
    """The ``op`` label of the metrics of an operation described as ``what``
    (``compare-and-swap`` -> ``compare_and_swap``)."""
    return _OPS.get(what) or what.replace("-", "_").replace(" ", "_")
