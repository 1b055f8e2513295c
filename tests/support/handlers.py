"""Our ``etcd-v2`` handlers run as threads of the test process (the ``handlers`` fixture
makes them)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from etcd_rendezvous.api import RendezvousInfo
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

__all__ = ["backend_of", "join_in"]


def backend_of(handler: Any) -> EtcdRendezvousBackend:
    """The etcd backend of one of our dynamic handlers."""
    backend = handler._state_holder._backend
    assert isinstance(backend, EtcdRendezvousBackend)
    return backend


def join_in(pool: ThreadPoolExecutor, group: Sequence[Any]) -> list[Future[RendezvousInfo]]:
    """Every handler of ``group`` calls ``next_rendezvous()`` in a thread of ``pool``."""
    return [pool.submit(handler.next_rendezvous) for handler in group]
