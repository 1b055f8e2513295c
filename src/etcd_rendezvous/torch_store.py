"""A real ``torch.distributed.Store`` over :class:`~etcd_rendezvous.etcd_store.EtcdStore`.

This module imports PyTorch; nothing else in the package does at import time. The
handlers return a :class:`TorchEtcdStore` in ``RendezvousInfo.store`` when PyTorch is
installed (the ``torch_store`` option), so the store works wherever PyTorch expects its
own, e.g. ``torch.distributed.init_process_group(store=...)``. Keys and values are
stored exactly as :class:`EtcdStore` stores them, the layout of PyTorch's ``EtcdStore``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from ._transport.interface import Transport
from .etcd_store import EtcdStore, KeyLike

__all__ = ["StoreTimeoutError", "TorchEtcdStore"]


class StoreTimeoutError(LookupError, dist.DistStoreError):  # type: ignore[misc]
    """A key was not set in time, or an update kept losing races until the timeout: both
    the ``LookupError`` that :class:`EtcdStore` (and PyTorch's ``EtcdStore``) raise and
    the ``DistStoreError`` that PyTorch's own stores raise, so handlers written for
    either catch it."""


@contextmanager
def _timeout_as_store_error() -> Iterator[None]:
    """Turn :class:`EtcdStore`'s timeout (a plain ``LookupError``) into StoreTimeoutError."""
    try:
        yield
    except LookupError as exc:
        if type(exc) is not LookupError:  # e.g. a KeyError: a bug, not a timeout
            raise
        raise StoreTimeoutError(str(exc)) from exc


class TorchEtcdStore(dist.Store):  # type: ignore[misc]  # torch is not type-checked here
    """A ``torch.distributed.Store`` whose operations are those of an :class:`EtcdStore`.

    c10d calls the methods below from C++ (through PyTorch's Python store trampoline),
    so the store works with any process group backend that talks to a store, such as
    gloo. Operations that :class:`EtcdStore` lacks (queues, ``list_keys``) raise
    PyTorch's "not implemented" error.

    Args:
        store: the etcd-backed store to expose.

    Raises:
        TypeError: ``store`` is not an :class:`EtcdStore`.
    """

    def __init__(self, store: EtcdStore) -> None:
        if not isinstance(store, EtcdStore):
            raise TypeError(f"store: expected an EtcdStore, got {type(store).__name__}.")
        super().__init__()
        self._store = store
        # Keep the C++ side's notion of the timeout (the ``timeout`` property) in step.
        super().set_timeout(store.timeout)

    def __repr__(self) -> str:
        return f"TorchEtcdStore({self._store!r})"

    @property
    def etcd_store(self) -> EtcdStore:
        """The underlying :class:`EtcdStore`."""
        return self._store

    @property
    def prefix(self) -> str:
        """The etcd directory of the keys (:attr:`EtcdStore.prefix`)."""
        return self._store.prefix

    @property
    def connection(self) -> Transport:
        """The etcd connection (:attr:`EtcdStore.connection`)."""
        return self._store.connection

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default timeout of :meth:`get` and :meth:`wait`."""
        self._store.set_timeout(timeout)
        super().set_timeout(timeout)

    def set(self, key: KeyLike, value: KeyLike) -> None:
        """Write ``value`` under ``key``."""
        self._store.set(key, value)

    def get(self, key: KeyLike) -> bytes:
        """Return the value of ``key``, waiting up to the timeout for it to be set.

        Raises:
            StoreTimeoutError: ``key`` was not set within the timeout.
        """
        with _timeout_as_store_error():
            return self._store.get(key)

    def add(self, key: KeyLike, num: int) -> int:
        """Atomically add ``num`` to the counter ``key`` and return the new value.

        Raises:
            StoreTimeoutError: other writers kept changing ``key`` first until the timeout.
        """
        with _timeout_as_store_error():
            return self._store.add(key, num)

    def compare_set(self, key: KeyLike, expected_value: KeyLike, desired_value: KeyLike) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return its value.

        Raises:
            StoreTimeoutError: other writers kept changing ``key`` first until the timeout.
        """
        with _timeout_as_store_error():
            return self._store.compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[KeyLike], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` is set, or ``timeout`` (default: the
        store's timeout) elapses.

        Raises:
            StoreTimeoutError: some keys were still missing at the timeout.
        """
        with _timeout_as_store_error():
            self._store.wait(keys, timeout)

    def check(self, keys: Sequence[KeyLike]) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        return self._store.check(keys)

    def delete_key(self, key: KeyLike) -> bool:
        """Delete ``key``; return whether it existed."""
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        """The number of keys in the store."""
        return self._store.num_keys()

    def append(self, key: KeyLike, value: KeyLike) -> None:
        """Append ``value`` to the value of ``key`` (creating it if absent).

        Raises:
            StoreTimeoutError: other writers kept changing ``key`` first until the timeout.
        """
        with _timeout_as_store_error():
            self._store.append(key, value)

    def multi_get(self, keys: Sequence[KeyLike]) -> list[bytes]:
        """Return the values of ``keys``, waiting for each to be set.

        Raises:
            StoreTimeoutError: some keys were not set within the timeout.
        """
        with _timeout_as_store_error():
            return self._store.multi_get(keys)

    def multi_set(self, keys: Sequence[KeyLike], values: Sequence[KeyLike]) -> None:
        """Write each of ``values`` under the key at the same position in ``keys``."""
        self._store.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        """``True``: :meth:`append`, :meth:`multi_get` and :meth:`multi_set` are supported."""
        return True
