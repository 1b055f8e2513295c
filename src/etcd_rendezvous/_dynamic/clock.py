"""The clock of the times in the state of a dynamic rendezvous: heartbeats and the
last-call deadline are written and judged on it.

Over this package's etcd connection it is etcd's clock (:class:`EtcdClock`, from the
``Date`` of etcd's answers: see :class:`~etcd_rendezvous._transport.clock.ServerClock`),
so that our nodes trust no node's clock, theirs included; with any other backend it is
the local wall clock (:class:`LocalClock`), as in PyTorch. The state holder owns the one
clock of a handler (:attr:`~.holder.StateHolder.clock`); every part of the handler
reads the time from it, and tests replace it there. See docs/how-it-works.rst, section
"The dynamic rendezvous", Clocks.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import Protocol

from .._transport.clock import ServerClock
from .keys import KeyedBackend
from .settings import LOGGER_NAME, RendezvousSettings

__all__ = ["LOCAL_CLOCK", "WARN_OFFSET", "Clock", "EtcdClock", "LocalClock", "state_clock"]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds this host's clock may differ from etcd's before :class:`EtcdClock` warns: the
#: estimate of etcd's clock is off by at most half of one second plus a round trip of
#: at most :data:`~etcd_rendezvous._transport.clock.MAX_ROUND_TRIP`, so a host in step
#: with etcd never warns.
WARN_OFFSET = 1.0
#: Seconds the difference must move by, after a warning, for another one.
_REWARN_CHANGE = 2.0


class Clock(Protocol):
    """A clock of the times in the state."""

    def now(self) -> datetime:
        """The time now, as an aware UTC datetime."""


class LocalClock:
    """This host's wall clock, PyTorch's clock of the state."""

    def now(self) -> datetime:
        """See :class:`Clock`."""
        return datetime.now(timezone.utc)


#: The local wall clock, for whoever has no other.
LOCAL_CLOCK = LocalClock()


class EtcdClock:
    """etcd's clock as ``server`` (a connection's) tells it, for the rendezvous of
    ``settings``; logs a WARNING once when this host's clock differs from it by more
    than :data:`WARN_OFFSET`, and again when the difference changes by more than
    two seconds."""

    def __init__(self, server: ServerClock, settings: RendezvousSettings) -> None:
        self._server = server
        self._settings = settings
        self._lock = threading.Lock()
        self._warned: float | None = None

    def now(self) -> datetime:
        """See :class:`Clock`."""
        offset = self._server.offset()
        if offset is not None:
            self._check(offset)
        return self._server.now()

    def _check(self, offset: float) -> None:
        with self._lock:
            warned = self._warned
            if abs(offset) <= WARN_OFFSET and warned is None:
                return
            if warned is not None and abs(offset - warned) <= _REWARN_CHANGE:
                return
            self._warned = offset
        settings = self._settings
        interval = settings.keep_alive_interval.total_seconds()
        margin = interval * (settings.keep_alive_max_attempt - 1)
        logger.warning(
            "The wall clock of this host is %.1f s %s etcd's (as etcd dates its answers). "
            "The rendezvous '%s' stamps and judges heartbeats and the last-call deadline "
            "in etcd's time, so this does not matter among this package's nodes. PyTorch's "
            "own nodes in the same run use their hosts' clocks: one on a host whose clock "
            "is off by more than about (keep_alive_max_attempt - 1) x keep_alive_interval "
            "(%g s) is dropped (its clock behind) or drops the others (ahead). Keep the "
            "hosts' clocks synchronised (NTP).",
            abs(offset),
            "behind" if offset > 0 else "ahead of",
            settings.run_id,
            margin,
        )


def state_clock(backend: object, settings: RendezvousSettings) -> Clock:
    """The clock of the state ``backend`` keeps for the rendezvous of ``settings``:
    etcd's with this package's backend (a :class:`~.keys.KeyedBackend`, which talks to
    etcd through this package's connection), else the local clock."""
    if isinstance(backend, KeyedBackend):
        return EtcdClock(backend.connection.clock, settings)
    return LOCAL_CLOCK
