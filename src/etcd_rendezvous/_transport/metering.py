"""The labels of the transport's metrics: the ``op`` an operation is counted under, and
the byte counters ``transport.bytes_sent`` / ``transport.bytes_received``."""

from __future__ import annotations

from ..metrics import record_metric

__all__ = ["count_bytes", "op_name"]

#: The ``op`` label of an operation's metrics, by the verb its messages use.
_OPS = {
    "refresh the TTL of": "refresh",
    "create the directory": "mkdir",
    "grant a lease for": "lease_grant",
    "read the lease of": "lease_read",
    "query the version of": "version",
    "query the status of": "status",
    "check the size limit below": "size_check",
}


def count_bytes(sent: int, received: int, *, api: str, op: str) -> None:
    """Count the HTTP body bytes of one request (``sent``) and of its answer
    (``received``) as the metrics ``transport.bytes_sent`` and
    ``transport.bytes_received``, labelled with the ``op`` (see :func:`op_name`) and
    ``api`` of the operation that sent it."""
    if sent:
        record_metric("transport.bytes_sent", sent, op=op, api=api)
    if received:
        record_metric("transport.bytes_received", received, op=op, api=api)


def op_name(what: str) -> str:
    """The ``op`` label of the metrics of an operation described as ``what``
    (``compare-and-swap`` -> ``compare_and_swap``)."""
    return _OPS.get(what) or what.replace("-", "_").replace(" ", "_")
