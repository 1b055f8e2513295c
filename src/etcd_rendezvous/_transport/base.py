"""What the v2 and v3 transports share: their options and :class:`Endpoints`, their
lifetime, and the settling of a conditional write whose answer was lost (from the key's
history). See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence

from ..api import Deadline, RendezvousConnectionError
from ..metrics import record_metric
from .attempt import Attempt, Outcome, settled
from .clock import ServerClock
from .endpoints import Access, Endpoints, Timeouts
from .interface import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SILENCE_TIMEOUT,
    KeyNotFoundError,
    Node,
    Transport,
    WatchHistoryLostError,
    WatchStream,
)
from .metering import op_name

__all__ = ["Connection"]

logger = logging.getLogger(__name__)


class Connection(Transport):
    """The shared part of a :class:`~etcd_rendezvous._transport.interface.Transport`
    implementation (whose options it checks and keeps; see there): it owns the
    :class:`~etcd_rendezvous._transport.endpoints.Endpoints` its requests and watch
    streams go through. An implementation opens its clients and implements the rest.
    """

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
        quorum_reads: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Check and keep the options; an implementation then opens its clients."""
        if not endpoints:
            raise ValueError("endpoints: at least one etcd endpoint is required.")
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol: must be 'http' or 'https', got {protocol!r}.")
        if key is not None and cert is None:
            raise ValueError("key: a client key needs a client certificate ('cert').")
        if (username is None) != (password is None):
            raise ValueError("username/password: give both or neither.")
        if read_timeout <= 0:
            raise ValueError(f"read_timeout: must be positive, got {read_timeout!r}.")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout: must be positive, got {connect_timeout!r}.")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout: must be positive, got {request_timeout!r}.")
        if silence_timeout <= 0:
            raise ValueError(f"silence_timeout: must be positive, got {silence_timeout!r}.")
        #: What the implementation's clients need to reach the endpoints.
        self._access = Access(protocol, cert, key, cacert, username, password)
        timeouts = Timeouts(read_timeout, connect_timeout, request_timeout, silence_timeout)
        self._endpoints = Endpoints(endpoints, protocol, self.api, timeouts, sleep)
        self._clock = ServerClock()
        self._last_index = 0
        #: Whether v2 reads go through the cluster's consensus (``quorum=true``).
        self._quorum_reads = quorum_reads

    # -- properties and lifetime --------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The endpoint URLs, in configuration order."""
        return self._endpoints.urls

    @property
    def read_timeout(self) -> float:
        """The deadline, from the call, of an operation given none (and the longest any
        request may wait for an answer)."""
        return self._endpoints.timeouts.read

    @property
    def request_timeout(self) -> float:
        """Seconds one request waits for an answer before the next endpoint is tried
        (never more than :attr:`read_timeout`)."""
        return self._endpoints.timeouts.request

    @property
    def silence_timeout(self) -> float:
        """Seconds a wait may hear nothing from its member before it is re-armed on the
        next endpoint (never more than :attr:`read_timeout`)."""
        return self._endpoints.timeouts.silence

    @property
    def connect_timeout(self) -> float:
        """Timeout for connecting to one endpoint, in seconds (never more than the
        request's own timeout)."""
        return self._endpoints.timeouts.connect

    @property
    def last_index(self) -> int:
        """The highest store index (revision) seen so far on this connection, in an
        answer or a change it noted."""
        return self._last_index

    @property
    def clock(self) -> ServerClock:
        """See base class."""
        return self._clock

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._endpoints.closed

    def close(self) -> None:
        """Close the watch streams and release pooled connections. Idempotent."""
        if self._endpoints.closed:
            return
        for stream in self._endpoints.close():
            stream.close()
        self._release()

    def _adopt(self, stream: WatchStream) -> None:
        """Have :meth:`close` close ``stream`` (at once if this is closed already)."""
        if not self._endpoints.adopt(stream):
            stream.close()

    @abc.abstractmethod
    def _release(self) -> None:
        """Release the implementation's network resources (called once)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoints={self._endpoints.urls!r})"

    def _deadline(self, deadline: Deadline | None) -> Deadline:
        """The deadline of an operation: the caller's, or else ``read_timeout`` from now."""
        return self._endpoints.deadline(deadline)

    # -- waiting ----------------------------------------------------------------------

    def watch(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool = False
    ) -> Node | None:
        """Wait for the first change of ``key`` (or below it) at or after ``index`` (see
        :meth:`Transport.watch <etcd_rendezvous._transport.interface.Transport.watch>`)."""
        try:
            return self._wait_for_change(key, index, deadline, recursive=recursive)
        except WatchHistoryLostError:
            return None

    @abc.abstractmethod
    def _wait_for_change(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool
    ) -> Node | None:
        """:meth:`watch`, except that lost history raises :class:`WatchHistoryLostError`."""

    def first_change_after(
        self, key: str, index: int, *, deadline: Deadline | None = None
    ) -> Node | None:
        """The first recorded change of ``key`` after ``index``; ``None`` if etcd no
        longer holds it or did not answer within :meth:`_lookup_deadline`.

        Raises:
            RendezvousConnectionError: etcd was unreachable.
        """
        try:
            return self._lookup_change(key, index, deadline)
        except WatchHistoryLostError:
            return None

    def _lookup_change(self, key: str, index: int, deadline: Deadline | None) -> Node | None:
        """:meth:`first_change_after`, except that lost history raises
        :class:`WatchHistoryLostError` and an unreachable etcd
        :class:`RendezvousConnectionError`.

        Runs past ``deadline`` if need be (see :meth:`_lookup_deadline`): it finds out
        the fate of a write that the failover loop sent at that deadline.
        """
        lookup = self._lookup_deadline(deadline)
        return self._wait_for_change(key, index + 1, lookup, recursive=False)

    def _lookup_deadline(self, deadline: Deadline | None) -> Deadline:
        """The deadline of a look into a key's history for an operation ending at
        ``deadline``: ``request_timeout`` at most, by ``deadline`` if it leaves time, and
        never less than :meth:`Endpoints.last_chance
        <etcd_rendezvous._transport.endpoints.Endpoints.last_chance>`."""
        within = self._endpoints.timeouts.request
        if deadline is not None:
            within = min(within, deadline.remaining())
        return Deadline(max(within, self._endpoints.last_chance()))

    # -- what a write answers ---------------------------------------------------------

    def _note_index(self, node: Node) -> Node:
        self._last_index = max(self._last_index, node.etcd_index)
        return node

    def _note_revision(self, revision: int) -> None:
        self._last_index = max(self._last_index, revision)

    def _settle(
        self,
        what: str,
        key: str,
        value: str,
        since: int | None,
        done: Attempt[Node],
        deadline: Deadline,
    ) -> Node:
        """The result of a conditional write whose last copy etcd answered (``done``),
        sent until ``deadline``.

        If an earlier copy's answer was lost and the last copy was refused (for its
        state, or its size), the earlier copy may be the reason: every copy compared
        against the same state (``since``, the modification index compared against;
        ``None`` for a create), so the first change after that state, looked up even
        past ``deadline`` (see :meth:`_lookup_change`), decides (see
        :func:`~etcd_rendezvous._transport.attempt.settled`).
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
            change = self._change_to_examine(key, since, deadline)
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
        try:
            ours = settled(refusal, value, change, lost)
        except BaseException:
            record_metric("transport.outcome_resolved", op=op, result="not_applied")
            raise
        logger.info("%s of %s was applied by an earlier attempt", what, key)
        record_metric("transport.outcome_resolved", op=op, result="applied")
        return self._note_index(ours)

    def _change_to_examine(self, key: str, since: int | None, deadline: Deadline) -> Node | None:
        """The first change after ``since`` (for a create: the one that made the key's
        current version); ``None`` if etcd did not answer in time.

        Raises:
            WatchHistoryLostError: etcd no longer holds that change.
            KeyNotFoundError: a create's key is gone, and with it its creation index.
            RendezvousConnectionError: etcd was unreachable.
        """
        if since is not None:
            return self._lookup_change(key, since, deadline)
        # A create: look at how the key's current version came to be.
        current = self.get(key, deadline=deadline)
        if current.created_index == current.modified_index:
            return current  # not changed since it was created
        return self._lookup_change(key, current.created_index - 1, deadline)
