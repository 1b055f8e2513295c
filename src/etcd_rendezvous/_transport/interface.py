"""The transport interface: what the rendezvous backends and the store need from etcd.

:class:`Transport` is written in v2's vocabulary; the v2 API's
:class:`~etcd_rendezvous._transport.v2.EtcdConnection` and the v3 JSON gateway's
:class:`~etcd_rendezvous._transport.v3.EtcdV3Connection` implement it, and
:func:`~etcd_rendezvous._transport.connect.open_transport` picks one. This module is
the contract: :class:`Transport`, the :class:`Node` it answers with, its
:class:`WatchStream`, its options and its errors. What the implementations share is in
:mod:`etcd_rendezvous._transport.base`. See docs/etcd-v3.rst, section "Inside the
transport".
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict, TypeVar

from ..api import Deadline, RendezvousError
from .clock import ServerClock

__all__ = [
    "ADVANCE_TRIES",
    "DELETE_ACTIONS",
    "WRITE_ACTIONS",
    "CompareFailedError",
    "ConditionError",
    "ConnectionOptions",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "OperationRefusedError",
    "Transport",
    "TransportClosedError",
    "WatchHistoryLostError",
    "WatchStream",
]

logger = logging.getLogger(__name__)

_Closing_T = TypeVar("_Closing_T", bound="_Closing")

DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds one request waits for an answer before the next endpoint is tried (see
#: :attr:`Transport.request_timeout`).
DEFAULT_REQUEST_TIMEOUT = 3.0
#: Seconds a wait may hear nothing from its member before it is re-armed on the next
#: endpoint (see :attr:`Transport.silence_timeout`).
DEFAULT_SILENCE_TIMEOUT = 10.0

#: The etcd APIs a transport can speak, and the ``etcd_api`` option's values.
ETCD_APIS = ("auto", "v2", "v3")

#: How many writes :meth:`Transport.advance` tries by default: each race lost is to a
#: write of something newer, most likely, which the next read finds.
ADVANCE_TRIES = 3

#: Actions (:attr:`Node.action`) of changes after which the node holds the key's new value.
WRITE_ACTIONS = frozenset({"set", "create", "update", "compareAndSwap"})
#: Actions of changes by which a key stops existing.
DELETE_ACTIONS = frozenset({"delete", "expire", "compareAndDelete"})


class ConditionError(Exception):
    """A request was refused because of the state of a key (not a failure)."""

    def __init__(self, key: str, etcd_index: int | None) -> None:
        super().__init__(key)
        self.key = key
        #: The store index (revision) at the time of the refusal, when etcd reported it.
        self.etcd_index = etcd_index
        #: Whether an earlier copy of this conditional write, whose answer was lost, may
        #: have been applied after all (the history that would tell is gone or could not
        #: be read: :attr:`unknown_because`). The caller re-reads the key, as after any
        #: refusal.
        self.outcome_unknown = False
        #: Why the outcome is unknown, as a clause ("etcd no longer holds ..."); empty
        #: unless :attr:`outcome_unknown`.
        self.unknown_because = ""


class KeyNotFoundError(ConditionError):
    """The key does not exist."""


class KeyExistsError(ConditionError):
    """A create found the key already there."""


class CompareFailedError(ConditionError):
    """A compare-and-swap or compare-and-delete found a different value or index."""


class OperationRefusedError(RendezvousError):
    """etcd permanently refused an operation (for example, changing a directory's TTL
    on etcd 3.5, which answers "Not a file")."""


class TransportClosedError(RendezvousError):
    """The etcd connection was closed by its owner and cannot be used any more."""


class WatchHistoryLostError(RendezvousError):
    """etcd no longer holds the history a watch asked for (v2's "event index cleared",
    errorCode 401, past its last 1000 events; a compacted revision on v3).

    The changes from :attr:`index` on cannot be replayed: re-read the key, then watch
    (or open a new :class:`WatchStream`) from the read's ``etcd_index + 1``.
    """

    def __init__(self, key: str, index: int, detail: str = "") -> None:
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"etcd no longer holds the history of {key!r} from index {index}{why}; "
            "re-read the key and watch again from the read's index + 1."
        )
        self.key = key
        #: The index (revision) the watch asked to start from.
        self.index = index


@dataclass(frozen=True)
class Node:
    """One key as returned by a read, write or watch (in v2's vocabulary)."""

    key: str
    value: str | None
    modified_index: int
    created_index: int
    #: The store index (revision) when the answer was served.
    etcd_index: int
    #: Remaining TTL in seconds where v2 reports it; ``None`` otherwise.
    ttl: int | None
    is_dir: bool
    #: Immediate children, for directory reads (empty otherwise).
    children: tuple[Node, ...]
    #: What produced this node: ``get``, ``set``, ``create``, ``compareAndSwap``,
    #: ``expire``, ``delete`` ... (v2's action names; v3 watch events give ``create``,
    #: ``set`` or ``delete``).
    action: str
    #: The v3 lease the key is attached to (0: none, and always 0 on v2).
    lease: int = 0


class _Closing(abc.ABC):
    """Something its owner closes: a context manager that calls :meth:`close` on exit."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this holds. Idempotent."""

    def __enter__(self: _Closing_T) -> _Closing_T:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class WatchStream(_Closing):
    """The changes of one key (or of every key below it) from a start index on, in order,
    over as few etcd requests as the API allows (one, unless the stream breaks).

    Made by :meth:`Transport.watch_stream`. One thread reads it with :meth:`next`; any
    thread may :meth:`close` it (which wakes a blocked :meth:`next`). Closing the
    transport closes its streams. A stream is a context manager that closes it.
    """

    def __init__(self, key: str, start_index: int, recursive: bool) -> None:
        self._key = key
        self._recursive = recursive
        #: 0 until a stream opened "from now" knows where it stands.
        self._next_index = max(int(start_index), 0)
        self._closed = False

    @property
    def key(self) -> str:
        """The key watched (the directory or prefix, for a recursive stream)."""
        return self._key

    @property
    def recursive(self) -> bool:
        """Whether the changes of every key below :attr:`key` are delivered too."""
        return self._recursive

    @property
    def next_index(self) -> int:
        """The index (revision) the stream will deliver changes from next (0: a stream
        opened from now that has not been answered yet)."""
        return self._next_index

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @abc.abstractmethod
    def next(self, deadline: Deadline, *, give_up_after: float | None = None) -> Node | None:
        """The next change, or ``None`` if none came by ``deadline``.

        The change is a :class:`Node` whose ``action``, ``value`` (the new value;
        ``None`` for a delete or an expiry), ``modified_index`` and ``etcd_index``
        describe it. Failures to reach etcd are retried until ``deadline`` too, or, with
        ``give_up_after``, for that many seconds at most (a watcher with a long
        deadline that must learn that etcd is gone: an operator's tool).

        Raises:
            RendezvousConnectionError: with ``give_up_after``, etcd stayed unreachable
                that long before ``deadline``.
            WatchHistoryLostError: etcd no longer holds the changes from
                :attr:`next_index` on; re-read the key and open a new stream.
            TransportClosedError: the stream or its transport was closed (before or
                during the wait).
        """

    def close(self) -> None:
        """End the stream and wake a thread blocked in :meth:`next`. Idempotent."""
        self._closed = True

    def wake(self) -> None:
        """Called when the transport moves on to another endpoint: a stream listening to
        the one left re-arms (by default there is nothing to do)."""

    def _check_open(self, transport_closed: bool) -> None:
        """Raise :class:`TransportClosedError` if this stream or (``transport_closed``)
        its transport was closed."""
        if self._closed or transport_closed:
            what = "watch stream" if self._closed else "etcd connection"
            raise TransportClosedError(f"Could not watch {self._key!r}: the {what} was closed.")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self._key!r}, next_index={self._next_index}, "
            f"recursive={self._recursive})"
        )


