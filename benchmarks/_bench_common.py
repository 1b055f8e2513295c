"""What the benchmark scripts share: etcd's request counters, and a round of worker processes.

* :func:`read_metrics` reads every sample of etcd's Prometheus ``/metrics`` page;
  :func:`changes` is what changed between two readings, and :func:`samples` picks one
  metric's samples with their labels, so a script can count requests by method.
* :func:`ready_workers` starts N worker processes (``tests/rdzv_helpers.Worker``) and
  waits until each is connected; :func:`join_round` then tells them to join at once and
  times the rendezvous from the first ``join`` to the last rank.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import urllib3

__all__ = ["Worker", "changes", "join_round", "read_metrics", "ready_workers", "samples"]

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read_metrics(client_url: str) -> dict[str, float]:
    """Every sample of etcd's ``/metrics`` page: ``'name{label="x",...}'`` -> value."""
    response = urllib3.PoolManager().request("GET", client_url + "/metrics", retries=False)
    if response.status != 200:
        raise RuntimeError(f"GET {client_url}/metrics answered {response.status}")
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


class Worker(Protocol):
    """What :func:`join_round` needs of ``tests/rdzv_helpers.Worker``."""

    @property
    def stderr(self) -> str: ...

    def send(self, command: str) -> None: ...

    def next_event(self, timeout: float = 60.0) -> dict[str, Any]: ...

    def wait_ready(self, timeout: float = 60.0) -> None: ...

    def stop(self) -> None: ...


@contextlib.contextmanager
def ready_workers(
    make_worker: Callable[[], Worker], count: int, timeout: float = 300.0
) -> Iterator[list[Worker]]:
    """``count`` workers made by ``make_worker``, each connected; stopped on exit."""
    workers: list[Worker] = []
    try:
        workers.extend(make_worker() for _ in range(count))
        for worker in workers:
            worker.wait_ready(timeout=timeout)
        yield workers
    finally:
        for worker in workers:
            worker.stop()


def join_round(workers: Sequence[Worker], timeout: float = 300.0) -> float:
    """Tell every worker to join at once; seconds from the first ``join`` to the last rank.

    Raises:
        RuntimeError: a worker failed, or the ranks are not ``0 .. len(workers) - 1``.
    """
    started = time.monotonic()
    for worker in workers:
        worker.send("join")
    ranks = set()
    for worker in workers:
        event = worker.next_event(timeout=timeout)
        if event["event"] != "joined":
            raise RuntimeError(f"worker failed: {event}\n{worker.stderr}")
        ranks.add(event["rank"])
    elapsed = time.monotonic() - started
    if ranks != set(range(len(workers))):
        raise RuntimeError(f"bad ranks: {sorted(ranks)}")
    return elapsed
