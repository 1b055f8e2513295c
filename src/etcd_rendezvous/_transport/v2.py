"""The v2 transport: etcd's v2 API through python-etcd.

:class:`EtcdConnection` implements :class:`~etcd_rendezvous._transport.interface.Transport`
over a :class:`~etcd_rendezvous._transport.v2_session.V2Session` (one python-etcd client
per endpoint, and the classification of their failures), which its watch streams share.
See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import etcd
import urllib3

from ..api import Deadline, RendezvousConnectionError
from .attempt import Attempt, Outcome
from .base import Connection
from .interface import (
    DEFAULT_READ_TIMEOUT,
    CompareFailedError,
    ConnectionOptions,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    OperationRefusedError,
    WatchHistoryLostError,
    WatchStream,
)
from .v2_session import V2Session
from .v2_watch import V2WatchStream

if TYPE_CHECKING:
    from typing_extensions import Unpack  # Python 3.10 has no typing.Unpack

__all__ = [
    "CompareFailedError",
    "EtcdConnection",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "OperationRefusedError",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def _node(result: Any) -> Node:
    """A :class:`Node` from a python-etcd ``EtcdResult``."""
    etcd_index = int(getattr(result, "etcd_index", 0) or 0)
    raw_children = getattr(result, "_children", None) or []
    return Node(
        key=result.key,
        value=result.value,
        modified_index=int(result.modifiedIndex or 0),
        created_index=int(result.createdIndex or 0),
        etcd_index=etcd_index,
        ttl=result.ttl,
        is_dir=bool(result.dir),
        children=tuple(_node_from_dict(child, etcd_index) for child in raw_children),
        action=str(result.action or ""),
    )


def _node_from_dict(raw: dict[str, Any], etcd_index: int) -> Node:
    return Node(
        key=raw.get("key", ""),
        value=raw.get("value"),
        modified_index=int(raw.get("modifiedIndex", 0)),
        created_index=int(raw.get("createdIndex", 0)),
        etcd_index=etcd_index,
        ttl=raw.get("ttl"),
        is_dir=bool(raw.get("dir", False)),
        children=tuple(_node_from_dict(c, etcd_index) for c in raw.get("nodes", []) or []),
        action="get",
    )


Endpoint = tuple[str, int]


class EtcdConnection(Connection):
    """A connection to an etcd cluster over the v2 API, on one or more endpoints: one
    python-etcd client per endpoint. The options are
    :class:`~etcd_rendezvous._transport.interface.Transport`'s.
    """

    api = "v2"

    def __init__(self, endpoints: Sequence[Endpoint], **options: Unpack[ConnectionOptions]) -> None:
        super().__init__(endpoints, **options)
        self._session = V2Session(endpoints, self._endpoints, self._access, self._clock)
        self._version: str | None = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_client(cls, client: Any, *, param: str = "etcd_client") -> EtcdConnection:
        """Build a hardened connection with the same endpoints and credentials as
        ``client``, a python-etcd ``etcd.Client`` (not modified). Callers outside the
        transport use :func:`~etcd_rendezvous._transport.connect.as_transport`.

        Raises:
            TypeError: ``client`` is not an ``etcd.Client``; the message names
                ``param``, the caller's name for it.
            ValueError: an endpoint of ``client`` cannot be parsed.
        """
        if not isinstance(client, etcd.Client):
            raise TypeError(
                f"{param}: expected an etcd.Client or an etcd-rendezvous connection, got "
                f"{type(client).__name__}."
            )
        uris = [client.base_uri, *getattr(client, "_machines_cache", [])]
        endpoints: list[Endpoint] = []
        for uri in dict.fromkeys(uris):
            parsed = urllib3.util.parse_url(uri)
            if parsed.host is None or parsed.port is None:
                raise ValueError(f"{param}: cannot parse endpoint {uri!r}.")
            endpoints.append((parsed.host.strip("[]"), parsed.port))
        pool_kw = client.http.connection_pool_kw
        cert = pool_kw.get("cert_file")
        read_timeout = client.read_timeout if client.read_timeout else DEFAULT_READ_TIMEOUT
        return cls(
            endpoints,
            protocol=client.protocol,
            cert=cert,
            key=pool_kw.get("key_file") if cert else None,
            cacert=pool_kw.get("ca_certs"),
            username=client.username,
            password=client.password if client.username else None,
            read_timeout=float(read_timeout),
        )

    def _release(self) -> None:
        self._session.release()

    # -- the request loop -----------------------------------------------------------

    def _v2(
        self,
        what: str,
        key: str,
        call: Callable[[Any], _T],
        deadline: Deadline,
        *,
        cap_requests: bool = True,
    ) -> Attempt[_T]:
        """Run ``call(client)`` on one endpoint after another until etcd answers it or
        ``deadline`` passes (see
        :meth:`~etcd_rendezvous._transport.endpoints.Endpoints.operate`)."""
        return self._endpoints.operate(
            what,
            key,
            lambda idx, cap: self._session.once(idx, what, key, call, cap),
            deadline=deadline,
            cap_requests=cap_requests,
        )

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, deadline: Deadline | None = None) -> Node:
        """Read ``key``.

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """
        call = lambda c: _node(c.read(key, recursive=False))  # noqa: E731
        return self._note_index(self._v2("read", key, call, self._deadline(deadline)).unwrap())

    def list_dir(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> Node:
        """Read directory ``key`` with its immediate children (all levels if ``recursive``).

        Raises:
            KeyNotFoundError: the directory does not exist (``etcd_index`` tells when).
        """
        # Its own op ("list"), as on v3, so that the metrics tell listings from reads.
        call = lambda c: _node(c.read(key, recursive=recursive))  # noqa: E731
        return self._note_index(self._v2("list", key, call, self._deadline(deadline)).unwrap())

    def _wait_for_change(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool
    ) -> Node | None:
        """Wait for the first change of ``key`` at or after etcd ``index``.

        Returns the change, or ``None`` when ``deadline`` passed. Connection failures are
        retried until then.

        A v2 wait is a long poll, which a member answers only when the key changes: a
        poll lasts at most ``silence_timeout`` and is then sent again from ``index``;
        when nothing else was heard from its member meanwhile either, the next poll
        goes to the next endpoint (a frozen member and an idle one look the same).

        Raises:
            WatchHistoryLostError: etcd answered "event index cleared" (401).
        """
        endpoints = self._endpoints
        while not deadline.expired():
            idx = endpoints.pick()
            remaining = deadline.remaining()
            poll = min(remaining, endpoints.timeouts.silence)
            try:
                return self._poll(key, index, poll, recursive, deadline)
            except etcd.EtcdWatchTimedOut:
                if poll >= remaining:
                    return None  # that poll was the whole wait
            except RendezvousConnectionError:
                if deadline.expired():
                    return None
                raise
            if endpoints.silent_for(idx) >= endpoints.timeouts.silence:
                endpoints.leave_silent(idx, f"watching {key!r}")
        return None

    def _poll(
        self, key: str, index: int, seconds: float, recursive: bool, deadline: Deadline
    ) -> Node | None:
        """One long poll of at most ``seconds`` (connection failures retried until
        ``deadline``); raises ``etcd.EtcdWatchTimedOut`` if nothing changed."""

        def call(client: Any) -> Node:
            # python-etcd treats a timeout of 0 as "wait forever".
            result = client.read(
                key, wait=True, waitIndex=index, recursive=recursive, timeout=max(seconds, 0.001)
            )
            return _node(result)

        try:
            watched = self._v2("watch", key, call, deadline, cap_requests=False)
            return self._note_index(watched.unwrap())
        except etcd.EtcdEventIndexCleared as exc:
            raise WatchHistoryLostError(key, index, str(exc)) from None
        except KeyNotFoundError:
            # Watching a missing key works in etcd; this only happens for a
            # missing parent directory on some versions. Treat as "no change yet".
            return None

    def watch_stream(
        self,
        key: str,
        start_index: int,
        *,
        recursive: bool = False,
        deadline: Deadline | None = None,
    ) -> WatchStream:
        """The changes of ``key`` (or below it) from etcd index ``start_index`` on, over
        streaming watch requests (``stream=true``): one for every change made after the
        stream opened, one more per change that was already in etcd's history (see
        :mod:`etcd_rendezvous._transport.v2_watch`). Opened before returning, retrying like any
        operation.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable until ``deadline``.
        """
        stream = V2WatchStream(self._session, self._endpoints, key, start_index, recursive)
        self._adopt(stream)
        stream.start(self._deadline(deadline))
        return stream

    def server_version(self, *, deadline: Deadline | None = None) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""
        if self._version is None:
            call = lambda c: str(c.version)  # noqa: E731
            answer = self._v2("query the version of", "/version", call, self._deadline(deadline))
            self._version = answer.unwrap()
        return self._version

    def can_refresh_directory_ttl(self, *, deadline: Deadline | None = None) -> bool:
        """etcd 3.5 and later answer "Not a file" to refreshing a directory's TTL."""
        version = self.server_version(deadline=deadline)
        try:
            major, minor = (int(part) for part in version.split(".")[:2])
        except ValueError:
            return True
        return (major, minor) < (3, 5)

    def time_to_live(self, node: Node, *, deadline: Deadline | None = None) -> int | None:
        """The TTL v2 reported with ``node``."""
        return node.ttl

    # -- writes -----------------------------------------------------------------------

    def set(
        self,
        key: str,
        value: str | None,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Unconditionally write ``key`` (idempotent, so re-sent freely)."""
        call = lambda c: _node(c.write(key, value, ttl=ttl))  # noqa: E731
        return self._note_index(self._v2("write", key, call, self._deadline(deadline)).unwrap())

    def update(
        self, key: str, value: str, *, ttl: int, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Rewrite the existing ``key`` (``prevExist``: a plain write would give it a new
        creation index); raises :class:`KeyNotFoundError` if it is gone. ``lease`` is
        for v3 (v2 restarts the TTL)."""
        call = lambda c: _node(c.write(key, value, ttl=ttl, prevExist=True))  # noqa: E731
        return self._note_index(self._v2("update", key, call, self._deadline(deadline)).unwrap())

    def refresh(
        self, key: str, ttl: int, *, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Reset the TTL of an existing key without changing its value or notifying
        watchers. ``lease`` is for v3 (v2 refreshes in one request anyway)."""
        return self._refresh(key, ttl, self._deadline(deadline))

    def compare_and_refresh(
        self, key: str, value: str, ttl: int, *, deadline: Deadline | None = None
    ) -> Node:
        """:meth:`refresh` with ``prevValue``: one request, as without it."""
        return self._refresh(key, ttl, self._deadline(deadline), prevValue=value)

    def _refresh(self, key: str, ttl: int, deadline: Deadline, **condition: str) -> Node:
        call = lambda c: _node(  # noqa: E731
            c.write(key, None, ttl=ttl, refresh=True, prevExist=True, **condition)
        )
        return self._note_index(self._v2("refresh the TTL of", key, call, deadline).unwrap())

    def mkdir(self, key: str, *, ttl: int | None = None, deadline: Deadline | None = None) -> bool:
        """Create directory ``key`` unless it exists. Returns whether it was created."""
        call = lambda c: c.write(key, None, dir=True, prevExist=False, ttl=ttl)  # noqa: E731
        try:
            self._v2("create the directory", key, call, self._deadline(deadline)).unwrap()
        except KeyExistsError:
            return False
        return True

    def create(
        self, key: str, value: str, *, ttl: int | None = None, deadline: Deadline | None = None
    ) -> Node:
        """Create ``key`` with ``value`` (``prevExist=false``; see
        :meth:`Transport.create <etcd_rendezvous._transport.interface.Transport.create>`)."""
        deadline = self._deadline(deadline)
        call = lambda c: _node(c.write(key, value, ttl=ttl, prevExist=False))  # noqa: E731
        done = self._v2("create", key, call, deadline)
        return self._settle("create", key, value, None, done, deadline)

    def compare_and_swap(
        self,
        key: str,
        value: str,
        prev: Node | int,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Replace ``prev`` with ``value`` if ``key`` still holds ``prev.value`` at
        ``prev.modified_index`` (PyTorch's workers compare the value alone; the index
        also rules out a key that went through other values and came back), or, for
        an index ``prev``, if ``key`` is still at that index (``prevIndex`` alone). See
        :meth:`Transport.compare_and_swap
        <etcd_rendezvous._transport.interface.Transport.compare_and_swap>`."""
        if isinstance(prev, int):
            conditions: dict[str, Any] = {"prevIndex": prev}
            since = prev
        else:
            if prev.value is None:
                raise ValueError(f"compare_and_swap: {key!r} has no value to compare against.")
            conditions, since = _prev_conditions(prev), prev.modified_index
        deadline = self._deadline(deadline)
        call = lambda c: _node(c.write(key, value, ttl=ttl, **conditions))  # noqa: E731
        done = self._v2("compare-and-swap", key, call, deadline)
        return self._settle("compare-and-swap", key, value, since, done, deadline)

    def compare_and_delete(self, key: str, prev: Node, *, deadline: Deadline | None = None) -> bool:
        """Delete ``key`` only if its modification index is still ``prev``'s. Returns
        whether it did; a delete whose answer was lost counts as ours if the key's next
        change after ``prev`` was a compare-and-delete.

        The value is not compared: a DELETE carries its conditions in the URL, and etcd
        3.5 resets connections when many DELETEs with URLs of several kilobytes arrive
        at once.
        """
        deadline = self._deadline(deadline)
        call = lambda c: c.delete(key, prevIndex=prev.modified_index)  # noqa: E731
        done = self._v2("compare-and-delete", key, call, deadline)
        if done.outcome is Outcome.APPLIED:
            return True
        if done.after_unknown:
            change = self.first_change_after(key, prev.modified_index, deadline=deadline)
            return change is not None and change.action == "compareAndDelete"
        return False

    def check_writable(self, prefix: str, *, deadline: Deadline | None = None) -> None:
        """A compare-and-swap below ``prefix`` that cannot apply (on a key that no one
        writes, from an index it cannot have): etcd checks the user's permission first."""
        probe = f"{prefix.rstrip('/')}/_permission-check-{uuid.uuid4().hex}"
        call = lambda c: c.write(probe, "", prevIndex=1)  # noqa: E731
        try:
            self._v2("write below", prefix, call, self._deadline(deadline)).unwrap()
        except (KeyNotFoundError, CompareFailedError):
            return

    def check_size(self, prefix: str, size: int, *, deadline: Deadline | None = None) -> None:
        """A compare-and-swap of ``size`` bytes on a key below ``prefix`` that no one
        writes, from an index it cannot have: etcd parses the form (and refuses one too
        large) first."""
        probe = f"{prefix.rstrip('/')}/_size-check-{uuid.uuid4().hex}"
        call = lambda c: c.write(probe, "x" * max(size, 0), prevIndex=1)  # noqa: E731
        try:
            self._v2("check the size limit below", prefix, call, self._deadline(deadline)).unwrap()
        except (KeyNotFoundError, CompareFailedError):
            return

    def delete(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> bool:
        """Delete ``key`` (a directory with ``recursive``). Returns whether it existed."""
        call = lambda c: c.delete(key, recursive=recursive, dir=recursive or None)  # noqa: E731
        try:
            self._v2("delete", key, call, self._deadline(deadline)).unwrap()
        except KeyNotFoundError:
            return False
        return True


def _prev_conditions(prev: Node) -> dict[str, Any]:
    conditions: dict[str, Any] = {"prevIndex": prev.modified_index}
    if prev.value:
        # etcd refuses an empty prevValue; the index alone is the stronger check.
        conditions["prevValue"] = prev.value
    return conditions
