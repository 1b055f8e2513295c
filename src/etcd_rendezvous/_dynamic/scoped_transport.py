"""The etcd-v2 backend's connection, with a deadline per thread.

The transport takes each operation's deadline as an argument. The dynamic rendezvous
still sets its deadlines for a block of backend calls (:meth:`ScopedTransport.bounded_by`,
reached through :meth:`RendezvousBackend.bounded_by
<etcd_rendezvous._dynamic.backend.RendezvousBackend.bounded_by>`): this connection adds
that block's deadline to every operation made inside it, as the earlier of it and the
operation's own. Only the etcd-v2 backend (:mod:`etcd_rendezvous._dynamic.etcd_backend`)
makes one, around the connection it opens or is given, and shares it with its store.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .._transport.clock import ServerClock
from .._transport.interface import Node, Transport, WatchStream
from ..api import Deadline

__all__ = ["ScopedTransport", "scoped"]


def scoped(conn: Transport) -> ScopedTransport:
    """``conn`` with a deadline per thread (itself if it has one already)."""
    return conn if isinstance(conn, ScopedTransport) else ScopedTransport(conn)


class ScopedTransport(Transport):
    """``inner``, whose operations also end by the deadline of the calling thread's
    innermost :meth:`bounded_by` block. Closing it closes ``inner``."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.api = inner.api
        self._scope = threading.local()

    @contextlib.contextmanager
    def bounded_by(self, deadline: Deadline) -> Iterator[None]:
        """Bound every operation this thread makes inside the block by ``deadline``
        (blocks nest; the earliest deadline wins)."""
        outer: Deadline | None = getattr(self._scope, "deadline", None)
        self._scope.deadline = deadline if outer is None else outer.earlier(deadline)
        try:
            yield
        finally:
            self._scope.deadline = outer

    def _bound(self, deadline: Deadline | None) -> Deadline | None:
        """The earlier of ``deadline`` and this thread's block's (``None``: neither)."""
        scope: Deadline | None = getattr(self._scope, "deadline", None)
        if scope is None or deadline is None:
            return deadline if scope is None else scope
        return scope.earlier(deadline)

    def __repr__(self) -> str:
        return repr(self._inner)

    # -- what the connection was given ------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """See base class."""
        return self._inner.endpoints

    @property
    def read_timeout(self) -> float:
        """See base class."""
        return self._inner.read_timeout

    @property
    def request_timeout(self) -> float:
        """See base class."""
        return self._inner.request_timeout

    @property
    def silence_timeout(self) -> float:
        """See base class."""
        return self._inner.silence_timeout

    @property
    def connect_timeout(self) -> float:
        """See base class."""
        return self._inner.connect_timeout

    @property
    def last_index(self) -> int:
        """See base class."""
        return self._inner.last_index

    @property
    def clock(self) -> ServerClock:
        """See base class."""
        return self._inner.clock

    @property
    def closed(self) -> bool:
        """See base class."""
        return self._inner.closed

    def close(self) -> None:
        """See base class."""
        self._inner.close()

    # -- the operations, each ending by the block's deadline too ------------------------

    def server_version(self, *, deadline: Deadline | None = None) -> str:
        """See base class."""
        return self._inner.server_version(deadline=self._bound(deadline))

    def can_refresh_directory_ttl(self, *, deadline: Deadline | None = None) -> bool:
        """See base class."""
        return self._inner.can_refresh_directory_ttl(deadline=self._bound(deadline))

    def get(self, key: str, *, deadline: Deadline | None = None) -> Node:
        """See base class."""
        return self._inner.get(key, deadline=self._bound(deadline))

    def list_dir(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> Node:
        """See base class."""
        return self._inner.list_dir(key, recursive=recursive, deadline=self._bound(deadline))

    def watch(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool = False
    ) -> Node | None:
        """See base class."""
        bound = self._bound(deadline) or deadline
        return self._inner.watch(key, index, bound, recursive=recursive)

    def watch_stream(
        self,
        key: str,
        start_index: int,
        *,
        recursive: bool = False,
        deadline: Deadline | None = None,
    ) -> WatchStream:
        """See base class: the stream's waits end by the block's deadline too."""
        stream = self._inner.watch_stream(
            key, start_index, recursive=recursive, deadline=self._bound(deadline)
        )
        return _ScopedStream(stream, self)

    def check_writable(self, prefix: str, *, deadline: Deadline | None = None) -> None:
        """See base class."""
        self._inner.check_writable(prefix, deadline=self._bound(deadline))

    def check_size(self, prefix: str, size: int, *, deadline: Deadline | None = None) -> None:
        """See base class."""
        self._inner.check_size(prefix, size, deadline=self._bound(deadline))

    def first_change_after(
        self, key: str, index: int, *, deadline: Deadline | None = None
    ) -> Node | None:
        """See base class."""
        return self._inner.first_change_after(key, index, deadline=self._bound(deadline))

    def time_to_live(self, node: Node, *, deadline: Deadline | None = None) -> int | None:
        """See base class."""
        return self._inner.time_to_live(node, deadline=self._bound(deadline))

    def set(
        self,
        key: str,
        value: str | None,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """See base class."""
        return self._inner.set(key, value, ttl=ttl, deadline=self._bound(deadline))

    def update(
        self, key: str, value: str, *, ttl: int, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """See base class."""
        bound = self._bound(deadline)
        return self._inner.update(key, value, ttl=ttl, lease=lease, deadline=bound)

    def refresh(
        self, key: str, ttl: int, *, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """See base class."""
        return self._inner.refresh(key, ttl, lease=lease, deadline=self._bound(deadline))

    def compare_and_refresh(
        self, key: str, value: str, ttl: int, *, deadline: Deadline | None = None
    ) -> Node:
        """See base class."""
        return self._inner.compare_and_refresh(key, value, ttl, deadline=self._bound(deadline))

    def mkdir(self, key: str, *, ttl: int | None = None, deadline: Deadline | None = None) -> bool:
        """See base class."""
        return self._inner.mkdir(key, ttl=ttl, deadline=self._bound(deadline))

    def create(
        self, key: str, value: str, *, ttl: int | None = None, deadline: Deadline | None = None
    ) -> Node:
        """See base class."""
        return self._inner.create(key, value, ttl=ttl, deadline=self._bound(deadline))

    def compare_and_swap(
        self,
        key: str,
        value: str,
        prev: Node | int,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """See base class."""
        bound = self._bound(deadline)
        return self._inner.compare_and_swap(key, value, prev, ttl=ttl, deadline=bound)

    def compare_and_delete(self, key: str, prev: Node, *, deadline: Deadline | None = None) -> bool:
        """See base class."""
        return self._inner.compare_and_delete(key, prev, deadline=self._bound(deadline))

    def delete(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> bool:
        """See base class."""
        return self._inner.delete(key, recursive=recursive, deadline=self._bound(deadline))


class _ScopedStream(WatchStream):
    """A watch stream of a :class:`ScopedTransport`, whose waits end by the deadline of
    the waiting thread's block too."""

    def __init__(self, inner: WatchStream, conn: ScopedTransport) -> None:
        super().__init__(inner.key, inner.next_index, inner.recursive)
        self._inner = inner
        self._conn = conn

    @property
    def next_index(self) -> int:
        """See base class."""
        return self._inner.next_index

    @property
    def closed(self) -> bool:
        """See base class."""
        return self._inner.closed

    def next(self, deadline: Deadline) -> Node | None:
        """See base class."""
        return self._inner.next(self._conn._bound(deadline) or deadline)

    def close(self) -> None:
        """See base class."""
        self._inner.close()

    def wake(self) -> None:
        """See base class."""
        self._inner.wake()
