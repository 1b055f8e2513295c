"""The keep-alive thread of the legacy ``etcd`` backend.

A worker of the legacy protocol keeps etcd keys alive by refreshing their TTL: its member
key of the rendezvous version (a member whose key lapses is gone, and the waiting workers
start the next version) and, where etcd can refresh a directory's TTL, the run
directory. :class:`LeaseKeeper` does so in a named daemon thread that rides out etcd
outages and stops when told to or when the key is gone.
"""

from __future__ import annotations

import logging
import threading
import time

from .._transport.interface import (
    KeyNotFoundError,
    OperationRefusedError,
    Transport,
    TransportClosedError,
)
from ..api import Deadline, RendezvousConnectionError
from .state import LOGGER_NAME

__all__ = ["LeaseKeeper", "stop_keepers"]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds before the key would lapse at which a refresh gives up (and the next starts).
_LAPSE_MARGIN = 0.5
#: Seconds a refresh gets at least, even with the key's time up as far as we know: it
#: may still live (etcd counts TTLs in whole seconds), and if not, etcd says so.
_LEAST_ATTEMPT = 1.0


class LeaseKeeper:
    """Keeps an etcd key alive by refreshing its TTL every ``ttl / 2`` seconds.

    The thread rides out etcd outages and leader elections: a refresh that fails is
    logged and tried again a second later, for as long as the key lives. A refresh may
    take until the key would lapse (as far as the keeper knows: ``ttl`` after the last
    refresh it saw succeed): an etcd slowed down by thousands of clients answers it in
    time, where a shorter attempt would give up and send it again (etcd executes both).
    Each request of it still waits ``request_timeout`` at first, so that one stuck on a
    member whose leader just died goes to the next endpoint. The thread stops when
    ``stop_event`` is set, when the key is gone (it expired: the worker is then dropped,
    as it should be after losing etcd for a whole TTL), or when etcd refuses to refresh
    it.
    """

    def __init__(self, conn: Transport, key: str, ttl: int, *, lease: int = 0) -> None:
        self.key = key
        self.ttl = ttl
        self.stop_event = threading.Event()
        self._conn = conn
        #: On v3, the lease of our own write of the key, if the key is ours alone: it is
        #: kept alive without reading the key first (see Transport.refresh).
        self._lease = lease
        #: When the key lapses unless refreshed, as far as we know (it was just written).
        self._alive_until = time.monotonic() + ttl
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-rendezvous-lease:{key}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the refresh thread is still running."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop refreshing; wait up to ``timeout`` seconds for the thread to end."""
        self.stop_event.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        wait: float | None = self.ttl / 2
        while wait is not None and not self.stop_event.wait(wait):
            wait = self._refresh()

    def _refresh(self) -> float | None:
        """Refresh the TTL once; return the seconds until the next refresh (``None``:
        stop)."""
        interval = self.ttl / 2
        sent = time.monotonic()
        deadline = Deadline(max(self._alive_until - sent - _LAPSE_MARGIN, _LEAST_ATTEMPT))
        try:
            node = self._conn.refresh(self.key, self.ttl, lease=self._lease, deadline=deadline)
            self._alive_until = sent + self.ttl
            if self._lease:
                self._lease = node.lease or self._lease
        except KeyNotFoundError:
            logger.info("Keep-alive key %s is gone; no longer refreshing it", self.key)
            return None
        except OperationRefusedError as exc:
            logger.warning("etcd refuses to refresh the TTL of %s (%s); giving up", self.key, exc)
            return None
        except TransportClosedError:
            logger.info("The etcd connection was closed; no longer refreshing %s", self.key)
            return None
        except RendezvousConnectionError as exc:
            logger.warning("Could not refresh the TTL of %s, will retry: %s", self.key, exc)
            return min(1.0, interval)
        except Exception:
            logger.exception("Unexpected error refreshing the TTL of %s; will retry", self.key)
            return min(1.0, interval)
        return interval


def stop_keepers(keepers: list[LeaseKeeper]) -> None:
    """Tell every keeper of ``keepers`` to stop, without waiting for its thread."""
    for keeper in keepers:
        keeper.stop_event.set()
