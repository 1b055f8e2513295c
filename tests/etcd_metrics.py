"""Reading an etcd server's Prometheus ``/metrics`` page, to count requests in tests.

:func:`read_metrics` takes a snapshot; :func:`counter` sums the samples of one metric
whose labels match. The difference between two snapshots is what etcd did meanwhile::

    before = read_metrics(server.client_url)
    ...
    after = read_metrics(server.client_url)
    starts = counter(after, "grpc_server_started_total", grpc_method="Watch") - counter(
        before, "grpc_server_started_total", grpc_method="Watch"
    )
"""

from __future__ import annotations

import re

import urllib3

__all__ = ["counter", "read_metrics"]

_POOL = urllib3.PoolManager(retries=False)
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def read_metrics(client_url: str, timeout: float = 5.0) -> dict[str, float]:
    """Every sample of the ``/metrics`` page at ``client_url``: ``'name{l="x"}'`` -> value."""
    response = _POOL.request("GET", client_url + "/metrics", timeout=urllib3.Timeout(timeout))
    if response.status != 200:
        raise AssertionError(f"GET {client_url}/metrics answered HTTP {response.status}")
    values: dict[str, float] = {}
    for line in response.data.decode().splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            values[sample] = float(value)
    return values


def counter(values: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` in ``values`` whose labels include
    ``labels`` (0 if there are none)."""
    total = 0.0
    for sample, value in values.items():
        match = _SAMPLE.match(sample)
        if match is None or match["name"] != name:
            continue
        found = dict(_LABEL.findall(match["labels"] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += value
    return total
