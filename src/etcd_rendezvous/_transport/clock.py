"""etcd's clock as one connection sees it: :class:`ServerClock`, learnt from the ``Date``
header of etcd's answers at no cost in requests.

The dynamic rendezvous writes and judges the times it keeps in its state (heartbeats,
the last-call deadline) on this clock, the one that already runs every TTL and lease,
so that no node trusts another node's clock. See docs/how-it-works.rst, section
"The dynamic rendezvous", Clocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

__all__ = ["ServerClock"]

#: Seconds a sample counts towards the estimate: long enough to narrow the interval down
#: to about a round trip, short enough that clock drift (parts per million) and an NTP
#: slew on either side cannot pin it to a value that has gone stale.
WINDOW = 60.0
#: The most samples kept (a busy connection answers many per second).
MAX_SAMPLES = 64
#: Seconds beyond which an answer's round trip teaches nothing: its interval, wider than
#: a second by that much, could put the estimate further off than a wrong local clock.
MAX_ROUND_TRIP = 1.0


class ServerClock:
    """etcd's clock, as the local monotonic clock plus an offset kept as an interval.

    An answer dated ``D`` (the ``Date`` header, whole seconds: etcd's Go HTTP server
    truncates the time at which it wrote the answer's headers) to a request sent at
    local monotonic time ``t0`` and received at ``t1`` was dated between the two: etcd's
    time minus the monotonic clock lies in ``[D - t1, D + 1 - t0]``. The intervals of the
    samples of the last :data:`WINDOW` seconds are intersected, which narrows the offset
    down to about a round trip; when a sample does not meet the others (etcd's clock was
    stepped, or the connection failed over to a member whose clock differs), the estimate
    restarts from that sample alone. An answer that took more than
    :data:`MAX_ROUND_TRIP` is left out. :meth:`time` is the monotonic clock plus the
    middle of the interval: its error is at most half the interval's width (one second
    and a round trip at first, about a round trip after a few answers). Anchored to the
    monotonic clock, it is not moved by a step of the local wall clock. Before any
    answer it is the local wall clock.

    What this means, interleaving by interleaving:

    * A node whose own clock is behind or ahead (6 s, 30 s, any amount), the heartbeat
      aggregator or not: its stamps are etcd's time all the same, and it judges others'
      on etcd's time; it drops nobody, and nobody drops it.
    * A node admitted, or whose heartbeat is refreshed, by a node whose clock is off:
      stamped in etcd's time by that node too.
    * The first stamps before any answer: none in practice, since a node reads the
      state before it writes a time into it; a clock that never heard etcd is the local
      one (PyTorch's behaviour).
    * A local clock step (NTP) mid-run: no effect (monotonic anchor). A step of etcd's
      clock: followed from the next answer on.
    * Failover between members: each answer is dated by the member that sent it;
      members whose clocks differ by more than the interval's width restart the
      estimate, those closer blend into it. etcd warns when its members' clocks differ
      by more than a second; the estimate is that good, not better.
    * PyTorch's nodes stamp and judge with their own clocks: against them ours behave
      as PyTorch nodes whose clocks are right (as right as etcd's).

    Thread-safe: requests of several threads of one connection sample it.

    Args:
        wall: the local wall clock (``time.time``; replaceable in tests).
        monotonic: the local monotonic clock (``time.monotonic``; replaceable in tests).
    """

    def __init__(
        self,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._wall = wall
        self._monotonic = monotonic
        self._lock = threading.Lock()
        # (received, low, high): when each sample arrived (monotonic) and its interval.
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=MAX_SAMPLES)
        self._bounds: tuple[float, float] | None = None

    def sample(self, date: str | None, sent: float, received: float) -> None:
        """Learn from an answer whose ``Date`` header is ``date`` (``None``, or a value
        that is not an HTTP date, teaches nothing) to a request sent at monotonic time
        ``sent`` and received at ``received``."""
        dated = _http_date(date)
        if dated is None or not 0 <= received - sent <= MAX_ROUND_TRIP:
            return
        low, high = dated - received, dated + 1.0 - sent
        with self._lock:
            samples = self._samples
            while samples and samples[0][0] < received - WINDOW:
                samples.popleft()
            samples.append((received, low, high))
            bounds = self._intersection()
            if bounds is None:
                # The newest sample disagrees with the older ones: etcd's clock moved.
                samples.clear()
                samples.append((received, low, high))
                bounds = (low, high)
            self._bounds = bounds

    def _intersection(self) -> tuple[float, float] | None:
        low = max(sample[1] for sample in self._samples)
        high = min(sample[2] for sample in self._samples)
        return (low, high) if low <= high else None

    @property
    def bounds(self) -> tuple[float, float] | None:
        """The interval of etcd's time minus the local monotonic clock, in seconds
        (``None``: no answer yet)."""
        return self._bounds

    @property
    def synced(self) -> bool:
        """Whether an answer of etcd dated the clock (else it is the local wall clock)."""
        return self._bounds is not None

    def time(self) -> float:
        """etcd's time now, in seconds since the epoch (the local wall clock's before any
        answer)."""
        bounds = self._bounds
        if bounds is None:
            return self._wall()
        return self._monotonic() + (bounds[0] + bounds[1]) / 2

    def now(self) -> datetime:
        """etcd's time now, as an aware UTC datetime."""
        return datetime.fromtimestamp(self.time(), timezone.utc)

    def offset(self) -> float | None:
        """How far etcd's clock is ahead of the local wall clock now, in seconds
        (negative: behind; ``None``: no answer yet)."""
        if self._bounds is None:
            return None
        return self.time() - self._wall()


def _http_date(value: str | None) -> float | None:
    """An HTTP ``Date`` header (``Sun, 29 Nov 2026 03:48:43 GMT``) in seconds since the
    epoch; ``None`` if it is missing or not a date."""
    if not value:
        return None
    try:
        dated = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if dated.tzinfo is None:
        dated = dated.replace(tzinfo=timezone.utc)
    return dated.timestamp()
