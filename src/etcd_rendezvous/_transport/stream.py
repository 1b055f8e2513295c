"""A :class:`~etcd_rendezvous._transport.interface.WatchStream` over one long-lived HTTP answer.

:class:`StreamingWatch` holds what the v2 and v3 streaming watches share: a reader thread
per answer that buffers its changes, reopening from the index after the last change
received (through the transport's retry loop, on the next endpoint), re-arming a wait
whose member went silent or was left, and lost history as a final error. Subclasses
send the request and parse the answer. See docs/etcd-v3.rst, section "Inside the
transport".
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import socket
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..api import Deadline, RendezvousConnectionError, RendezvousError
from ..metrics import record_metric
from .attempt import AmbiguousError
from .endpoints import Endpoints
from .interface import Node, WatchHistoryLostError, WatchStream
from .metering import count_bytes
from .retry import REWATCH

__all__ = [
    "Changes",
    "Messages",
    "Registered",
    "StreamingWatch",
    "hold_socket_open",
    "iter_objects",
    "shutdown_socket",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Changes:
    """A message of a watch answer that carries changes (possibly none)."""

    nodes: list[Node]


@dataclass(frozen=True)
class Registered:
    """A message by which etcd confirms that the watch is in place (v3's ``created``),
    registered at store index ``index`` (0: unknown)."""

    index: int


#: What a subclass's parser yields: one item per message of an answer.
Messages = Iterator[Changes | Registered]

#: The reader stops reading while this many changes wait in the buffer, so that a
#: stream nobody reads cannot grow without bound (etcd then drops or slows the watcher).
_MAX_BUFFERED = 10_000


class _Feed:
    """One watch answer and the state of the thread that reads it."""

    __slots__ = ("changes", "ended", "endpoint", "failure", "ready", "response")

    def __init__(self, endpoint: int, response: Any, ready: bool) -> None:
        #: The index of the endpoint that answered, in the transport's list.
        self.endpoint = endpoint
        self.response = response
        #: Whether etcd confirmed that the watch is in place.
        self.ready = ready
        #: How many changes it brought.
        self.changes = 0
        #: Whether the answer is over; ``failure`` says why (``None``: it ended normally).
        self.ended = False
        self.failure: BaseException | None = None

    def stop(self) -> None:
        shutdown_socket(self.response)


class StreamingWatch(WatchStream):
    """A watch stream made of one streaming answer at a time (see the module docstring).

    Subclasses implement :meth:`_send`. Made by a transport's ``watch_stream``, which
    calls :meth:`start`; :meth:`next` opens it if it is not open yet.
    """

    #: Whether an answer with status 200 means that the watch is in place (v2); if not,
    #: :meth:`_open` waits for the parser to yield :class:`Registered` (v3's ``created``).
    confirmed_by_status = True

    def __init__(self, endpoints: Endpoints, key: str, start_index: int, recursive: bool) -> None:
        super().__init__(key, start_index, recursive)
        #: The connection's endpoints, which the stream follows and opens answers on.
        self._endpoints = endpoints
        self._cond = threading.Condition()
        self._events: deque[Node] = deque()
        #: The index to send the next watch request from: after the last change received.
        self._resume = self._next_index
        self._feed: _Feed | None = None
        #: A permanent failure, raised once the buffered changes have been delivered.
        self._failed: RendezvousError | None = None
        self._feeds: set[_Feed] = set()
        #: How many answers in a row ended without bringing a change.
        self._barren = 0
        self._finalizer = weakref.finalize(self, _stop_all, self._feeds)

    # -- what a subclass does -------------------------------------------------------

    @abc.abstractmethod
    def _send(self, endpoint: int, from_index: int, deadline: Deadline) -> tuple[Any, Messages]:
        """Send a watch request from ``from_index`` to endpoint ``endpoint``.

        Returns the answer (urllib3 response, status 200, body not
        read) and the parser of its body, run by the reader thread. Sending raises the
        transport's classified errors (:class:`UnsentError`, :class:`AmbiguousError`,
        a library error, or :class:`WatchHistoryLostError`); so does the parser for what
        etcd says in the answer. The parser raises :class:`AmbiguousError` when the
        answer breaks, and returns when etcd ended it normally (then it is reopened at
        once if it brought a change). After a failure the stream moves on to the next
        endpoint; the parser does not.
        """

    # -- the interface --------------------------------------------------------------

    @property
    def next_index(self) -> int:
        """The index (revision) the stream will deliver changes from next."""
        with self._cond:
            return self._events[0].modified_index if self._events else self._resume

    def start(self, deadline: Deadline) -> None:
        """Open the stream now (so that later writes stream at once), retrying like any
        operation of the transport until ``deadline``. A lost history is raised by
        :meth:`next`.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable until ``deadline``.
        """
        try:
            self._reopen(None, deadline, give_up_at_deadline=False)
        except WatchHistoryLostError:
            pass
        except BaseException:
            self.close()
            raise

    def next(self, deadline: Deadline, *, give_up_after: float | None = None) -> Node | None:
        """The next change, or ``None`` at ``deadline`` (see :meth:`WatchStream.next`).

        A wait that heard nothing from its member for the transport's
        ``silence_timeout`` (neither on this stream nor in answer to any other request
        of the connection), or whose member the connection left after a failure, is
        re-armed on the next endpoint: a new answer from the index after the last
        change received. A frozen member cannot be told from an idle one, and any
        member serves a watch as well as another.
        """
        while True:
            silent: _Feed | None = None
            with self._cond:
                self._check_open(self._endpoints.closed)
                if self._events:
                    if len(self._events) >= _MAX_BUFFERED:
                        self._cond.notify_all()
                    return self._events.popleft()
                if self._failed is not None:
                    raise self._failed
                feed = self._feed
                if feed is not None and not feed.ended:
                    if deadline.expired():
                        return None
                    patience = self._patience(feed)
                    if patience > 0:
                        # Woken early by a change, or when the connection leaves the
                        # member (:meth:`wake`).
                        self._cond.wait(min(deadline.remaining(), patience))
                        continue
                    self._feed = None  # re-armed below
                    silent, feed = feed, None
            if silent is not None:
                self._abandon(silent)
            if deadline.expired():
                return None
            # Reopened by the caller's deadline, or within give_up_after (then a failure
            # that lasts is raised: the caller must learn that etcd is gone).
            retry = deadline if give_up_after is None else deadline.earliest(give_up_after)
            if not self._reopen(feed, retry, give_up_at_deadline=retry is deadline):
                return None

    def wake(self) -> None:
        """The transport moved on to another endpoint: a waiting :meth:`next` looks again
        at whether its member was left."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """End the stream: its socket is shut down and a blocked :meth:`next` raises
        :class:`TransportClosedError`. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            feed, self._feed = self._feed, None
            self._events.clear()
            self._cond.notify_all()
        if feed is not None:
            feed.stop()

    # -- opening and reopening --------------------------------------------------------

    def _patience(self, feed: _Feed) -> float:
        """Seconds a wait may still listen to ``feed`` before re-arming (0: now)."""
        endpoints = self._endpoints
        if endpoints.pick() != feed.endpoint:
            return 0.0  # a request to that member failed: the connection moved on
        return endpoints.timeouts.silence - endpoints.silent_for(feed.endpoint)

    def _abandon(self, feed: _Feed) -> None:
        """Stop ``feed``, whose member went silent (or was left), to re-arm the stream
        on the next endpoint."""
        endpoints = self._endpoints
        if endpoints.pick() == feed.endpoint:
            endpoints.leave_silent(feed.endpoint, f"watching {self._key!r}")
        logger.debug("Watch of %s re-armed from index %d", self._key, self._resume)
        feed.stop()

    def _reopen(self, feed: _Feed | None, deadline: Deadline, *, give_up_at_deadline: bool) -> bool:
        """Open a new answer from :attr:`_resume` in place of ``feed`` (ended, or
        ``None``), retrying until ``deadline``. Returns whether it did: with
        ``give_up_at_deadline``, ``False`` when etcd was unreachable until the deadline
        (else that raises :class:`RendezvousConnectionError`)."""
        failed = feed is not None and self._retire(feed, deadline)
        if feed is not None:
            record_metric("transport.watch_restarts", api=self._endpoints.api)
        endpoints = self._endpoints
        try:
            endpoints.operate(
                "watch",
                self._key,
                lambda endpoint, _cap: self._open(endpoint, deadline),
                deadline=deadline,
                cap_requests=False,
                pause_first=failed,
            ).unwrap()
        except WatchHistoryLostError as exc:
            with self._cond:
                self._failed = exc
            raise
        except RendezvousConnectionError:
            if give_up_at_deadline and deadline.expired():
                return False
            raise
        return True

    def _retire(self, feed: _Feed, deadline: Deadline) -> bool:
        """Drop ``feed``, which ended; return whether it failed (then the stream backs
        off before reopening, on the next endpoint)."""
        with self._cond:
            if self._feed is feed:
                self._feed = None
        self._barren = 0 if feed.changes else self._barren + 1
        if self._barren > 1:
            # Answers that keep ending without a change: back off further.
            self._endpoints.sleep(min(REWATCH.delay(self._barren), max(deadline.remaining(), 0)))
        if feed.failure is None and feed.changes:
            return False
        # The member may be gone: try the next one.
        self._endpoints.rotate(feed.endpoint)
        return True

    def _open(self, endpoint: int, deadline: Deadline) -> None:
        """One attempt on endpoint ``endpoint``: send the request and start its reader;
        where etcd confirms a watch in the answer, wait for that (until ``deadline``)."""
        response, batches = self._send(endpoint, self._resume, deadline)
        feed = _Feed(endpoint, response, ready=self.confirmed_by_status)
        with self._cond:
            if self._closed:
                feed.stop()
                response.close()
                self._check_open(self._endpoints.closed)
            self._feed = feed
            self._feeds.add(feed)
        thread = threading.Thread(
            target=_read,
            args=(weakref.ref(self), feed, batches, self._feeds),
            name=f"etcd-watch {self._key}",
            daemon=True,
        )
        thread.start()
        # A live member confirms a new watch at once: one that does not within
        # request_timeout is left for the next endpoint.
        confirm = deadline.earliest(self._endpoints.timeouts.request)
        with self._cond:
            while not (feed.ready or feed.ended or confirm.expired()):
                self._cond.wait(confirm.remaining())
            unconfirmed = not (feed.ready or feed.ended or deadline.expired())
            refused = feed.failure if feed.ended and isinstance(feed.failure, Exception) else None
            if (unconfirmed or refused is not None) and self._feed is feed:
                self._feed = None
        if unconfirmed:
            feed.stop()
            raise AmbiguousError(
                f"{self._endpoints.url(endpoint)}: the watch of {self._key!r} was "
                f"not confirmed within {self._endpoints.timeouts.request:g} s"
            )
        if refused is not None:
            # Refused when it was created (an expired token, say): the caller
            # classifies it as for any request.
            raise refused

    # -- called by the reader thread --------------------------------------------------

    def _take(self, feed: _Feed, message: Changes | Registered) -> bool:
        """Buffer what the reader parsed. Returns whether to keep reading."""
        self._endpoints.heard_from(feed.endpoint)
        if isinstance(message, Changes) and message.nodes:
            record_metric("transport.watch_events", len(message.nodes), api=self._endpoints.api)
        with self._cond:
            if feed is not self._feed or self._closed:
                return False
            if isinstance(message, Registered):
                feed.ready = True
                self._registered_at(message.index)
            else:
                # After a reopen, etcd starts at _resume: nothing before it is new. The
                # changes of one index (a v3 transaction) always come in one message.
                fresh = [node for node in message.nodes if node.modified_index >= self._resume]
                self._events.extend(fresh)
                feed.changes += len(fresh)
                if fresh:
                    self._resume = max(node.modified_index for node in fresh) + 1
                while len(self._events) >= _MAX_BUFFERED and feed is self._feed:
                    self._cond.wait()
            self._cond.notify_all()
            return feed is self._feed and not self._closed

    def _registered_at(self, index: int) -> None:
        """etcd registered the watch at ``index``: a stream opened from now (``_resume``
        0) delivers the changes after it, and reopens from there. Called with the lock
        held, or before the answer's reader starts."""
        if self._resume == 0 and index > 0:
            self._resume = index + 1

    def _follow(self, feed: _Feed) -> None:
        """Replace ``feed``, which etcd ended after delivering changes (v2, for a change
        found in its history), at once: the sooner etcd watches again, the fewer of the
        changes still to come land in the history, each costing a request of its own.
        Called by the reader before it marks ``feed`` as ended, so :meth:`next` keeps
        waiting meanwhile; a failure here ends ``feed`` with it (:meth:`next` retries)."""
        with self._cond:
            if feed is not self._feed or self._closed:
                return
        self._open(self._endpoints.pick(), Deadline(self._endpoints.timeouts.read))

    def _end(self, feed: _Feed, failure: BaseException | None) -> None:
        with self._cond:
            feed.ended = True
            feed.failure = failure
            current = feed is self._feed and not self._closed
            if current and isinstance(failure, RendezvousError):
                # A permanent refusal (lost history, permissions): final.
                self._failed = failure
            if current and failure is not None and not isinstance(failure, RendezvousError):
                logger.debug("Watch stream of %s ended (%s); reopening", self._key, failure)
            self._cond.notify_all()


