"""The transport interface: what the rendezvous backends and the store need from etcd.

:class:`Transport` is written in v2's vocabulary; the v2 API's
:class:`~etcd_rendezvous._transport.v2.EtcdConnection` and the v3 JSON gateway's
:class:`~etcd_rendezvous._transport.v3.EtcdV3Connection` implement it, and
:func:`~etcd_rendezvous._transport.connect.open_transport` picks one. This module also
holds what both share: the condition errors, the :class:`Outcome` of one request, the
retry loop over the endpoints (``Transport._operate``) and the settling of a
conditional write whose answer was lost. See docs/etcd-v3.rst, section "Inside the
transport".
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypedDict, TypeVar

from ..api import RendezvousConnectionError, RendezvousError
from ..metrics import MetricKind, record_metric
from .retry import CONNECTION, Deadline

__all__ = [
    "DELETE_ACTIONS",
    "WRITE_ACTIONS",
    "Attempt",
    "CompareFailedError",
    "ConnectionOptions",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "OperationRefusedError",
    "Outcome",
    "Transport",
    "TransportClosedError",
    "WatchHistoryLostError",
    "WatchStream",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
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

#: Actions (:attr:`Node.action`) of changes after which the node holds the key's new value.
WRITE_ACTIONS = frozenset({"set", "create", "update", "compareAndSwap"})
#: Actions of changes by which a key stops existing.
DELETE_ACTIONS = frozenset({"delete", "expire", "compareAndDelete"})


class _ConditionError(Exception):
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


class KeyNotFoundError(_ConditionError):
    """The key does not exist."""


class KeyExistsError(_ConditionError):
    """A create found the key already there."""


class CompareFailedError(_ConditionError):
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


class _AmbiguousError(Exception):
    """Raised by one request: it was sent but its outcome is unknown (lost answer,
    election timeout). :func:`try_once` makes it an :attr:`Outcome.UNKNOWN` attempt."""


class _UnsentError(Exception):
    """Raised by one request: it never reached the server (or was refused before being
    processed). :func:`try_once` makes it an :attr:`Outcome.UNSENT` attempt."""


class Outcome(enum.Enum):
    """What became of one request."""

    #: etcd answered and did it.
    APPLIED = "applied"
    #: etcd answered that a condition on the key failed (not a failure of the transport).
    REFUSED = "refused"
    #: It never reached a member, or a member refused it before proposing it: not
    #: applied, and safe to send again anywhere.
    UNSENT = "unsent"
    #: It was sent but its answer was lost: it may have been applied.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Attempt(Generic[_T]):
    """One request's :class:`Outcome`, with the answer (applied), the refusal (refused)
    or what went wrong (``"<endpoint>: <failure>"``, for unsent and unknown)."""

    outcome: Outcome
    result: _T | None = None
    refusal: _ConditionError | None = None
    failure: str = ""
    #: Set by the retry loop on its final attempt: an earlier copy's answer was lost.
    after_unknown: bool = False

    def unwrap(self) -> _T:
        """The answer of an applied attempt; raises the refusal of a refused one."""
        if self.outcome is Outcome.APPLIED:
            return self.result  # type: ignore[return-value]
        raise self.unwrap_refusal()

    def unwrap_refusal(self) -> _ConditionError:
        """The refusal of a refused attempt."""
        if self.refusal is None:
            raise RuntimeError(f"an attempt with outcome {self.outcome.value} has no refusal")
        return self.refusal


def try_once(
    send: Callable[[int, float | None], _T], endpoint: int, cap: float | None
) -> Attempt[_T]:
    """Run ``send(endpoint, cap)`` (one request) and return its :class:`Attempt`.

    ``send`` raises a condition error for a refusal, :class:`_UnsentError` or
    :class:`_AmbiguousError` for failures worth retrying, and a library error for
    permanent failures (which propagate).
    """
    try:
        return Attempt(Outcome.APPLIED, result=send(endpoint, cap))
    except _ConditionError as exc:
        return Attempt(Outcome.REFUSED, refusal=exc)
    except _UnsentError as exc:
        return Attempt(Outcome.UNSENT, failure=str(exc))
    except _AmbiguousError as exc:
        return Attempt(Outcome.UNKNOWN, failure=str(exc))


#: Transient answers of a member that refused a request before proposing it to raft
#: (no leader yet, not the leader, proposal dropped, overloaded): it was not applied.
_REJECTED_MARKERS = (
    "no leader",
    "not leader",
    "proposal dropped",
    "too many requests",
    "unhealthy cluster",
)
#: Every answer that an election (or an overloaded or stopping member) produces:
#: besides the refusals, "request timed out" (possibly due to previous leader failure)
#: and "leader changed", after which the request may still be applied.
ELECTION_MARKERS = (
    *_REJECTED_MARKERS,
    "timed out",
    "leader changed",
    "server stopped",
    "unavailable",
)


#: The ``op`` label of an operation's metrics, by the verb its messages use.
_OPS = {
    "refresh the TTL of": "refresh",
    "create the directory": "mkdir",
    "grant a lease for": "lease_grant",
    "read the lease of": "lease_read",
    "query the version of": "version",
    "query the status of": "status",
}


#: The metric labels (``op``, ``api``) of the operation the current thread is sending:
#: set by :meth:`Transport._operate` around each attempt, read by :func:`count_bytes`.
_sending = threading.local()


def count_bytes(api: str, sent: int, received: int, op: str | None = None) -> None:
    """Count the HTTP body bytes of one request (``sent``) and of its answer
    (``received``) as the metrics ``transport.bytes_sent`` and
    ``transport.bytes_received``, labelled with the ``op`` and ``api`` of the operation
    this thread is sending (``op``, when given, wins; ``other`` outside any)."""
    labels: dict[str, str] = dict(getattr(_sending, "labels", None) or {"api": api})
    labels["op"] = op or labels.get("op", "other")
    if sent:
        record_metric("transport.bytes_sent", sent, **labels)
    if received:
        record_metric("transport.bytes_received", received, **labels)


def op_name(what: str) -> str:
    """The ``op`` label of the metrics of an operation described as ``what``
    (``compare-and-swap`` -> ``compare_and_swap``)."""
    return _OPS.get(what) or what.replace("-", "_").replace(" ", "_")


def transient_answer(endpoint: str, text: str) -> Exception:
    """The retry loop's error for a transient error answer ``text`` of ``endpoint``.

    A refusal before the proposal (no leader, proposal dropped) is an
    :class:`_UnsentError`, sent again anywhere; anything else ("request timed out",
    "leader changed") an :class:`_AmbiguousError`: the write may still be applied, and
    a conditional write is resolved from the key's history.
    """
    if any(marker in text.lower() for marker in _REJECTED_MARKERS):
        return _UnsentError(f"{endpoint}: {text}")
    return _AmbiguousError(f"{endpoint}: {text}")


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
    def next(self, timeout: float) -> Node | None:
        """The next change, or ``None`` if none came within ``timeout`` seconds.

        The change is a :class:`Node` whose ``action``, ``value`` (the new value;
        ``None`` for a delete or an expiry), ``modified_index`` and ``etcd_index``
        describe it. ``timeout`` is also bounded by the calling thread's
        :meth:`Transport.bounded_by` deadline, as :meth:`Transport.watch` is.

        Raises:
            WatchHistoryLostError: etcd no longer holds the changes from
                :attr:`next_index` on; re-read the key and open a new stream.
            TransportClosedError: the stream or its transport was closed (before or
                during the wait).
            RendezvousConnectionError: etcd stayed unreachable for longer than the
                transport's ``read_timeout`` (outside a ``bounded_by`` block), and
                ``timeout`` has not passed yet.
        """

    def close(self) -> None:
        """End the stream and wake a thread blocked in :meth:`next`. Idempotent."""
        self._closed = True

    def _wake(self) -> None:
        """Called when the transport moves on to another endpoint (a stream listening to
        the one left re-arms; this one waits once per change, so there is nothing to do)."""

    def _check_open(self, transport: Transport) -> None:
        if self._closed or transport.closed:
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
    sleep: Callable[[float], None]


class Transport(_Closing):
    """A connection to an etcd cluster over one or more endpoints.

    Every operation retries failures that are worth retrying (unreachable endpoint,
    leader election, a lost answer) on the same or the next endpoint until its deadline:
    the innermost :meth:`bounded_by` deadline of the calling thread, or else
    ``read_timeout`` seconds. ``request_timeout`` bounds each single request, and
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
        read_timeout: the time budget for retrying a failed operation across endpoints
            before giving up with :class:`~etcd_rendezvous.api.RendezvousConnectionError`
            (unless the caller set a deadline with :meth:`bounded_by`).
        connect_timeout: seconds to wait for a TCP/TLS connection to one endpoint.
        request_timeout: seconds one request waits for an answer before the next
            endpoint is tried.
        silence_timeout: seconds a wait may hear nothing from its member before it is
            re-armed on the next endpoint (see :attr:`silence_timeout`).
        sleep: how the retry loop sleeps between attempts (a test may replace it).
    """

    #: ``"v2"`` or ``"v3"``: the etcd API this transport speaks.
    api: str = ""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        protocol: str = "http",
        cert: str | None = None,
        key: str | None = None,
        cacert: str | None = None,
        username: str | None = None,
        password: str | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        silence_timeout: float = DEFAULT_SILENCE_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Check and keep the options; an implementation then opens its clients."""
        if not endpoints:
            raise ValueError("endpoints: at least one etcd endpoint is required.")
        check_tls_options(protocol, cert, key)
        check_credentials(username, password)
        if read_timeout <= 0:
            raise ValueError(f"read_timeout: must be positive, got {read_timeout!r}.")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout: must be positive, got {connect_timeout!r}.")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout: must be positive, got {request_timeout!r}.")
        if silence_timeout <= 0:
            raise ValueError(f"silence_timeout: must be positive, got {silence_timeout!r}.")
        self._protocol = protocol
        self._cert = cert
        self._key = key
        self._cacert = cacert
        self._username = username
        self._password = password
        self._endpoints = [f"{protocol}://{format_host(h)}:{p}" for h, p in endpoints]
        self._read_timeout = float(read_timeout)
        self._connect_timeout = float(connect_timeout)
        self._request_timeout = min(float(request_timeout), self._read_timeout)
        self._silence_timeout = min(float(silence_timeout), self._read_timeout)
        self._sleep = sleep
        self._lock = threading.Lock()
        self._current = 0
        #: When each endpoint last answered (``time.monotonic()``; 0: never).
        self._heard = [0.0] * len(self._endpoints)
        self._last_index = 0
        self._closed = False
        self._scope = threading.local()
        self._watch_streams: weakref.WeakSet[WatchStream] = weakref.WeakSet()

    # -- properties and lifetime --------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The endpoint URLs, in configuration order."""
        return list(self._endpoints)

    @property
    def read_timeout(self) -> float:
        """The retry budget of an operation outside :meth:`bounded_by`, and the longest
        any request may wait for an answer."""
        return self._read_timeout

    @property
    def request_timeout(self) -> float:
        """Seconds one request waits for an answer before the next endpoint is tried
        (the opening of a watch included; never more than :attr:`read_timeout`)."""
        return self._request_timeout

    @property
    def silence_timeout(self) -> float:
        """Seconds a wait (a watch, v2's long poll) may hear nothing from its member --
        neither on the watch nor in answer to any other request of this connection --
        before it is re-armed, from the last index it saw, on the next endpoint: a
        frozen member cannot be told from an idle one (never more than
        :attr:`read_timeout`)."""
        return self._silence_timeout

    @property
    def connect_timeout(self) -> float:
        """Timeout for connecting to one endpoint, in seconds."""
        return self._connect_timeout

    @property
    def last_index(self) -> int:
        """The highest store index (revision) seen so far on this connection."""
        return self._last_index

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Close the watch streams and release pooled connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._watch_streams)
        for stream in streams:
            stream.close()
        self._release()

    def _adopt(self, stream: WatchStream) -> None:
        """Have :meth:`close` close ``stream`` (if it was not closed before)."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._watch_streams.add(stream)
        if closed:
            stream.close()

    @abc.abstractmethod
    def _release(self) -> None:
        """Release the implementation's network resources (called once)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoints={self._endpoints!r})"

    @contextlib.contextmanager
    def bounded_by(self, deadline: Deadline) -> Iterator[None]:
        """Bound every operation this thread starts inside the block by ``deadline``.

        Blocks nest; the earliest deadline wins. Used by the handlers so that an etcd
        call made on behalf of ``next_rendezvous()`` (or a store call) never outlives
        the caller's timeout, whatever ``read_timeout`` says.
        """
        outer: Deadline | None = getattr(self._scope, "deadline", None)
        self._scope.deadline = deadline if outer is None else outer.earlier(deadline)
        try:
            yield
        finally:
            self._scope.deadline = outer

    def bound(self, deadline: Deadline) -> Deadline:
        """``deadline``, or the deadline of this thread's innermost :meth:`bounded_by`
        block if that is earlier: for callers that loop over operations (waiting for a
        key, say) and must stop looping when the block's deadline passes."""
        scope: Deadline | None = getattr(self._scope, "deadline", None)
        return deadline if scope is None else scope.earlier(deadline)

    def _budget(self, budget: Deadline | None = None) -> Deadline:
        """The deadline of one operation: its own budget, capped by the thread's scope;
        without a budget of its own, the scope's deadline, or else ``read_timeout``."""
        if budget is not None:
            return self.bound(budget)
        scope: Deadline | None = getattr(self._scope, "deadline", None)
        return scope if scope is not None else Deadline(self._read_timeout)

    def _watch_budget(self, deadline: Deadline) -> Deadline:
        """How long a watch ending at ``deadline`` retries connection failures: until
        then inside a :meth:`bounded_by` block (the caller's deadline governs), else
        ``read_timeout`` at most, so that a watcher learns that etcd is gone."""
        if getattr(self._scope, "deadline", None) is not None:
            return deadline
        return deadline.earliest(self._read_timeout)

    # -- the interface --------------------------------------------------------------

    @abc.abstractmethod
    def server_version(self) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""

    @abc.abstractmethod
    def can_refresh_directory_ttl(self) -> bool:
        """Whether a directory created with a TTL can have that TTL refreshed."""

    @abc.abstractmethod
    def get(self, key: str) -> Node:
        """Read the value of ``key``.

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """

    @abc.abstractmethod
    def list_dir(self, key: str, *, recursive: bool = False) -> Node:
        """Read directory ``key``: a node with ``is_dir`` and its immediate children (all
        levels with ``recursive``; subdirectories are nodes with ``is_dir``).

        Raises:
            KeyNotFoundError: nothing exists at or below ``key``.
        """

    def try_get(self, key: str) -> Node | None:
        """Like :meth:`get`, but ``None`` for a missing key."""
        try:
            return self.get(key)
        except KeyNotFoundError:
            return None

    def watch(
        self, key: str, index: int, timeout: float, *, recursive: bool = False
    ) -> Node | None:
        """Wait for the first change of ``key`` (or below it) at or after ``index``.

        Returns the change, or ``None`` when ``timeout`` passed or etcd no longer holds
        history that old (callers re-read in both cases; :meth:`watch_stream` tells the
        two apart).

        Raises:
            RendezvousConnectionError: etcd stayed unreachable for longer than
                ``read_timeout`` (outside a :meth:`bounded_by` block, in which the watch
                retries until ``timeout`` instead), and ``timeout`` has not passed yet.
        """
        try:
            return self._wait_for_change(key, index, timeout, recursive=recursive)
        except WatchHistoryLostError:
            return None

    @abc.abstractmethod
    def _wait_for_change(
        self, key: str, index: int, timeout: float, *, recursive: bool
    ) -> Node | None:
        """:meth:`watch`, except that lost history raises :class:`WatchHistoryLostError`."""

    def watch_stream(self, key: str, start_index: int, *, recursive: bool = False) -> WatchStream:
        """The changes of ``key`` (or of every key below it, with ``recursive``) with an
        index of ``start_index`` or later, in order, as a :class:`WatchStream`.

        ``start_index`` 0 means "from now": the changes made after etcd registered the
        watch, which it does before this returns. Opening from now, then reading, is
        the way to follow a key that is changing fast: a v2 stream opened from an index
        in etcd's history costs one request per change until it catches up.

        The caller closes the stream (or uses it as a context manager); closing the
        transport ends it too. This implementation waits once per change (one watch
        request each; ``start_index`` 0 is refused); the transports override it with one
        request for all changes.
        """
        return _WaitingWatchStream(self, key, start_index, recursive)

    @abc.abstractmethod
    def check_writable(self, prefix: str) -> None:
        """Ask etcd whether this connection's user may write below ``prefix``, with a
        conditional write that cannot apply: nothing is written either way.

        Raises:
            RendezvousConnectionError: etcd refused it; the message names ``prefix``,
                the user and the permission missing.
        """

    def first_change_after(self, key: str, index: int) -> Node | None:
        """The first recorded change of ``key`` after ``index``; ``None`` if etcd no
        longer holds it or did not answer within :meth:`_lookup_deadline`.

        Raises:
            RendezvousConnectionError: etcd was unreachable.
        """
        try:
            return self._lookup_change(key, index)
        except WatchHistoryLostError:
            return None

    def _lookup_change(self, key: str, index: int) -> Node | None:
        """:meth:`first_change_after`, except that lost history raises
        :class:`WatchHistoryLostError` and an unreachable etcd
        :class:`RendezvousConnectionError`.

        Runs after the thread's :meth:`bounded_by` deadline if need be: it finds out
        the fate of a write that :meth:`_operate` sent after the deadline.
        """
        deadline = self._lookup_deadline()
        outer: Deadline | None = getattr(self._scope, "deadline", None)
        self._scope.deadline = deadline
        try:
            return self._wait_for_change(key, index + 1, deadline.remaining(), recursive=False)
        finally:
            self._scope.deadline = outer

    def _lookup_deadline(self) -> Deadline:
        """The deadline of a look into a key's history: ``request_timeout`` (within the
        thread's :meth:`bounded_by` deadline), and never less than :meth:`_last_chance`."""
        within = self.bound(Deadline(self._request_timeout)).remaining()
        return Deadline(max(within, self._last_chance()))

    @abc.abstractmethod
    def time_to_live(self, node: Node) -> int | None:
        """Seconds until ``node`` expires, or ``None`` if it has no TTL (or is gone)."""

    @abc.abstractmethod
    def set(self, key: str, value: str | None, *, ttl: int | None = None) -> Node:
        """Unconditionally write ``key`` (with a TTL, or none)."""

    @abc.abstractmethod
    def update(self, key: str, value: str, *, ttl: int, lease: int = 0) -> Node:
        """Rewrite the existing ``key`` with ``value``, keeping its creation index (its
        place among keys in created order); v2 restarts its TTL of ``ttl``.

        ``lease`` (v3): the lease of the caller's own last write of the key (as for
        :meth:`refresh`): the key is written with it, in one request, keeping its
        remaining TTL; if that lease is gone, with a new one of ``ttl``.

        Raises:
            KeyNotFoundError: the key is gone.
        """

    @abc.abstractmethod
    def refresh(self, key: str, ttl: int, *, timeout: float | None = None, lease: int = 0) -> Node:
        """Reset the TTL of an existing key without changing its value or waking watchers.

        ``timeout`` bounds the time spent retrying failures (default: the read timeout).
        ``lease`` (v3): the lease of the caller's own last write of the key (the
        ``lease`` of the :class:`Node` that write returned, or of the last refresh), for
        a key no one else writes: it is kept alive without reading the key first. The
        returned node's ``lease`` is the one to pass next time.

        Raises:
            KeyNotFoundError: the key (or its TTL) is gone.
        """

    @abc.abstractmethod
    def mkdir(self, key: str, *, ttl: int | None = None) -> bool:
        """Create directory ``key`` unless it exists. Returns whether it was created."""

    @abc.abstractmethod
    def create(self, key: str, value: str, *, ttl: int | None = None) -> Node:
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
        self, key: str, value: str, prev: Node | int, *, ttl: int | None = None
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

    @abc.abstractmethod
    def compare_and_delete(self, key: str, prev: Node) -> bool:
        """Delete ``key`` only if it is still ``prev``. Returns whether it did."""

    @abc.abstractmethod
    def delete(self, key: str, *, recursive: bool = False) -> bool:
        """Delete ``key`` (a directory and all below it with ``recursive``).

        Returns whether anything existed.
        """

    # -- shared machinery -------------------------------------------------------------

    def _note_index(self, node: Node) -> Node:
        self._last_index = max(self._last_index, node.etcd_index)
        return node

    def _note_revision(self, revision: int) -> None:
        self._last_index = max(self._last_index, revision)

    def _pick(self) -> int:
        with self._lock:
            return self._current

    def _heard_from(self, idx: int) -> None:
        """Endpoint ``idx`` answered (a request, or a message on a watch stream)."""
        self._heard[idx] = time.monotonic()

    def _silent_for(self, idx: int) -> float:
        """Seconds since endpoint ``idx`` last answered anything on this connection."""
        return time.monotonic() - self._heard[idx]

    def _rotate(self, failed: int, why: str = "failed", *, silent: bool = False) -> None:
        """Move on from endpoint ``failed`` to the next, if it is still the current one;
        ``why`` completes the log line ("etcd endpoint <url> <why>; switching to ...").

        ``silent``: the endpoint only said nothing for ``silence_timeout`` (an idle
        member looks the same): counted as ``transport.silent_rearms`` and logged at
        DEBUG, not as a failover. The metric is recorded, the line logged and the watch
        streams woken (those on ``failed`` re-arm) after the lock is released: a metrics
        handler may be slow, or use this connection.
        """
        with self._lock:
            if self._current != failed or len(self._endpoints) < 2:
                return
            self._current = (failed + 1) % len(self._endpoints)
            now = self._endpoints[self._current]
            streams = list(self._watch_streams)
        if silent:
            record_metric("transport.silent_rearms", api=self.api)
            level = logging.DEBUG
        else:
            record_metric("transport.failovers", api=self.api)
            level = logging.INFO
        logger.log(level, "etcd endpoint %s %s; switching to %s", self._endpoints[failed], why, now)
        for stream in streams:
            stream._wake()

    def _leave_silent(self, idx: int, what: str) -> None:
        """A wait (``what``) heard nothing from endpoint ``idx`` for ``silence_timeout``:
        go on with the next endpoint. A frozen member and an idle one look the same
        from here, and any member serves a wait as well as another."""
        silent = self._silent_for(idx)
        self._rotate(idx, f"said nothing for {silent:.1f} s while {what}", silent=True)

    def _operate(
        self,
        what: str,
        key: str,
        send: Callable[[int, float | None], _T],
        *,
        budget: Deadline | None = None,
        cap_requests: bool = True,
        pause_first: bool = False,
    ) -> Attempt[_T]:
        """Send one request after another, failing over, until etcd answers it or the
        operation's deadline passes; return the last :class:`Attempt` (applied or refused).

        ``send(endpoint, cap)`` sends one request to endpoint ``endpoint`` (an index into
        :attr:`endpoints`), waiting at most ``cap`` seconds for its answer (``None``: no
        cap); :func:`try_once` turns what it returns or raises into the attempt's
        outcome. Permanent failures propagate. However short the deadline, every
        endpoint gets one attempt and one more follows the last failure, each waiting at
        most :meth:`_last_chance` seconds once the deadline is near: a hung endpoint
        cannot hide a healthy one, and a write whose answer was lost is sent once more
        so that its fate can be found out. ``pause_first``: back off before the first
        attempt (a watch reopened after its answer broke).
        """
        if self._closed:
            raise TransportClosedError(
                f"Could not {what} {key!r}: the etcd connection to "
                f"{', '.join(self._endpoints)} is closed."
            )
        deadline = self._budget(budget)
        retry = dataclasses.replace(CONNECTION, sleep=self._sleep).start(deadline)
        if pause_first:
            retry.pause()
        floor = self._last_chance()
        failures: list[str] = []
        unknown = False
        labels = {"op": op_name(what), "api": self.api}
        started = time.monotonic()
        while True:
            endpoint = self._pick()
            cap = min(self._request_timeout, max(deadline.remaining(), floor))
            record_metric("transport.requests", **labels)
            outer, _sending.labels = getattr(_sending, "labels", None), labels
            try:
                attempt = try_once(send, endpoint, cap if cap_requests else None)
            except BaseException:  # a permanent failure
                self._record_duration(labels, started)
                raise
            finally:
                _sending.labels = outer
            if attempt.outcome in (Outcome.APPLIED, Outcome.REFUSED):
                self._record_duration(labels, started)
                return dataclasses.replace(attempt, after_unknown=unknown)
            # Unsent or unknown: the next endpoint may serve us (an election, a member
            # gone); a write of unknown outcome is sent again, conditional writes
            # being settled by :meth:`_settle`.
            failures.append(attempt.failure)
            unknown = unknown or attempt.outcome is Outcome.UNKNOWN
            self._rotate(endpoint)
            if self._closed:
                raise TransportClosedError(
                    f"Could not {what} {key!r}: the etcd connection was closed."
                )
            if deadline.expired() and len(failures) > len(self._endpoints):
                self._record_duration(labels, started)
                raise RendezvousConnectionError(self._unreachable_message(what, key, failures))
            logger.debug("Could not %s %r (%s); retrying", what, key, attempt.failure)
            record_metric("transport.retries", outcome=attempt.outcome.value, **labels)
            retry.pause()

    @staticmethod
    def _record_duration(labels: dict[str, str], started: float) -> None:
        elapsed = time.monotonic() - started
        record_metric("transport.request_seconds", elapsed, MetricKind.TIMING, **labels)

    def _last_chance(self) -> float:
        """Seconds one attempt may wait for an answer once the deadline is (nearly) past.

        The attempts owed after the deadline (one per endpoint, and one more) share
        about a second between them, and each gets at least a quarter of one: enough
        for a healthy member to answer, little enough that no operation outlives its
        caller's deadline by more than a second or so.
        """
        share = max(0.25, 1.0 / (len(self._endpoints) + 1))
        return min(share, self._request_timeout)

    def _unreachable_message(self, what: str, key: str, failures: list[str]) -> str:
        tried = ", ".join(dict.fromkeys(f.split(": ", 1)[0] for f in failures))
        message = (
            f"Could not {what} {key!r}: etcd unreachable or unavailable at {tried} "
            f"(last error: {failures[-1]})."
        )
        # An https endpoint closes a plain-http connection without an answer.
        dropped = ("RemoteDisconnected", "Connection aborted", "without response")
        plain = all(endpoint.startswith("http://") for endpoint in self._endpoints)
        # Only when every attempt was dropped: a server that was killed mid-request
        # drops one, then refuses the next.
        if plain and all(any(d in f for d in dropped) for f in failures):
            message += (
                " The server closed the connection without an answer: if the endpoint "
                "serves https, use protocol 'https' (and cacert)."
            )
        return message

    def _settle(
        self, what: str, key: str, value: str, since: int | None, done: Attempt[Node]
    ) -> Node:
        """The result of a conditional write whose last copy etcd answered (``done``).

        If an earlier copy's answer was lost and the last copy was refused, the earlier
        copy may be the reason: every copy compared against the same state (``since``,
        the modification index compared against; ``None`` for a create), so the first
        change after that state is decisive. It is ours if it carries ``value``: callers
        make each conditional write's value its own (a tag), or write values whose
        meaning is the same whoever wrote them (see :doc:`how-it-works`). If etcd no
        longer holds that change, or it could not be read in time (even past the
        thread's deadline, see :meth:`_lookup_change`), the refusal is raised with
        ``outcome_unknown`` set and ``unknown_because`` saying which.
        """
        if not done.after_unknown:
            return self._note_index(done.unwrap())
        op = op_name(what)
        record_metric("transport.outcome_unknown", op=op)
        if done.outcome is Outcome.APPLIED:
            # A copy sent after the lost answer was applied (the lost one was not).
            record_metric("transport.outcome_resolved", op=op, result="resent")
            return self._note_index(done.unwrap())
        refusal = done.unwrap_refusal()
        try:
            change = self._change_to_examine(key, since)
            lost = "its history could not be checked in time (etcd slow or unreachable)"
        except WatchHistoryLostError:
            change = None
            lost = "etcd no longer holds the history that tells whether it was applied"
        except KeyNotFoundError:
            change = None
            lost = "the key was deleted before its history could be checked"
        except RendezvousConnectionError as exc:
            change = None
            lost = f"its history could not be checked ({str(exc).rstrip('.')})"
        if change is not None and change.value == value and change.action != "expire":
            logger.info("%s of %s was applied by an earlier attempt", what, key)
            record_metric("transport.outcome_resolved", op=op, result="applied")
            return self._note_index(change)
        record_metric("transport.outcome_resolved", op=op, result="not_applied")
        if change is None:
            refusal.outcome_unknown = True
            refusal.unknown_because = lost
        raise refusal

    def _change_to_examine(self, key: str, since: int | None) -> Node | None:
        """The first change after ``since`` (for a create: the one that made the key's
        current version); ``None`` if etcd did not answer in time.

        Raises:
            WatchHistoryLostError: etcd no longer holds that change.
            KeyNotFoundError: a create's key is gone, and with it its creation index.
            RendezvousConnectionError: etcd was unreachable.
        """
        if since is not None:
            return self._lookup_change(key, since)
        # A create: look at how the key's current version came to be.
        current = self.get(key)
        if current.created_index == current.modified_index:
            return current  # not changed since it was created
        return self._lookup_change(key, current.created_index - 1)


