"""The endpoints of one connection and its failover state: which endpoint requests go
to, when each last answered, and the failover loop that sends one request after another
until etcd answers or the operation's deadline passes.

A connection owns one :class:`Endpoints` and hands it to its watch streams, which
re-arm on the endpoint it picks. See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3

from ..api import Deadline, RendezvousConnectionError
from ..metrics import MetricKind, record_metric
from .attempt import Attempt, Outcome, try_once
from .interface import TransportClosedError, WatchStream
from .metering import op_name
from .retry import CONNECTION

__all__ = ["Access", "Endpoints", "Timeouts", "close_pool", "format_host"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How many times an operation doubles ``request_timeout`` for its later attempts (see
#: :meth:`Endpoints.operate`): 3 s becomes at most 48 s, within the operation's deadline.
_MAX_DOUBLINGS = 4


def format_host(host: str) -> str:
    """``host`` as it goes into a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class Access:
    """How a connection reaches its endpoints and who it is there: the ``protocol``,
    TLS files and etcd user of :class:`~etcd_rendezvous._transport.interface.Transport`."""

    protocol: str
    cert: str | None = None
    key: str | None = None
    cacert: str | None = None
    username: str | None = None
    password: str | None = None

    def pool(self, endpoints: int, per_endpoint: int) -> urllib3.PoolManager:
        """A connection's pool of HTTP connections to its ``endpoints`` (keeping
        ``per_endpoint`` idle connections to each), verifying the server and presenting
        the client certificate over https, and never re-sending a request."""
        options: dict[str, Any] = {"retries": False, "maxsize": per_endpoint}
        if self.protocol == "https":
            options.update(cert_reqs="CERT_REQUIRED", ca_certs=self.cacert)
            if self.cert:
                options.update(cert_file=self.cert, key_file=self.key)
        return urllib3.PoolManager(num_pools=endpoints, **options)


def close_pool(manager: urllib3.PoolManager) -> None:
    """Close every connection of ``manager``, a pool made by :meth:`Access.pool`, and
    forget them: the next request connects afresh.

    ``PoolManager.clear()`` alone only forgets its per-host pools: urllib3 2 closes
    their idle connections when the garbage collector collects them, which leaves them
    open to etcd long after the connection was closed. A connection in use by a request
    is closed when that request gives it back (its pool is closed by then).
    """
    pools = manager.pools
    for key in pools.keys():  # noqa: SIM118 (urllib3 refuses to iterate it)
        pool = pools.get(key)
        if pool is not None:
            pool.close()
    manager.clear()


@dataclass(frozen=True)
class Timeouts:
    """A connection's timeouts in seconds (see
    :class:`~etcd_rendezvous._transport.interface.Transport`): ``read`` (an operation's
    budget), ``connect`` (one connection), ``request`` (one answer) and ``silence`` (a
    wait hearing nothing)."""

    read: float
    connect: float
    request: float
    silence: float