def _read(
    ref: weakref.ReferenceType[StreamingWatch],
    feed: _Feed,
    messages: Messages,
    feeds: set[_Feed],
) -> None:
    """The reader thread: buffer each message of ``feed`` into the stream ``ref``, until
    the answer ends or the stream no longer wants it."""
    failure: BaseException | None = None
    try:
        for message in messages:
            stream = ref()
            if stream is None or not stream._take(feed, message):
                return
            del stream
        stream = ref()
        if stream is not None and feed.changes:
            stream._follow(feed)
    except BaseException as exc:
        failure = exc
    finally:
        with contextlib.suppress(Exception):
            feed.response.close()
        feeds.discard(feed)
        stream = ref()
        if stream is not None:
            stream._end(feed, failure)


def _stop_all(feeds: set[_Feed]) -> None:
    for feed in list(feeds):
        feed.stop()


def hold_socket_open(response: Any) -> None:
    """Let the rest of ``response`` be read without a timeout: the request's read timeout
    was for its answer to start; a watch may then stay silent for as long as nothing
    changes."""
    sock = _socket_of(response)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.settimeout(None)


def shutdown_socket(response: Any) -> None:
    """Wake a thread blocked reading ``response`` by shutting down its socket."""
    sock = _socket_of(response)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _socket_of(response: Any) -> Any:
    connection = getattr(response, "connection", None) or getattr(response, "_connection", None)
    return getattr(connection, "sock", None)


def iter_objects(chunks: Iterable[bytes], api: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a watch stream, however its chunks split them; every chunk's
    bytes are counted as ``transport.bytes_received`` of op ``watch`` on ``api``.

    A chunk may hold several objects, part of one, or whitespace between them.

    Raises:
        TypeError: the stream holds JSON that is not an object.
    """
    decoder = json.JSONDecoder()
    buffer = ""
    pending = b""
    for chunk in chunks:
        count_bytes(0, len(chunk), api=api, op="watch")
        pending += chunk
        try:
            buffer += pending.decode("utf-8")
        except UnicodeDecodeError:
            # A multi-byte character split across chunks: wait for the rest.
            continue
        pending = b""
        while True:
            buffer = buffer.lstrip()
            if not buffer:
                break
            try:
                obj, end = decoder.raw_decode(buffer)
            except ValueError:
                if len(buffer) > 64 * 1024 * 1024:
                    raise
                break  # an incomplete object: wait for more
            if not isinstance(obj, dict):
                raise TypeError(f"watch stream: expected a JSON object, got {obj!r:.100}")
            yield obj
            buffer = buffer[end:]