class _WaitingWatchStream(WatchStream):
    """A :class:`WatchStream` made of one :meth:`Transport.watch` per change.

    For transports without a streaming watch. :meth:`close` from another thread takes
    effect when the pending wait ends, or at once if the transport is closed.
    Changes that share an index (v3 transactions that change several keys below a
    recursive stream's prefix) are delivered only once: the first of them.
    """

    def __init__(self, transport: Transport, key: str, start_index: int, recursive: bool) -> None:
        if start_index < 1:
            raise ValueError(f"start_index: waiting watches need an index, got {start_index}.")
        super().__init__(key, start_index, recursive)
        self._transport = transport

    def next(self, timeout: float) -> Node | None:
        """The next change, or ``None`` after ``timeout`` seconds (see
        :meth:`WatchStream.next`)."""
        self._check_open(self._transport)
        change = self._transport._wait_for_change(
            self._key, self._next_index, timeout, recursive=self._recursive
        )
        self._check_open(self._transport)
        if change is not None:
            self._next_index = max(self._next_index, change.modified_index + 1)
        return change


def format_host(host: str) -> str:
    """``host`` as it goes into a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_tls_options(protocol: str, cert: str | None, key: str | None) -> None:
    """Validate the protocol and client-certificate options shared by both transports."""
    if protocol not in ("http", "https"):
        raise ValueError(f"protocol: must be 'http' or 'https', got {protocol!r}.")
    if key is not None and cert is None:
        raise ValueError("key: a client key needs a client certificate ('cert').")


def check_credentials(username: str | None, password: str | None) -> None:
    """Validate that ``username`` and ``password`` come together."""
    if (username is None) != (password is None):
        raise ValueError("username/password: give both or neither.")
