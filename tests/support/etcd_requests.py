"""Count the etcd requests of an interval from etcd's Prometheus ``/metrics`` page.

Shared by the benchmarks (``benchmarks/``) and the tests (the request-count regression
test ``tests/integration/test_scale.py``; :func:`counter` for one metric)::

    before = read_metrics(server.client_url)
    ...  # the rendezvous
    requests = requests_since(server.client_url, before)
    requests.writes / nodes, requests.reads / nodes

Every request lands in one class:

* **v2** (``etcd_http_received_total`` by ``method``): reads are GETs, writes PUT, POST
  and DELETE. Watches (GETs with ``wait=true``) are not in that counter; etcd's v2 store
  counts them in ``etcd_debugging_store_watch_requests_total`` (reads). TTL refreshes
  (PUTs that the store records as ``action="update"``, even when they fail) are
  **keep-alive**, not writes. The only other updates, of this library's ``etcd-v2``
  nodes rewriting their own key to leave a round (one per node and re-rendezvous),
  cannot be told apart from them in etcd's v2 counters: they are keep-alive too there
  (on v3 they are Txn writes).
* **v3** (``grpc_server_started_total`` by ``grpc_method``): reads Range, Watch (a
  stream per wait) and LeaseTimeToLive; writes Put, Txn, DeleteRange, LeaseGrant and
  LeaseRevoke; **keep-alive** LeaseKeepAlive.

A request of any other kind goes to :attr:`Requests.other`, so nothing goes uncounted.
Reading ``/metrics`` is not itself counted by any of these counters.

Bytes (v3 only, :func:`bytes_since`): ``etcd_network_client_grpc_sent_bytes_total`` and
``etcd_network_client_grpc_received_bytes_total`` count the protobuf bytes between
etcd's gRPC server and its clients, the JSON gateway inside etcd included (so a value
costs its raw size there, not the gateway's base64). etcd counts no bytes of its v2
API: there the transport's own counters (``transport.bytes_received`` and
``transport.bytes_sent`` of :mod:`etcd_rendezvous.metrics`) are the measurement.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import urllib3

__all__ = [
    "Bytes",
    "Requests",
    "bytes_since",
    "changes",
    "count_bytes",
    "count_requests",
    "counter",
    "read_metrics",
    "requests_since",
    "samples",
]

_POOL = urllib3.PoolManager(retries=False)
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

#: The counters of requests by API: (API, metric, the label holding the method).
_COUNTERS = (
    ("v2", "etcd_http_received_total", "method"),
    ("v3", "grpc_server_started_total", "grpc_method"),
)
#: v2 watches, which ``etcd_http_received_total`` leaves out.
_V2_WATCHES = "etcd_debugging_store_watch_requests_total"
#: v2 store writes by action; ``update`` is a TTL refresh (or a node leaving a round).
_V2_STORE_WRITES = "etcd_debugging_store_writes_total"
#: The bytes etcd's gRPC server sent to and received from its clients (v3).
_GRPC_SENT = "etcd_network_client_grpc_sent_bytes_total"
_GRPC_RECEIVED = "etcd_network_client_grpc_received_bytes_total"

_READ, _WRITE, _KEEPALIVE = "reads", "writes", "keepalives"
#: The class of each request, by the name :func:`count_requests` gives it.
_CLASSES = {
    "v2 GET": _READ,
    "v2 GET wait": _READ,
    "v2 PUT": _WRITE,
    "v2 POST": _WRITE,
    "v2 DELETE": _WRITE,
    "v2 PUT refresh": _KEEPALIVE,
    "v3 Range": _READ,
    "v3 Watch": _READ,
    "v3 LeaseTimeToLive": _READ,
    "v3 Put": _WRITE,
    "v3 Txn": _WRITE,
    "v3 DeleteRange": _WRITE,
    "v3 LeaseGrant": _WRITE,
    "v3 LeaseRevoke": _WRITE,
    "v3 LeaseKeepAlive": _KEEPALIVE,
}


def read_metrics(client_url: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of etcd's ``/metrics`` page: ``'name{label="x",...}'`` -> value."""
    response = _POOL.request("GET", client_url + "/metrics", timeout=urllib3.Timeout(timeout))
    if response.status != 200:
        raise AssertionError(f"GET {client_url}/metrics answered HTTP {response.status}")
    values = {}
    for line in response.data.decode().splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            values[sample] = float(value)
    return values


def changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The samples whose value changed from ``before`` to ``after``, with the difference."""
    return {
        sample: value - before.get(sample, 0.0)
        for sample, value in after.items()
        if value != before.get(sample, 0.0)
    }


def samples(values: dict[str, float], name: str) -> Iterator[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` in ``values``, as ``(labels, value)``."""
    for sample, value in values.items():
        match = _SAMPLE.match(sample)
        if match is not None and match["name"] == name:
            yield dict(_LABEL.findall(match["labels"] or "")), value


def counter(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` in ``values`` whose labels include
    ``labels`` (0 if there are none)."""
    return sum(
        value
        for found, value in samples(values, name)
        if all(found.get(k) == v for k, v in labels.items())
    )


@dataclass(frozen=True)
class Requests:
    """The etcd requests of one interval, as totals (divide by the node count for a
    per-node figure)."""

    reads: float
    writes: float
    keepalives: float
    #: Requests of no known class, by name ("v3 Compact": 1).
    other: dict[str, float]
    #: Every request by API and method ("v3 Txn": 12, "v2 PUT refresh": 8).
    by_method: dict[str, float]

    def describe(self, nodes: float = 1) -> str:
        """Every request by method, per node (divided by ``nodes``):
        ``"v2 GET 3.1, v2 PUT 2.0, ..."``."""
        return ", ".join(f"{name} {value / nodes:.1f}" for name, value in self.by_method.items())


def _by_method(delta: dict[str, float]) -> dict[str, float]:
    """The requests in ``delta`` by name ("v2 GET", "v3 Txn", ...), watches and TTL
    refreshes of v2 split off from its GETs and PUTs."""
    by_method: dict[str, float] = {}
    for api, metric, label in _COUNTERS:
        for labels, value in samples(delta, metric):
            by_method[f"{api} {labels.get(label, '')}"] = value
    for _, value in samples(delta, _V2_WATCHES):
        by_method["v2 GET wait"] = value
    for labels, value in samples(delta, _V2_STORE_WRITES):
        if labels.get("action") == "update":
            by_method["v2 PUT"] = by_method.get("v2 PUT", 0.0) - value
            by_method["v2 PUT refresh"] = value
    return {name: value for name, value in sorted(by_method.items()) if value}


def count_requests(delta: dict[str, float]) -> Requests:
    """Classify the counters that changed during an interval (see the module docstring).

    Both APIs' counters are read: a server may serve both, and a client's requests all
    land in the counters of the API it speaks.
    """
    by_method = _by_method(delta)
    totals = dict.fromkeys((_READ, _WRITE, _KEEPALIVE), 0.0)
    other: dict[str, float] = {}
    for name, value in by_method.items():
        kind = _CLASSES.get(name)
        if kind is None:
            other[name] = value
        else:
            totals[kind] += value
    return Requests(totals[_READ], totals[_WRITE], totals[_KEEPALIVE], other, by_method)


def requests_since(client_url: str, before: dict[str, float]) -> Requests:
    """The requests etcd at ``client_url`` received since ``before`` was read from it
    (with :func:`read_metrics`)."""
    return count_requests(changes(before, read_metrics(client_url)))


@dataclass(frozen=True)
class Bytes:
    """The bytes etcd's gRPC server exchanged with its clients in one interval, as
    totals (the v3 API and its JSON gateway; 0 for the v2 API, which etcd does not
    count)."""

    #: Bytes etcd sent: the answers and watch events its clients received.
    sent: float
    #: Bytes etcd received: its clients' requests.
    received: float


def count_bytes(delta: dict[str, float]) -> Bytes:
    """The gRPC byte counters that changed during an interval (from :func:`changes`)."""
    return Bytes(counter(delta, _GRPC_SENT), counter(delta, _GRPC_RECEIVED))


def bytes_since(client_url: str, before: dict[str, float]) -> Bytes:
    """The bytes etcd at ``client_url`` exchanged with its gRPC clients since
    ``before`` was read from it (with :func:`read_metrics`)."""
    return count_bytes(changes(before, read_metrics(client_url)))


def server_cpu(delta: dict[str, float]) -> float:
    """The CPU seconds etcd's process used during an interval (from :func:`changes`):
    its ``process_cpu_seconds_total``."""
    return counter(delta, "process_cpu_seconds_total")
