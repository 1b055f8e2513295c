"""The legacy rendezvous state as a worker observes it: one watch stream on the state key.

:class:`StateFeed` delivers every change in order, each with its new value, so that a
waiting worker reads nothing; :class:`Observed` is one state seen.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._transport.interface import (
    WRITE_ACTIONS,
    KeyNotFoundError,
    Node,
    Transport,
    WatchHistoryLostError,
    WatchStream,
)
from .._transport.retry import Deadline
from .state import LOGGER_NAME, status_in

__all__ = ["Observed", "StateFeed"]

logger = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True)
class Observed:
    """The state key as last seen: its node and decoded state, or neither if missing."""

    node: Node | None
    state: dict[str, Any] | None
    #: The modification index of this state, or the index at which the key was missing.
    index: int

    def status_in(self, version: str) -> str | None:
        """The status, if the state is one of ``version``; ``None`` otherwise."""
        return status_in(self.state, version)


class StateFeed:
    """The rendezvous state as one watch stream delivers it: every change in order, each
    with its new value, so that a waiting worker reads nothing.

    :meth:`current` reads the state once and opens the stream right after that read;
    :meth:`wait` takes in the changes; :meth:`note` takes in the answer to our own write.
    After an error the feed starts again from a read at the next :meth:`current`.
    """

    def __init__(self, conn: Transport, key: str, parse: Callable[[Node], dict[str, Any]]) -> None:
        self._conn = conn
        self._key = key
        self._parse = parse
        self._stream: WatchStream | None = None
        self._latest: Observed | None = None
        self._last_state: dict[str, Any] | None = None
        self._changed_at = time.monotonic()
        #: Seconds the last read of the state took: a measure of etcd's load.
        self.read_seconds = 0.0

    @property
    def last_state(self) -> dict[str, Any] | None:
        """The latest state seen (kept after :meth:`close`), without reading."""
        return self._last_state

    @property
    def quiet_for(self) -> float:
        """Seconds since the state last changed (as far as we know)."""
        return time.monotonic() - self._changed_at

    def current(self) -> Observed:
        """The latest state known: read from etcd on first use and after an error, else
        the newest change the stream already delivered (without waiting).

        Taking in what was delivered matters: a caller that went round without waiting
        (it read the key itself and found it changed or gone) would otherwise decide
        again and again on a state that no longer exists.
        """
        if self._latest is None or self._stream is None:
            return self._restart()
        self._receive(0.0)
        return self._latest if self._latest is not None else self._restart()

    def note(self, node: Node) -> Observed:
        """Take in ``node``, the answer to our own write of the state key."""
        self._take(Observed(node, self._parse(node), node.modified_index))
        return self.current()

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a change newer than the latest state;
        take in every change already delivered. Returns whether the state changed."""
        if self._latest is None or self._stream is None:
            self._restart()  # (not current(): what it took in would not count as a change)
        return self._receive(max(0.0, timeout))

    def _receive(self, timeout: float) -> bool:
        """Take in the changes the open stream delivers within ``timeout`` seconds (every
        one already delivered, and at most one wait); whether the state changed. After
        lost history the state is read again; after any other error the feed is closed."""
        stream = self._stream
        if stream is None:  # pragma: no cover (callers opened it)
            return False
        deadline = Deadline(timeout)
        try:
            while True:
                event = stream.next(deadline.remaining())
                if event is None:
                    return False
                if self._apply(event):
                    while (more := stream.next(0.0)) is not None:
                        self._apply(more)
                    return True
        except WatchHistoryLostError:
            logger.info("etcd no longer holds the changes of %s; reading it again", self._key)
            before = self._latest
            return before is None or self._restart().index != before.index
        except BaseException:
            self.close()
            raise

    def invalidate(self) -> None:
        """Forget what was seen: the next :meth:`current` reads the state again."""
        self.close()

    def close(self) -> None:
        """Close the stream (idempotent); the feed reopens it when used again."""
        stream, self._stream = self._stream, None
        self._latest = None
        if stream is not None:
            stream.close()

    def _restart(self) -> Observed:
        """Open the stream from now, then read the state: a stream opened from the
        read's index would, on v2, cost a request per change made since (while many
        workers write the state, that is many). Changes made between the two come in
        both; the stream's copies are older than the read and are ignored."""
        self.close()
        self._stream = self._conn.watch_stream(self._key, 0)
        started = time.monotonic()
        try:
            node = self._conn.get(self._key)
        except KeyNotFoundError as exc:
            observed = Observed(None, None, exc.etcd_index or self._conn.last_index)
        except BaseException:
            self.close()
            raise
        else:
            observed = Observed(node, self._parse(node), node.modified_index)
        self.read_seconds = time.monotonic() - started
        self._take(observed)
        return observed

    def _apply(self, event: Node) -> bool:
        """Take in one change; whether it was newer than what we knew."""
        latest = self._latest
        if latest is not None and event.modified_index <= latest.index:
            return False
        if event.action in WRITE_ACTIONS and event.value is not None:
            node = dataclasses.replace(event, etcd_index=event.modified_index)
            self._take(Observed(node, self._parse(node), event.modified_index))
        else:  # deleted, expired
            self._take(Observed(None, None, event.modified_index))
        return True

    def _take(self, observed: Observed) -> None:
        if self._latest is None or observed.index > self._latest.index:
            if observed.state != self._last_state:
                self._changed_at = time.monotonic()
            self._latest = observed
            self._last_state = observed.state
