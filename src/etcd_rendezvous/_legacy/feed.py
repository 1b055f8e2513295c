"""The legacy rendezvous state as a worker observes it: one watch stream, on the state key
or on the version's ``progress`` hint.

:class:`StateFeed` follows the state key itself (every change in order, each with its
new value, so that a waiting worker reads nothing), or, for a worker that only waits
for news that concerns it, the small ``progress`` key our workers write after each state
write (:class:`~etcd_rendezvous._legacy.state.Hint`): the state is then read only when
a hint calls for it, or after a silence. :class:`Observed` is one state seen.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
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
from ..api import Deadline
from .state import CONST_ETCD_FROZEN_TTL, LOGGER_NAME, Hint, read_state, status_in

__all__ = ["SILENCE", "SILENCE_MAX", "Observed", "StateFeed"]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds without a word (no hint, no state read) after which a worker following the
#: hint reads the state anyway: PyTorch's workers write no hint, and a worker may die
#: between its state write and its hint. Each read that finds nothing new doubles it,
#: up to :data:`SILENCE_MAX`; one that finds news resets it.
SILENCE = 2.0
#: Each silence is drawn up to this fraction longer, so that many workers do not read
#: the state at once.
_JITTER = 0.25
#: The longest silence, its jitter included, is half the TTL of a frozen state: a state
#: PyTorch's worker froze lapses that long after its last write unless our members are
#: confirmed, and they learn of the freeze only by reading the state (PyTorch's workers
#: write no hint). The other half is left for that read, the hint that tells the others,
#: and the confirming write.
SILENCE_MAX = CONST_ETCD_FROZEN_TTL / 2 / (1 + _JITTER)


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
    """The rendezvous state as one watch stream delivers it.

    Following the state (the default), :meth:`current` reads the state once and opens
    the stream right before that read; :meth:`wait` takes in the changes (decoding only
    the newest of a burst); :meth:`note` takes in the answer to our own write. After an
    error the feed starts again from a read at the next :meth:`current`.

    Following a hint key (:meth:`follow_hints`), the stream carries the hints instead:
    :meth:`current` gives the state last read without reading it, :attr:`news` the hint
    that says the state changed since, :meth:`refresh` reads the state.
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
        # Following a hint key: the key, the newest hint, the store index of the hint key's
        # write that brought it, the store index of our last sight of the state.
        self._hint_key: str | None = None
        self._hint: Hint | None = None
        self._hint_at = 0
        self._seen_at = 0
        self._heard_at = time.monotonic()
        self._silence = SILENCE
        # The newest report of a refused write on the hint key followed, and the store
        # index of the hint key's write that brought it (``None``: none, or dropped); the
        # newest such index (a report is taken in once).
        self._report: tuple[Hint, int] | None = None
        self._report_at = 0

    @property
    def report(self) -> tuple[Hint, int] | None:
        """The newest hint reporting a refused write heard on the hint key followed (or
        found in a listing: :meth:`note_report`), with the store index of the hint key's
        write that brought it; ``None``: none."""
        return self._report

    def note_report(self, hint: Hint, written_at: int) -> None:
        """Take in ``hint``, a report of a refused write written at ``written_at`` (in the
        hint key followed), unless a newer one is known."""
        if written_at > self._report_at:
            self._report, self._report_at = (hint, written_at), written_at

    def drop_report(self) -> None:
        """Forget the report heard (it was found stale): it is not taken in again."""
        self._report = None

    @property
    def last_state(self) -> dict[str, Any] | None:
        """The latest state seen (kept after :meth:`close`), without reading."""
        return self._last_state

    @property
    def quiet_for(self) -> float:
        """Seconds since the state last changed (as far as we know: a hint saying so counts)."""
        return time.monotonic() - self._changed_at

    @property
    def hint(self) -> Hint | None:
        """The newest hint of the key followed (``None``: none, or not following one)."""
        return self._hint

    @property
    def hint_written_at(self) -> int:
        """The store index of the write of the hint key that brought :attr:`hint` (0: none)."""
        return self._hint_at if self._hint is not None else 0

    @property
    def news(self) -> Hint | None:
        """The newest hint, if it describes a state newer than the one last seen and was
        written after we saw it (a hint older than our read, or one that lies about its
        index, is never news twice: the state we read is the authority)."""
        hint, latest = self._hint, self._latest
        if hint is None or latest is None:
            return None
        if hint.index > latest.index and self._hint_at > self._seen_at:
            return hint
        return None

    @property
    def silent_for(self) -> float:
        """Seconds since we last heard of the state: a hint or a read."""
        return time.monotonic() - self._heard_at

    @property
    def silence(self) -> float:
        """Seconds of :attr:`silent_for` after which to read the state anyway (see
        :data:`SILENCE`), with a jitter of up to a quarter, so that many workers do not
        read it at once."""
        return self._silence * (1.0 + _JITTER * secrets.randbelow(1 << 10) / (1 << 10))

    def current(self, deadline: Deadline) -> Observed:
        """The latest state known: read from etcd on first use and after an error (by
        ``deadline``), else the newest change the stream already delivered, without
        waiting.

        Taking in what was delivered matters: a caller that went round without waiting
        (it read the key itself and found it changed or gone) would otherwise decide
        again and again on a state that no longer exists.
        """
        if self._latest is None:
            return self._restart(deadline)
        if self._stream is not None:
            self._receive(Deadline(0.0), deadline)
        return self._latest if self._latest is not None else self._restart(deadline)

    def note(self, node: Node, deadline: Deadline) -> Observed:
        """Take in ``node``, the answer to our own write of the state key (see
        :meth:`current` for ``deadline``)."""
        self._take(Observed(node, self._parse(node), node.modified_index), node.etcd_index)
        return self.current(deadline)

    def wait(self, seconds: float, deadline: Deadline) -> bool:
        """Wait at most ``seconds``, and no later than ``deadline``, for a change newer than
        the latest state (or a hint of one); take in every change already delivered.
        Returns whether there was one. Its requests (opening the stream, reading the
        state) end by ``deadline``."""
        if self._stream is None:
            if self._hint_key is not None:
                self._open_hints(deadline)
            elif self._latest is None:
                # (not current(): what it took in would not count as a change)
                self._restart(deadline)
            if self._stream is None:  # (after lost history, or on the hint key's)
                self._stream = self._conn.watch_stream(
                    self._key, self._seen_at + 1, deadline=deadline
                )
        return self._receive(deadline.earliest(max(0.0, seconds)), deadline)

    def follow_hints(self, hint_key: str, deadline: Deadline) -> None:
        """From now on follow ``hint_key`` (a version's ``progress`` key) instead of the
        state: the state last seen is kept, and read again only by :meth:`refresh`.
        Its requests end by ``deadline``."""
        if self._hint_key == hint_key and self._stream is not None:
            return
        if self._latest is None:
            self.current(deadline)
        self._close_stream()
        if self._hint_key != hint_key:
            self._hint, self._hint_at = None, 0
            self._report, self._report_at = None, 0
        self._hint_key = hint_key
        self._open_hints(deadline)

    def follow_state(self) -> None:
        """Follow the state key again (the next :meth:`current` reads it)."""
        if self._hint_key is not None:
            self._hint_key = None
            self.close()

    def refresh(self, deadline: Deadline) -> Observed:
        """Read the state now (by ``deadline``), whatever is followed. A read that finds
        nothing new makes the next silence longer (see :data:`SILENCE`)."""
        before = self._latest
        if self._hint_key is None:
            return self._restart(deadline)
        observed = self._read(deadline)
        unchanged = before is not None and observed.index == before.index
        self._silence = min(2 * self._silence, SILENCE_MAX) if unchanged else SILENCE
        return observed

    def _receive(self, until: Deadline, deadline: Deadline) -> bool:
        """Take in the changes the open stream delivers by ``until`` (every one already
        delivered, and at most one wait; of the states, only the newest is decoded);
        whether there was news. After lost history the state is read again (by
        ``deadline``); after any other error the feed is closed."""
        stream = self._stream
        if stream is None:  # pragma: no cover (callers opened it)
            return False
        try:
            while True:
                event = stream.next(until)
                if event is None:
                    return False
                if self._take_burst(stream, event):
                    return True
        except WatchHistoryLostError:
            logger.info("etcd no longer holds the changes of %s; reading it again", self._key)
            if self._hint_key is not None:
                self._close_stream()
                return False
            before = self._latest
            return before is None or self._restart(deadline).index != before.index
        except BaseException:
            self.close()
            raise

    def _take_burst(self, stream: WatchStream, first: Node) -> bool:
        """Take in ``first`` and every change the stream already delivered after it: each
        hint (small, and each may tell something), or only the newest state of a burst;
        whether any of it was news."""
        if self._hint_key is not None:
            news = self._apply(first)
            while (more := stream.next(Deadline(0.0))) is not None:
                news = self._apply(more) or news
            return news
        newest = first
        while (more := stream.next(Deadline(0.0))) is not None:
            newest = more
        return self._apply(newest)

    def invalidate(self) -> None:
        """Forget what was seen: the next :meth:`current` reads the state again."""
        self.close()

    def close(self) -> None:
        """Close the stream (idempotent); the feed reopens it when used again, on the state
        key."""
        self._close_stream()
        self._latest = None
        self._hint_key = None
        self._hint, self._hint_at = None, 0
        self._report, self._report_at = None, 0
        self._silence = SILENCE

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _restart(self, deadline: Deadline) -> Observed:
        """Open the stream from now, then read the state: a stream opened from the
        read's index would, on v2, cost a request per change made since (while many
        workers write the state, that is many). Changes made between the two come in
        both; the stream's copies are older than the read and are ignored."""
        self._close_stream()
        self._hint_key = None
        self._stream = self._conn.watch_stream(self._key, 0, deadline=deadline)
        try:
            return self._read(deadline)
        except BaseException:
            self.close()
            raise

    def _read(self, deadline: Deadline) -> Observed:
        started = time.monotonic()
        try:
            node = read_state(self._conn, self._key, deadline)
        except KeyNotFoundError as exc:
            at = exc.etcd_index or self._conn.last_index
            observed = Observed(None, None, at)
        else:
            at = node.etcd_index
            observed = Observed(node, self._parse(node), node.modified_index)
        self.read_seconds = time.monotonic() - started
        self._take(observed, at)
        return observed

    def _open_hints(self, deadline: Deadline) -> None:
        """Open the stream on the hint key from now (by ``deadline``). The hint already
        there is not read: it describes a state we have seen or one the next hint
        describes better."""
        key = self._hint_key
        if key is None:  # pragma: no cover (callers set it)
            return
        self._stream = self._conn.watch_stream(key, 0, deadline=deadline)

    def _apply(self, event: Node) -> bool:
        """Take in one change (of the state, or of the hint key); whether it was news."""
        if self._hint_key is not None:
            return self._take_hint(event)
        latest = self._latest
        if latest is not None and event.modified_index <= latest.index:
            return False
        if event.action in WRITE_ACTIONS and event.value is not None:
            node = dataclasses.replace(event, etcd_index=event.modified_index)
            self._take(
                Observed(node, self._parse(node), event.modified_index), event.modified_index
            )
        else:  # deleted, expired
            self._take(Observed(None, None, event.modified_index), event.modified_index)
        return True

    def _take_hint(self, node: Node) -> bool:
        """Take in a write of the hint key; whether it tells of a state newer than any we
        knew of. A deleted or garbled hint is ignored (the silence then leads to a read)."""
        if node.action not in WRITE_ACTIONS:
            return False
        hint = Hint.decode(node.value)
        if hint is None:
            logger.debug("Ignoring the unreadable hint in %s: %r", node.key, node.value)
            return False
        if hint.refused is not None:
            self.note_report(hint, node.modified_index)
        known = self._hint
        if known is not None and hint.newness <= known.newness:
            return False  # (the same state, described again by a worker that knew more: kept)
        self._hint, self._hint_at = hint, node.modified_index
        self._heard_at = time.monotonic()
        if self._latest is not None and hint.index <= self._latest.index:
            return False  # it describes a state we have seen
        self._changed_at = self._heard_at
        return True

    def _take(self, observed: Observed, at: int) -> None:
        self._heard_at = time.monotonic()
        self._seen_at = max(self._seen_at, at)
        if self._latest is None or observed.index > self._latest.index:
            if observed.state != self._last_state:
                self._changed_at = time.monotonic()
            self._latest = observed
            self._last_state = observed.state
        hint = self._hint
        if hint is not None and hint.index > self._latest.index and self._hint_at <= self._seen_at:
            # The state, read after the hint was written, is older than the hint says.
            logger.debug("Dropping a hint that describes no state: %s", hint)
            self._hint = None
