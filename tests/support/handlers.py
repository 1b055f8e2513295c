"""Our ``etcd-v2`` handlers run as threads of the test process (the ``handlers`` fixture
makes them)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from etcd_rendezvous.api import RendezvousInfo, RendezvousParameters
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend, create_backend

__all__ = ["backend_of", "join_in", "make_handler"]

#: The backend of each handler :func:`make_handler` made.
_BACKENDS: weakref.WeakKeyDictionary[Any, EtcdRendezvousBackend] = weakref.WeakKeyDictionary()


def make_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """One of our ``etcd-v2`` handlers, made as the registry makes it (the handler owns
    its backend); :func:`backend_of` finds its backend."""
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params, backend_name=params.backend, owns_backend=True)
    _BACKENDS[handler] = backend
    return handler


def backend_of(handler: Any) -> EtcdRendezvousBackend:
    """The etcd backend of a handler :func:`make_handler` made."""
    return _BACKENDS[handler]


def join_in(pool: ThreadPoolExecutor, group: Sequence[Any]) -> list[Future[RendezvousInfo]]:
    """Every handler of ``group`` calls ``next_rendezvous()`` in a thread of ``pool``."""
    return [pool.submit(handler.next_rendezvous) for handler in group]