class Endpoints:
    """The endpoints of a connection (``(host, port)`` pairs over ``protocol``), tried in
    order and round-robin on failure, and the connection's :class:`Timeouts` (``request``
    and ``silence`` no longer than ``read``).

    It also keeps the watch streams of the connection (:meth:`adopt`): moving on to
    another endpoint wakes them, and closing ends them.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        protocol: str,
        api: str,
        timeouts: Timeouts,
        sleep: Callable[[float], None],
    ) -> None:
        self._urls = [f"{protocol}://{format_host(h)}:{p}" for h, p in endpoints]
        self._api = api
        read = float(timeouts.read)
        self._timeouts = Timeouts(
            read,
            float(timeouts.connect),
            min(float(timeouts.request), read),
            min(float(timeouts.silence), read),
        )
        self._sleep = sleep
        self._lock = threading.Lock()
        self._current = 0
        #: When each endpoint last answered (``time.monotonic()``; 0: never).
        self._heard = [0.0] * len(self._urls)
        self._closed = False
        self._streams: weakref.WeakSet[WatchStream] = weakref.WeakSet()

    # -- what the connection was given ------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The endpoint URLs, in configuration order."""
        return list(self._urls)

    def url(self, idx: int) -> str:
        """The URL of endpoint ``idx``."""
        return self._urls[idx]

    @property
    def api(self) -> str:
        """The etcd API spoken (``v2`` or ``v3``): the ``api`` label of the metrics."""
        return self._api

    @property
    def timeouts(self) -> Timeouts:
        """The connection's timeouts."""
        return self._timeouts

    def sleep(self, seconds: float) -> None:
        """Pause ``seconds`` as the connection was told to (a test may replace it)."""
        self._sleep(seconds)

    # -- lifetime and the watch streams ----------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> list[WatchStream]:
        """Refuse any further request; the streams still open, for the caller to close
        (none if this was closed before)."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            return list(self._streams)

    def adopt(self, stream: WatchStream) -> bool:
        """Wake ``stream`` whenever requests move on to another endpoint, and hand it to
        :meth:`close`. Returns ``False`` (and keeps nothing) if already closed."""
        with self._lock:
            if not self._closed:
                self._streams.add(stream)
            return not self._closed

    # -- deadlines --------------------------------------------------------------------

    def deadline(self, deadline: Deadline | None) -> Deadline:
        """The deadline of an operation: the caller's, or else ``read_timeout`` from now
        (the connection's own timeout, for callers that pass none)."""
        return deadline if deadline is not None else Deadline(self._timeouts.read)

    def last_chance(self) -> float:
        """Seconds one attempt may wait for an answer once the deadline is (nearly) past.

        The attempts owed after the deadline (one per endpoint, and one more) share
        about a second between them, and each gets at least a quarter of one: enough
        for a healthy member to answer, little enough that no operation outlives its
        caller's deadline by more than a second or so.
        """
        share = max(0.25, 1.0 / (len(self._urls) + 1))
        return min(share, self._timeouts.request)

    # -- which endpoint ---------------------------------------------------------------

    def pick(self) -> int:
        """The endpoint requests go to now (an index into :attr:`urls`)."""
        with self._lock:
            return self._current

    def heard_from(self, idx: int) -> None:
        """Endpoint ``idx`` answered (a request, or a message on a watch stream)."""
        self._heard[idx] = time.monotonic()

    def answered_before(self) -> bool:
        """Whether any endpoint has answered this connection yet."""
        return any(self._heard)

    def silent_for(self, idx: int) -> float:
        """Seconds since endpoint ``idx`` last answered anything on this connection."""
        return time.monotonic() - self._heard[idx]

    def rotate(self, failed: int, why: str = "failed", *, silent: bool = False) -> None:
        """Move on from endpoint ``failed`` to the next, if it is still the current one;
        ``why`` completes the log line ("etcd endpoint <url> <why>; switching to ...").

        ``silent``: the endpoint only said nothing for ``silence_timeout`` (an idle
        member looks the same): counted as ``transport.silent_rearms`` and logged at
        DEBUG, not as a failover. The metric is recorded, the line logged and the watch
        streams woken (those on ``failed`` re-arm) after the lock is released: a metrics
        handler may be slow, or use this connection.
        """
        with self._lock:
            if self._current != failed or len(self._urls) < 2:
                return
            self._current = (failed + 1) % len(self._urls)
            now = self._urls[self._current]
            streams = list(self._streams)
        if silent:
            record_metric("transport.silent_rearms", api=self._api)
            level = logging.DEBUG
        else:
            record_metric("transport.failovers", api=self._api)
            level = logging.INFO
        logger.log(level, "etcd endpoint %s %s; switching to %s", self._urls[failed], why, now)
        for stream in streams:
            stream.wake()

    def leave_silent(self, idx: int, what: str) -> None:
        """A wait (``what``) heard nothing from endpoint ``idx`` for ``silence_timeout``:
        go on with the next endpoint. A frozen member and an idle one look the same
        from here, and any member serves a wait as well as another."""
        silent = self.silent_for(idx)
        self.rotate(idx, f"said nothing for {silent:.1f} s while {what}", silent=True)

    # -- the failover loop ----------------------------------------------------------

    def operate(
        self,
        what: str,
        key: str,
        send: Callable[[int, float | None], _T],
        *,
        deadline: Deadline,
        cap_requests: bool = True,
        pause_first: bool = False,
    ) -> Attempt[_T]:
        """Send one request after another, failing over, until etcd answers it or
        ``deadline`` passes; return the last :class:`Attempt` (applied or refused).

        ``send(endpoint, cap)`` sends one request to endpoint ``endpoint`` (an index into
        :attr:`urls`), waiting at most ``cap`` seconds for its answer (``None``: no
        cap); :func:`try_once` turns what it returns or raises into the attempt's
        outcome. Permanent failures propagate. However short the deadline, every
        endpoint gets one attempt and one more follows the last failure, each waiting at
        most :meth:`last_chance` seconds once the deadline is near: a hung endpoint
        cannot hide a healthy one, and a write whose answer was lost is sent once more
        so that its fate can be found out. An attempt waits ``request_timeout`` for its
        answer, twice that once every endpoint failed the operation, four times after a
        second round, and so on: etcd members that answer slowly, all of them, get more
        patience rather than copies of requests they still work on (which a member
        executes all the same). ``pause_first``: back off before the first
        attempt (a watch reopened after its answer broke).
        """
        if self._closed:
            raise TransportClosedError(
                f"Could not {what} {key!r}: the etcd connection to "
                f"{', '.join(self._urls)} is closed."
            )
        retry = dataclasses.replace(CONNECTION, sleep=self._sleep).start(deadline)
        if pause_first:
            retry.pause()
        floor = self.last_chance()
        failures: list[str] = []
        unknown = False
        labels = {"op": op_name(what), "api": self._api}
        started = time.monotonic()
        while True:
            endpoint = self.pick()
            # Each round of attempts that failed on every endpoint doubles the wait for
            # an answer: members that are all slow (overloaded) are asked again with
            # more patience, not sent copies of requests they are still working on.
            rounds = min(len(failures) // len(self._urls), _MAX_DOUBLINGS)
            patience = self._timeouts.request * 2**rounds
            cap = min(patience, max(deadline.remaining(), floor))
            record_metric("transport.requests", **labels)
            try:
                attempt = try_once(send, endpoint, cap if cap_requests else None)
            except BaseException:  # a permanent failure
                _record_duration(labels, started)
                raise
            if attempt.outcome in (Outcome.APPLIED, Outcome.REFUSED):
                if attempt.outcome is Outcome.REFUSED:
                    record_metric("transport.refusals", **labels)
                _record_duration(labels, started)
                return dataclasses.replace(attempt, after_unknown=unknown)
            # Unsent or unknown: the next endpoint may serve us (an election, a member
            # gone); a write of unknown outcome is sent again, conditional writes
            # being settled from the key's history (Connection._settle).
            failures.append(attempt.failure)
            unknown = unknown or attempt.outcome is Outcome.UNKNOWN
            self.rotate(endpoint)
            if self._closed:
                raise TransportClosedError(
                    f"Could not {what} {key!r}: the etcd connection was closed."
                )
            if deadline.expired() and len(failures) > len(self._urls):
                _record_duration(labels, started)
                raise RendezvousConnectionError(self._unreachable_message(what, key, failures))
            logger.debug("Could not %s %r (%s); retrying", what, key, attempt.failure)
            record_metric("transport.retries", outcome=attempt.outcome.value, **labels)
            retry.pause()

    def _unreachable_message(self, what: str, key: str, failures: list[str]) -> str:
        tried = ", ".join(dict.fromkeys(f.split(": ", 1)[0] for f in failures))
        message = (
            f"Could not {what} {key!r}: etcd unreachable or unavailable at {tried} "
            f"(last error: {failures[-1]})."
        )
        # An https endpoint closes a plain-http connection without an answer.
        dropped = ("RemoteDisconnected", "Connection aborted", "without response")
        plain = all(endpoint.startswith("http://") for endpoint in self._urls)
        # Only when every attempt was dropped: a server that was killed mid-request
        # drops one, then refuses the next.
        if plain and all(any(d in f for d in dropped) for f in failures):
            message += (
                " The server closed the connection without an answer: if the endpoint "
                "serves https, use protocol 'https' (and cacert)."
            )
        return message


def _record_duration(labels: dict[str, str], started: float) -> None:
    elapsed = time.monotonic() - started
    record_metric("transport.request_seconds", elapsed, MetricKind.TIMING, **labels)
