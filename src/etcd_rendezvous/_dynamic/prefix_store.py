"""The store a rendezvous round hands out: the agent's store, every key under the round's prefix.

:func:`prefix_store` wraps a PyTorch store in PyTorch's ``PrefixStore`` and any other in
:class:`PrefixStore`, its equivalent without PyTorch. The prefix is
:func:`etcd_rendezvous.layout.dynamic_store_prefix`.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from ..api import Store

__all__ = ["PrefixStore", "prefix_store"]


class PrefixStore:
    """A c10d ``PrefixStore`` without torch: every key becomes ``prefix + "/" + key``.

    Wraps any :class:`~etcd_rendezvous.api.Store`. The extended c10d methods are passed
    through when the underlying store has them.

    Args:
        prefix: The prefix, e.g. ``torch.rendezvous.<run_id>.<round>``.
        store: The store that holds the keys.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        self._prefix = prefix
        self._store = store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._prefix!r}, {self._store!r})"

    @property
    def prefix(self) -> str:
        """The prefix prepended to every key (without the ``/``)."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def timeout(self) -> Any:
        """The wrapped store's default timeout."""
        return getattr(self._store, "timeout", None)

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key: str, value: bytes | str, /) -> None:
        """Write ``value`` under the prefixed ``key``."""
        self._store.set(self._key(key), value)

    def get(self, key: str, /) -> bytes:
        """Return the value under the prefixed ``key``, waiting for it if necessary."""
        return self._store.get(self._key(key))

    def add(self, key: str, value: int, /) -> int:
        """Atomically add ``value`` to the counter under the prefixed ``key``."""
        return self._store.add(self._key(key), value)

    def wait(self, keys: list[str], timeout: timedelta | None = None, /) -> None:
        """Block until every prefixed key in ``keys`` is set, or ``timeout`` elapses."""
        prefixed = [self._key(key) for key in keys]
        if timeout is None:
            self._store.wait(prefixed)
        else:
            self._store.wait(prefixed, timeout)

    def check(self, keys: list[str], /) -> bool:
        """Return whether every prefixed key in ``keys`` is set."""
        return self._store.check([self._key(key) for key in keys])

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> Any:
        """Compare-and-set the prefixed ``key`` (needs the underlying store's support)."""
        store: Any = self._store
        return store.compare_set(self._key(key), expected_value, desired_value)

    def delete_key(self, key: str) -> bool:
        """Delete the prefixed ``key`` (needs the underlying store's support)."""
        store: Any = self._store
        return bool(store.delete_key(self._key(key)))

    def append(self, key: str, value: bytes | str) -> None:
        """Append to the prefixed ``key`` (needs the underlying store's support)."""
        store: Any = self._store
        store.append(self._key(key), value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of the prefixed ``keys`` (needs the underlying store's support)."""
        store: Any = self._store
        return list(store.multi_get([self._key(key) for key in keys]))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set the prefixed ``keys`` (needs the underlying store's support)."""
        store: Any = self._store
        store.multi_set([self._key(key) for key in keys], values)

    def num_keys(self) -> int:
        """The underlying store's number of keys, as c10d's ``PrefixStore`` reports it."""
        store: Any = self._store
        return int(store.num_keys())


def prefix_store(prefix: str, store: Store) -> Store:
    """Wrap ``store`` in torch's ``PrefixStore`` if it is a torch store, else ours."""
    # A torch store exists only if torch.distributed was imported; never import it here.
    dist = sys.modules.get("torch.distributed")
    torch_store_type = getattr(dist, "Store", None)
    if torch_store_type is not None and isinstance(store, torch_store_type):
        wrapped: Store = dist.PrefixStore(prefix, store)  # type: ignore[union-attr]
        return wrapped
    return PrefixStore(prefix, store)
