"""What the benchmark scripts share: the handlers of every variant, a round of worker processes.

(etcd's request counters are read and classified by ``tests/support/etcd_requests.py``, which
the request-count test shares.)

* A :class:`Variant` is one row of a table: backend, etcd API, implementation (ours or
  PyTorch's); :func:`variants` lists the rows to measure (PyTorch's on v2 only, which
  is all it speaks), :func:`handler_factory` makes one node's handler of a variant and
  :func:`release` stops its background threads; :class:`ThreadDeaths` counts the
  background threads that die (one line per cause instead of a traceback each).
* :func:`ready_workers` starts N worker processes (``tests/support/rdzv.Worker``) and
  waits until each is connected; :func:`join_round` then tells them to join at once and
  times the rendezvous from the first ``join`` to the last rank.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.registry import get_rendezvous_handler

__all__ = [
    "APIS",
    "BACKENDS",
    "C10D",
    "IMPLS",
    "ThreadDeaths",
    "Variant",
    "Worker",
    "handler_factory",
    "join_round",
    "ready_workers",
    "release",
    "torch_available",
    "variants",
]

BACKENDS = ("etcd", "etcd-v2")
APIS = ("v2", "v3")
IMPLS = ("ours", "torch")
#: PyTorch's own ``c10d`` backend (a TCPStore hosted by the first node that binds the
#: endpoint's port), the alternative to etcd: a row of its own, without an etcd API.
C10D = "c10d"


@dataclass(frozen=True)
class Variant:
    """One row of a table: which backend, API and implementation."""

    backend: str
    api: str
    impl: str


def variants(
    backends: Sequence[str], apis: Sequence[str], impls: Sequence[str]
) -> Iterator[Variant]:
    """The rows to measure: ours on every API, PyTorch's on v2 only; PyTorch's ``c10d``
    (:data:`C10D`, no etcd API: ``-``) once, if asked for with PyTorch's rows."""
    for backend in backends:
        if backend == C10D:
            if "torch" in impls:
                yield Variant(C10D, "-", "torch")
            continue
        for api in apis:
            for impl in impls:
                if impl == "ours" or api == "v2":
                    yield Variant(backend, api, impl)


def _torch_module(name: str) -> Any:
    """``torch.distributed.elastic.rendezvous.<name>``, or ``None`` without torch."""
    try:
        return importlib.import_module(f"torch.distributed.elastic.rendezvous.{name}")
    except ImportError:
        return None


def torch_available() -> bool:
    """Whether PyTorch's rendezvous package can be imported."""
    return _torch_module("api") is not None


def handler_factory(
    variant: Variant,
    endpoint: str,
    nodes: int,
    options: Mapping[str, str],
    *,
    plain: bool = False,
) -> Callable[[str], Any]:
    """A function making one node's handler of ``variant`` for a run id, with
    ``min_nodes = max_nodes = nodes`` and the backend ``options`` (strings, as
    torchrun passes them).

    Unless ``plain``, our handlers also get what the benchmarks choose: ``local_addr``
    127.0.0.1 (rank 0 publishes it without resolving its host name), the ``etcd_api``
    of the variant (no probe of the server) and ``torch_store=false`` (PyTorch is not
    imported). ``plain``: only the parameters a user must give, as a launcher would.
    """
    common: dict[str, Any] = {
        "backend": variant.backend,
        "endpoint": endpoint,
        "min_nodes": nodes,
        "max_nodes": nodes,
        **({} if plain else {"local_addr": "127.0.0.1"}),
        **options,
    }
    if variant.impl == "ours":
        chosen = {} if plain else {"etcd_api": variant.api, "torch_store": "false"}
        return lambda run_id: get_rendezvous_handler(
            RendezvousParameters(run_id=run_id, **common, **chosen)
        )
    torch_api = _torch_module("api")
    if variant.backend == C10D:
        c10d = _torch_module("c10d_rendezvous_backend")
        dynamic_module = _torch_module("dynamic_rendezvous")

        def create_c10d(run_id: str) -> Any:
            params = torch_api.RendezvousParameters(run_id=run_id, **common)
            backend, store = c10d.create_backend(params)
            return dynamic_module.create_handler(store, backend, params)

        return create_c10d
    if variant.backend == "etcd":
        legacy = _torch_module("etcd_rendezvous")
        # It logs every step of every node to stderr at INFO, on a handler of its own.
        logging.getLogger(legacy.__name__).setLevel(logging.WARNING)
        return lambda run_id: legacy.create_rdzv_handler(
            torch_api.RendezvousParameters(run_id=run_id, **common)
        )
    backend_module = _torch_module("etcd_rendezvous_backend")
    dynamic = _torch_module("dynamic_rendezvous")

    def create_dynamic(run_id: str) -> Any:
        params = torch_api.RendezvousParameters(run_id=run_id, **common)
        backend, store = backend_module.create_backend(params)
        return dynamic.create_handler(store, backend, params)

    return create_dynamic


def release(handler: Any, impl: str) -> None:
    """Stop ``handler``'s background threads, so that they send nothing more to etcd
    (without closing the rendezvous, which is a write): as if its process had died."""
    if impl == "ours":
        handler.close()
        return
    # PyTorch's handlers have no close(): stop their threads as their own __del__
    # (legacy) and shutdown() (dynamic) do.
    impl_ = getattr(handler, "_rdzv_impl", None)
    if impl_ is not None:
        for stop in (impl_._lease_run_id_stop, impl_._lease_this_rank_stop):
            if stop is not None:
                stop.set()
    else:
        handler._stop_heartbeats()


class ThreadDeaths:
    """Counts the exceptions that kill background threads, instead of printing a
    traceback for each (PyTorch's legacy backend has one thread per node that dies on
    etcd 3.5: it cannot refresh a directory's TTL). Install as ``threading.excepthook``."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        # One line per kind of failure, whatever run it happened in.
        what = re.sub(r"run_[\w.-]+", "run_<id>", f"{args.exc_type.__name__}: {args.exc_value}")
        with self._lock:
            self.seen[what] = self.seen.get(what, 0) + 1

    def add(self, seen: Mapping[str, int]) -> None:
        """Add the deaths counted elsewhere (in another process)."""
        with self._lock:
            for what, count in seen.items():
                self.seen[what] = self.seen.get(what, 0) + count

    def report(self) -> None:
        """Print one line per cause of death."""
        for what, count in sorted(self.seen.items()):
            print(f"note: {count} background thread(s) died of {what}")


class Worker(Protocol):
    """What :func:`join_round` needs of ``tests/support/rdzv.Worker``."""

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