class ConnectionOptions(TypedDict, total=False):
    """The keyword options of a :class:`Transport` implementation's constructor (and of
    :func:`~etcd_rendezvous._transport.connect.open_transport`); see :class:`Transport`."""

    protocol: str
    cert: str | None
    key: str | None
    cacert: str | None
    username: str | None
    password: str | None
    read_timeout: float
    connect_timeout: float
    request_timeout: float
    silence_timeout: float
    quorum_reads: bool
    sleep: Callable[[float], None]


class Transport(_Closing):
    """A connection to an etcd cluster over one or more endpoints.

    Every operation takes its deadline as an argument, ``deadline``: a
    :class:`~etcd_rendezvous.api.Deadline` made once from the caller's timeout and passed
    down to each request and wait made on its behalf (without one, ``read_timeout``
    seconds from the call: the connection's own timeout, as a python-etcd client's). It
    retries failures that are worth retrying (unreachable endpoint, leader election, a
    lost answer) on the same or the next endpoint until then, and returns or raises
    within about a second of it. A write etcd refuses as larger than it accepts raises
    :class:`~etcd_rendezvous.api.RequestTooLargeError` at once (it is never sent again).
    ``request_timeout`` bounds each single request, and
    ``silence_timeout`` how long a wait may hear nothing from its member: a member that
    stops answering without closing its connections costs seconds, not the deadline. A
    transport is closed by its owner with :meth:`close` (or by using it as a context
    manager).

    Args:
        endpoints: ``(host, port)`` pairs, tried in order and round-robin on failure.
        protocol: ``"http"`` or ``"https"``.
        cert: client certificate file (with ``key``, or a combined PEM file).
        key: private key of ``cert``.
        cacert: CA bundle used to verify the server.
        username: etcd user (needs ``password``); on v3 authenticated through
            ``/v3/auth/authenticate``, and again whenever the token expires.
        password: password for ``username``.
        read_timeout: the deadline of an operation given none: how long a failed
            operation is retried across endpoints before it gives up with
            :class:`~etcd_rendezvous.api.RendezvousConnectionError`.
        connect_timeout: seconds to wait for a TCP/TLS connection to one endpoint.
        request_timeout: seconds one request waits for an answer before the next
            endpoint is tried.
        silence_timeout: seconds a wait may hear nothing from its member before it is
            re-armed on the next endpoint (see :attr:`silence_timeout`).
        quorum_reads: on the v2 API, read through the cluster's consensus
            (``quorum=true``): a member that fell behind the others, or is cut off from
            them, answers no read rather than old values. For callers that decide from
            a read alone, as the operators' commands do; a rendezvous decides by
            compare-and-swap, which no stale read can fool. The v3 API's reads are
            linearizable already.
        sleep: how the retry loop sleeps between attempts (a test may replace it).
    """

    #: ``"v2"`` or ``"v3"``: the etcd API this transport speaks.
    api: str = ""

    @property
    @abc.abstractmethod
    def endpoints(self) -> list[str]:
        """The endpoint URLs, in configuration order."""

    @property
    @abc.abstractmethod
    def read_timeout(self) -> float:
        """The deadline, from the call, of an operation given none (and the longest any
        request may wait for an answer)."""

    @property
    @abc.abstractmethod
    def request_timeout(self) -> float:
        """Seconds one request waits for an answer before the next endpoint is tried
        (the opening of a watch included; never more than :attr:`read_timeout`)."""

    @property
    @abc.abstractmethod
    def silence_timeout(self) -> float:
        """Seconds a wait (a watch, v2's long poll) may hear nothing from its member --
        neither on the watch nor in answer to any other request of this connection --
        before it is re-armed, from the last index it saw, on the next endpoint: a
        frozen member cannot be told from an idle one (never more than
        :attr:`read_timeout`)."""

    @property
    @abc.abstractmethod
    def connect_timeout(self) -> float:
        """Timeout for connecting to one endpoint, in seconds."""

    @property
    @abc.abstractmethod
    def last_index(self) -> int:
        """The highest store index (revision) seen so far on this connection."""

    @property
    @abc.abstractmethod
    def clock(self) -> ServerClock:
        """etcd's clock, as the ``Date`` headers of this connection's answers tell it
        (the local wall clock before the first answer)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the watch streams and release pooled connections. Idempotent."""

    # -- the interface --------------------------------------------------------------

    @abc.abstractmethod
    def server_version(self, *, deadline: Deadline | None = None) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""

    @abc.abstractmethod
    def can_refresh_directory_ttl(self, *, deadline: Deadline | None = None) -> bool:
        """Whether a directory created with a TTL can have that TTL refreshed."""

    @abc.abstractmethod
    def get(self, key: str, *, deadline: Deadline | None = None) -> Node:
        """Read the value of ``key``.

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """

    @abc.abstractmethod
    def list_dir(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> Node:
        """Read directory ``key``: a node with ``is_dir`` and its immediate children (all
        levels with ``recursive``; subdirectories are nodes with ``is_dir``).

        Raises:
            KeyNotFoundError: nothing exists at or below ``key``.
        """

    def try_get(self, key: str, *, deadline: Deadline | None = None) -> Node | None:
        """Like :meth:`get`, but ``None`` for a missing key."""
        try:
            return self.get(key, deadline=deadline)
        except KeyNotFoundError:
            return None

    @abc.abstractmethod
    def watch(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool = False
    ) -> Node | None:
        """Wait for the first change of ``key`` (or below it) at or after ``index``.

        Returns the change, or ``None`` when ``deadline`` passed or etcd no longer holds
        history that old (callers re-read in both cases; :meth:`watch_stream` tells the
        two apart). Failures to reach etcd are retried until ``deadline`` too.
        """

    @abc.abstractmethod
    def watch_stream(
        self,
        key: str,
        start_index: int,
        *,
        recursive: bool = False,
        deadline: Deadline | None = None,
    ) -> WatchStream:
        """The changes of ``key`` (or of every key below it, with ``recursive``) with an
        index of ``start_index`` or later, in order, as a :class:`WatchStream`.

        ``start_index`` 0 means "from now": the changes made after etcd registered the
        watch, which it does before this returns. Opening from now, then reading, is
        the way to follow a key that is changing fast: a v2 stream opened from an index
        in etcd's history costs one request per change until it catches up.

        The stream is opened by ``deadline``; each :meth:`WatchStream.next` has a
        deadline of its own. The caller closes the stream (or uses it as a context
        manager); closing the transport ends it too.
        """

    @abc.abstractmethod
    def check_writable(self, prefix: str, *, deadline: Deadline | None = None) -> None:
        """Ask etcd whether this connection's user may write below ``prefix``, with a
        conditional write that cannot apply: nothing is written either way.

        Raises:
            RendezvousConnectionError: etcd refused it; the message names ``prefix``,
                the user and the permission missing.
        """

    @abc.abstractmethod
    def check_size(self, prefix: str, size: int, *, deadline: Deadline | None = None) -> None:
        """Ask etcd whether it accepts a write of about ``size`` bytes below ``prefix``
        (a value of that many bytes, in a conditional write that cannot apply): nothing
        is written either way.

        Raises:
            RequestTooLargeError: etcd refused it for its size.
        """

    @abc.abstractmethod
    def first_change_after(
        self, key: str, index: int, *, deadline: Deadline | None = None
    ) -> Node | None:
        """The first recorded change of ``key`` after ``index``; ``None`` if etcd no
        longer holds it or did not answer within ``request_timeout`` (and by
        ``deadline``, but at least a moment even past it: the look into a key's history
        that finds out the fate of a write sent at its deadline).

        Raises:
            RendezvousConnectionError: etcd was unreachable.
        """

    @abc.abstractmethod
    def time_to_live(self, node: Node, *, deadline: Deadline | None = None) -> int | None:
        """Seconds until ``node`` expires, or ``None`` if it has no TTL (or is gone)."""

    @abc.abstractmethod
    def set(
        self,
        key: str,
        value: str | None,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Unconditionally write ``key`` (with a TTL, or none)."""

    @abc.abstractmethod
    def update(
        self, key: str, value: str, *, ttl: int, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Rewrite the existing ``key`` with ``value``, keeping its creation index (its
        place among keys in created order); v2 restarts its TTL of ``ttl``.

        ``lease`` (v3): the lease of the caller's own last write of the key (as for
        :meth:`refresh`): the key is written with it, in one request, keeping its
        remaining TTL; if that lease is gone, with a new one of ``ttl``.

        Raises:
            KeyNotFoundError: the key is gone.
        """

    @abc.abstractmethod
    def refresh(
        self, key: str, ttl: int, *, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Reset the TTL of an existing key without changing its value or waking watchers.

        ``lease`` (v3): the lease of the caller's own last write of the key (the
        ``lease`` of the :class:`Node` that write returned, or of the last refresh), for
        a key no one else writes: it is kept alive without reading the key first. The
        returned node's ``lease`` is the one to pass next time.

        Raises:
            KeyNotFoundError: the key (or its TTL) is gone.
        """

    @abc.abstractmethod
    def compare_and_refresh(
        self, key: str, value: str, ttl: int, *, deadline: Deadline | None = None
    ) -> Node:
        """Like :meth:`refresh` (a TTL of ``ttl``), only if ``key`` holds ``value``: a
        lock's holder renewing it.

        Raises:
            KeyNotFoundError: the key (or its TTL) is gone.
            CompareFailedError: the key holds another value.
        """

    @abc.abstractmethod
    def mkdir(self, key: str, *, ttl: int | None = None, deadline: Deadline | None = None) -> bool:
        """Create directory ``key`` unless it exists. Returns whether it was created."""

    @abc.abstractmethod
    def create(
        self, key: str, value: str, *, ttl: int | None = None, deadline: Deadline | None = None
    ) -> Node:
        """Create ``key`` with ``value``.

        A create whose answer was lost is recognised as applied if the key's first
        version carries ``value``: give each create a value of its own (a tag), or one
        that means the same whoever wrote it.

        Raises:
            KeyExistsError: the key exists (``outcome_unknown``: see
                :class:`CompareFailedError`).
        """

    @abc.abstractmethod
    def compare_and_swap(
        self,
        key: str,
        value: str,
        prev: Node | int,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Replace ``prev`` (as read) with ``value``, only if ``key`` is still ``prev``.

        ``prev`` is the node as read: the modification index is compared (and, on v2,
        the value too, as PyTorch's workers do). Or it is a modification index alone
        (``int``): only the index is compared, as PyTorch's ``etcd-v2`` backend does
        (v2's ``prevIndex``), and the written node's ``created_index`` is 0 on v3,
        which does not answer it. A swap whose answer was lost is recognised as applied
        if the first change after ``prev`` carries ``value`` (as for :meth:`create`).

        Raises:
            CompareFailedError: the key changed since ``prev`` was read; with
                ``outcome_unknown`` set, our own lost swap may be that change (etcd no
                longer holds the history that would tell): re-read the key.
            KeyNotFoundError: the key no longer exists.
        """

    def advance(
        self,
        key: str,
        value: str,
        *,
        expected: int | None = None,
        holds_newer: Callable[[Node], bool],
        ttl: int | None = None,
        tries: int = ADVANCE_TRIES,
        deadline: Deadline | None = None,
    ) -> Node | None:
        """Write ``value`` into ``key`` unless it holds something at least as new
        (``holds_newer`` of the node read), and never over a write made since that read.

        Each try reads the key, then swaps ``value`` in by :meth:`compare_and_swap` on
        what it read (or creates the key, if absent or gone since). Another write that
        comes first (a lost race) starts the next try, ``tries`` at most. ``expected``:
        the key's modification index as the caller remembers it (``0``: absent), written
        on without a read by the first try.

        Returns the node written, or ``None`` if the key holds something at least as new
        or every try lost its race. Every request ends by ``deadline`` (without one,
        ``read_timeout`` from the call).
        """
        deadline = deadline if deadline is not None else Deadline(self.read_timeout)
        held: Node | int | None = expected or None
        read = expected is None
        for _ in range(tries):
            if read:
                held = self.try_get(key, deadline=deadline)
                if held is not None and holds_newer(held):
                    return None
            try:
                return self._swap_in(key, value, held, ttl, deadline)
            except (CompareFailedError, KeyExistsError):
                read = True  # another write came first: read it, then decide again
        logger.debug("Gave up writing %r: another write came first %d times", key, tries)
        return None

    def _swap_in(
        self, key: str, value: str, held: Node | int | None, ttl: int | None, deadline: Deadline
    ) -> Node:
        """Write ``value`` in place of ``held`` (compare-and-swap on the node read, or on
        a modification index), or create ``key`` if it was absent (``held`` is ``None``)
        or is gone since."""
        if held is not None:
            try:
                return self.compare_and_swap(key, value, held, ttl=ttl, deadline=deadline)
            except KeyNotFoundError:
                pass  # expired or deleted since the read: create it
        return self.create(key, value, ttl=ttl, deadline=deadline)

    @abc.abstractmethod
    def compare_and_delete(self, key: str, prev: Node, *, deadline: Deadline | None = None) -> bool:
        """Delete ``key`` only if it is still ``prev``. Returns whether it did."""

    @abc.abstractmethod
    def delete(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> bool:
        """Delete ``key`` (a directory and all below it with ``recursive``).

        Returns whether anything existed.
        """
