"""What the benchmark scripts share: a round of worker processes.

(etcd's request counters are read and classified by ``tests/etcd_requests.py``, which
the request-count test shares.)

* :func:`ready_workers` starts N worker processes (``tests/rdzv_helpers.Worker``) and
  waits until each is connected; :func:`join_round` then tells them to join at once and
  times the rendezvous from the first ``join`` to the last rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

__all__ = ["Worker", "join_round", "ready_workers"]


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
