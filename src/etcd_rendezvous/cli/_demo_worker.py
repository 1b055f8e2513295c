"""What each worker process of ``etcd-rendezvous demo`` runs.

A worker creates a rendezvous handler from the parameters the parent hands it, calls
``next_rendezvous()``, exchanges a value with every other rank through the returned
store and reports to the parent on a queue. Rank 0 closes the rendezvous once every
rank is done with the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._progress_log import PROGRESS_THREAD_PREFIX
from ..api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStoreInfo,
    Store,
)
from ..dynamic_rendezvous import create_handler
from ..etcd_rendezvous import EtcdRendezvousHandler, create_rdzv_handler
from ..etcd_rendezvous_backend import create_backend
from ..layout import dynamic_store_round

__all__ = [
    "WorkerDone",
    "WorkerFailed",
    "WorkerJoined",
    "WorkerReport",
    "WorkerResult",
    "demo_store_keys",
    "demo_worker",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerResult:
    """What one worker reports once it has rendezvoused and used the store."""

    index: int
    pid: int
    rank: int
    world_size: int
    version: str
    join_seconds: float
    #: Whether the worker read every rank's value, each naming the right rank.
    values_ok: bool
    #: The shared counter every rank incremented once, read after all values were set.
    counter: int


@dataclass(frozen=True)
class WorkerJoined:
    """A worker's rendezvous completed: its rank, the world size, and how long it took."""

    index: int
    rank: int
    world_size: int
    join_seconds: float


@dataclass(frozen=True)
class WorkerDone:
    """A worker finished; its last report."""

    index: int
    result: WorkerResult


@dataclass(frozen=True)
class WorkerFailed:
    """A worker failed; its last report, with the error."""

    index: int
    message: str


#: What a worker puts on the demo's queue: joined, then done or failed.
WorkerReport = WorkerJoined | WorkerDone | WorkerFailed


def demo_worker(index: int, config: dict[str, Any], events: Any) -> None:
    """Entry point of a worker process: rendezvous, exchange values, report on ``events``.

    Puts :class:`WorkerJoined`, then :class:`WorkerDone` or :class:`WorkerFailed`.
    """
    # Ctrl-C reaches the whole process group; the parent handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_format = f"[worker {index}] %(asctime)s %(name)s %(levelname)s: %(message)s"
    if config.pop("verbose", False):
        logging.basicConfig(level=logging.INFO, format=log_format)
    else:
        # Without -v, only the progress lines of a waiting rendezvous (their thread says
        # which they are): they show what a worker that waits is waiting for.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(log_format))
        handler.addFilter(
            lambda record: (record.threadName or "").startswith(PROGRESS_THREAD_PREFIX)
        )
        library = logging.getLogger("etcd_rendezvous")
        library.addHandler(handler)
        library.setLevel(logging.INFO)
    start_delay = float(config.pop("start_delay", 0.0))
    if start_delay:
        time.sleep(start_delay)  # --stagger: the demo starts the workers one by one
    try:
        events.put(WorkerDone(index, _run_worker(index, config, events)))
    except RendezvousError as exc:
        events.put(WorkerFailed(index, f"{type(exc).__name__}: {exc}"))
    except Exception as exc:
        logger.debug("worker %d failed", index, exc_info=True)
        events.put(WorkerFailed(index, f"unexpected {type(exc).__name__}: {exc}"))


def _run_worker(index: int, config: dict[str, Any], events: Any) -> WorkerResult:
    timeout = float(config["timeout"])
    started = time.monotonic()
    params = RendezvousParameters(**config)
    dynamic = params.backend == "etcd-v2"
    if dynamic:
        # With PyTorch installed, rank 0 of a dynamic rendezvous would import it to host
        # a TCPStore for trainers; the demo has none, so it stays torch-free and quick.
        os.environ.setdefault(_DISABLE_SHARED_STORE_ENV, "1")
    with _demo_handler(params) as handler:
        info = handler.next_rendezvous()
        join_seconds = time.monotonic() - started
        rank, world_size = info.rank, info.world_size
        version = _rendezvous_version(handler, info.store)
        events.put(WorkerJoined(index, rank, world_size, join_seconds))

        # Count ourselves first and publish our value second: once every value is
        # visible, every increment has been applied and the counter must equal world_size.
        store = info.store
        store.add(_ARRIVED_KEY, 1)
        store.set(_value_key(rank), f"rank={rank} pid={os.getpid()}".encode())
        keys = [_value_key(r) for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout))
        values = [store.get(key).decode() for key in keys]
        values_ok = all(value.startswith(f"rank={r} ") for r, value in enumerate(values))
        counter = store.add(_ARRIVED_KEY, 0)

        # shutdown() closes the rendezvous for everybody, so rank 0 does it only once
        # every rank is done with the store; the others just release their resources.
        store.set(_done_key(rank), b"1")
        if rank == 0:
            store.wait([_done_key(r) for r in range(world_size)], timedelta(seconds=timeout))
            handler.shutdown()
            if dynamic:
                store.set(_CLOSED_KEY, b"1")
        elif dynamic:
            # A dynamic handler has no close(): shutdown() is its only public way to stop
            # the keep-alive thread, and it closes the rendezvous too. Once rank 0 has
            # closed it, that part is a no-op (one read that finds the state closed).
            store.wait([_CLOSED_KEY], timedelta(seconds=timeout))
            handler.shutdown()
    return WorkerResult(
        index=index,
        pid=os.getpid(),
        rank=rank,
        world_size=world_size,
        version=version,
        join_seconds=join_seconds,
        values_ok=values_ok,
        counter=counter,
    )


#: Store keys of the demo's value exchange (below the rendezvous's own store prefix).
_ARRIVED_KEY = "demo/arrived"


_CLOSED_KEY = "demo/closed"


#: PyTorch's switch for rank 0 hosting a shared TCPStore in a dynamic rendezvous.
_DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _value_key(rank: int) -> str:
    return f"demo/rank_{rank}"


def _done_key(rank: int) -> str:
    return f"demo/done_{rank}"


def demo_store_keys(world_size: int) -> list[str]:
    """Every store key a demo round of ``world_size`` workers may write (for clean-up)."""
    keys = [
        RendezvousStoreInfo.MASTER_ADDR_KEY,
        RendezvousStoreInfo.MASTER_PORT_KEY,
        _ARRIVED_KEY,
        _CLOSED_KEY,
    ]
    for rank in range(world_size):
        keys += [_value_key(rank), _done_key(rank)]
    return keys


@contextlib.contextmanager
def _demo_handler(params: RendezvousParameters) -> Iterator[RendezvousHandler]:
    """The worker's handler for ``params.backend``, its connection released on exit.

    Leaving the block does not close the rendezvous; the worker decides that.
    """
    if params.backend != "etcd-v2":
        with create_rdzv_handler(params) as handler:
            yield handler
        return
    # Built from its parts, as the registry does, to keep hold of the connection.
    backend, store = create_backend(params)
    try:
        yield create_handler(store, backend, params)
    finally:
        backend.connection.close()


def _rendezvous_version(handler: RendezvousHandler, store: Store) -> str:
    """The version (``etcd``) or round (``etcd-v2``) of the rendezvous just completed."""
    if isinstance(handler, EtcdRendezvousHandler):
        _, state = handler.rendezvous.get_rdzv_state()
        return str(state.get("version", "?"))
    # A dynamic rendezvous scopes the store of round R to the key prefix
    # ``torch.rendezvous.<run_id>.<R>``, which the returned store exposes as ``prefix``.
    prefix = getattr(store, "prefix", None)
    round_ = (
        None if not isinstance(prefix, str) else dynamic_store_round(prefix, handler.get_run_id())
    )
    return "?" if round_ is None else str(round_)
