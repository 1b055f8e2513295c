"""Waiting for a final version of the legacy ``etcd`` rendezvous to end, in a constant
number of etcd requests per worker.

A waiting worker writes a wait key ``rdzv/v_<V>/wait_<hex>``, follows ``rdzv/`` with one
watch stream, and the oldest uncounted waiter adds every uncounted wait key to the
state's ``num_workers_waiting`` (and its ``waiting`` field) in one compare-and-swap. The
version ends on the evidence PyTorch's workers use: the state changed or was deleted, or
a keep-alive key lapsed (then the state is deleted). The protocol: docs/how-it-works.rst,
section "Waiting in a few requests".

The decisions (:func:`plan_count`, :func:`count_step`) are plain functions of the state
and the wait keys seen; :func:`await_end_of_final` carries them out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from .._transport.interface import (
    DELETE_ACTIONS,
    WRITE_ACTIONS,
    CompareFailedError,
    KeyNotFoundError,
    Node,
    Transport,
    WatchHistoryLostError,
    WatchStream,
)
from .._transport.limits import Refusal
from ..api import Deadline, RendezvousError, RequestTooLargeError
from ..layout import LegacyLayout, normalize_key, waiter_name
from .admission import grace
from .state import (
    LOGGER_NAME,
    WAITING,
    Hint,
    confirmed_keys,
    describe,
    read_state,
    status_in,
    supersedes,
    waiters_of,
)

__all__ = [
    "GATHER",
    "WAITER_TTL",
    "await_end_of_final",
    "count_step",
    "plan_count",
]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds a wait key lives. It is counted within moments of being written; it only has
#: to outlive a folding worker that died (then the next one, after the grace, counts it).
WAITER_TTL = 60

#: Seconds the oldest uncounted waiter lets its own key age before counting, so that one
#: write counts the workers arriving about together: the members of a rendezvous
#: re-enter within one poll of their agents (torchrun's default monitor interval is
#: 0.1 s), and counted one by one they would make one state write each, which every
#: waiting worker receives.
GATHER = 0.1


def plan_count(state: dict[str, Any], waiting: dict[str, int]) -> dict[str, Any] | None:
    """``state`` with every wait key of ``waiting`` (name -> created index) not yet counted
    added to ``num_workers_waiting`` and to ``waiting``; ``None`` if all are counted."""
    counted = waiters_of(state)
    fresh = [name for name in waiting if name not in counted]
    if not fresh:
        return None
    return {
        **state,
        "num_workers_waiting": int(state["num_workers_waiting"]) + len(fresh),
        WAITING: sorted(counted.union(fresh)),
    }


def count_step(
    state: dict[str, Any],
    waiting: dict[str, int],
    me: str | None,
    quiet_for: float,
    waited_for: float,
) -> float | None:
    """Seconds until we should count the uncounted wait keys (0: now), or ``None`` if it
    is not up to us (we hold no wait key, or ours was counted).

    ``quiet_for``: seconds the state has been unchanged; ``waited_for``: seconds since we
    wrote our wait key. The oldest uncounted waiter counts once its key is
    :data:`GATHER` old; the others after the grace, if the state stays unchanged.
    """
    counted = waiters_of(state)
    if me is None or me in counted or me not in waiting:
        return None
    ahead = sum(
        1
        for name, created in waiting.items()
        if name not in counted and (created, name) < (waiting[me], me)
    )
    if not ahead:
        return max(0.0, GATHER - waited_for)
    return max(0.0, grace(ahead) - quiet_for)


class _FinalVersion:
    """The final state being waited on, what it names, and the wait keys seen."""

    def __init__(self, node: Node, state: dict[str, Any], version: str) -> None:
        self.node = node
        self.state = state
        self.version = version
        self.keep_alives = confirmed_keys(state)
        self.changed_at = time.monotonic()

    @property
    def ongoing(self) -> bool:
        return status_in(self.state, self.version) == "final"


class _Wait:
    """One worker's wait on a final version (see :func:`await_end_of_final`), whose
    requests end by ``deadline``."""

    def __init__(
        self,
        conn: Transport,
        layout: LegacyLayout,
        version: str,
        parse: Callable[[Node], dict[str, Any]],
        on_lapse: Callable[[str], None],
        me: tuple[str, int] | None,
        deadline: Deadline,
    ) -> None:
        self._conn = conn
        self._deadline = deadline
        self._layout = layout
        self._version = version
        self._parse = parse
        self._on_lapse = on_lapse
        self._me = None if me is None else me[0]
        self._state_key = normalize_key(layout.state_key)
        self._version_dir = normalize_key(layout.version_dir(version))
        self._hint_key = normalize_key(layout.progress_key(version))
        #: Wait keys seen (name -> created index); ours from the answer to its write,
        #: as a listing from a member behind the others may lack it.
        self.waiting: dict[str, int] = {} if me is None else {me[0]: me[1]}
        self.final: _FinalVersion | None = None
        #: The index of the state our count lost against: wait for a newer one.
        self._lost_at: int | None = None
        self._started = time.monotonic()

    def observe(self) -> bool:
        """Read the state and list the version directory; whether the version goes on
        (it ended, by us if a keep-alive key is missing, if not).

        Raises:
            KeyNotFoundError: there is no state.
        """
        node = read_state(self._conn, self._layout.state_key, self._deadline)
        final = _FinalVersion(node, self._parse(node), self._version)
        if not final.ongoing:
            return False
        self.final = final
        try:
            version_dir = self._layout.version_dir(self._version)
            listing = self._conn.list_dir(version_dir, deadline=self._deadline).children
        except KeyNotFoundError:
            listing = ()
        for child in listing:
            self._note_waiter(child)
        lapsed = sorted(final.keep_alives - {normalize_key(child.key) for child in listing})
        if lapsed:
            self._end(lapsed[0])
            return False
        return True

    def follow(self, stream: WatchStream) -> bool:
        """Count and take in the changes below ``rdzv/`` until the version ended
        (``True``) or the deadline passed (``False``)."""
        deadline = self._deadline
        while not deadline.expired():
            final = self.final
            if final is None:  # pragma: no cover (observe() set it)
                return True
            due = None
            if self._lost_at != final.node.modified_index:
                now = time.monotonic()
                due = count_step(
                    final.state, self.waiting, self._me, now - final.changed_at, now - self._started
                )
            if due == 0.0:
                self._count(final)
                due = None
            event = stream.next(deadline if due is None else deadline.earliest(due))
            if event is not None and self._take(event):
                return True
        return False

    def _take(self, event: Node) -> bool:
        """Take in one change; whether the version ended."""
        final = self.final
        if final is None:  # pragma: no cover
            return True
        key = normalize_key(event.key)
        if key == self._state_key:
            if event.modified_index <= final.node.modified_index:
                return False  # made before what we know
            if event.action in DELETE_ACTIONS or event.value is None:
                return True
            self.final = _FinalVersion(event, self._parse(event), self._version)
            return not self.final.ongoing
        if key in final.keep_alives and event.action in DELETE_ACTIONS:
            self._end(key)
            return True
        if key == self._hint_key and event.action in WRITE_ACTIONS:
            self._act_on_report(Hint.decode(event.value), final)
        if event.action in WRITE_ACTIONS and key.rsplit("/", 1)[0] == self._version_dir:
            self._note_waiter(event)
        return False

    @property
    def final_state(self) -> dict[str, Any] | None:
        """The last state of the final version seen (``None``: none seen)."""
        return None if self.final is None else self.final.state

    def _note_waiter(self, node: Node) -> None:
        name = waiter_name(node.key)
        if name is not None and not node.is_dir:
            self.waiting.setdefault(name, node.created_index)

    def _count(self, final: _FinalVersion) -> None:
        """Count the uncounted wait keys in one compare-and-swap; if another write came
        first, the stream brings it and we decide again."""
        counting = plan_count(final.state, self.waiting)
        if counting is None:
            return
        # Tagged (PyTorch's workers carry the tag along): two counters reaching the same
        # count write different values, so a retry takes only its own swap as applied.
        counting = {**counting, "tag": secrets.token_hex(8)}
        try:
            node = self._conn.compare_and_swap(
                final.node.key, json.dumps(counting), final.node, deadline=self._deadline
            )
        except (CompareFailedError, KeyNotFoundError):
            logger.debug("Counting the waiting workers lost a race; deciding again")
            self._lost_at = final.node.modified_index
            return
        except RequestTooLargeError as exc:
            self._report(final, exc)
            raise
        logger.info(
            "Counted %d waiting worker(s) in version %s",
            len(counting[WAITING]) - len(waiters_of(final.state)),
            self._version,
        )
        self.final = _FinalVersion(node, counting, self._version)

    def _report(self, final: _FinalVersion, error: RequestTooLargeError) -> None:
        """etcd refused our count of the wait keys for its size: report it in the
        version's hint key, for the waiting workers whose wait keys it counted (they
        raise the error too, see :meth:`_act_on_report`). A failure is only logged."""
        counted = waiters_of(final.state)
        upto = max((i for name, i in self.waiting.items() if name not in counted), default=0)
        if not upto:
            return
        count = len(final.state.get("participants", ()))
        by = f"the worker with wait key {self._me}"
        refusal = Refusal.of(error, upto, count, False, by)
        hint = describe(final.state, final.node.modified_index, 0)
        report = dataclasses.replace(hint, refused=refusal)
        try:
            self._conn.advance(
                self._layout.progress_key(self._version),
                report.encode(),
                holds_newer=lambda node: supersedes(node, report),
                deadline=self._deadline,
            )
        except RendezvousError as exc:
            logger.info("Could not report the refused count of version %s: %s", self._version, exc)

    def _act_on_report(self, report: Hint | None, final: _FinalVersion) -> None:
        """Raise the error of ``report``, a hint of our version (``None``: none), if it
        reports a count refused for its size that had our wait key, still uncounted in
        the ``final`` state we hold: every count of it is at least as large."""
        if report is None or report.refused is None or self._me is None:
            return
        created = self.waiting.get(self._me)
        if created is None or created > report.refused.upto:
            return
        if self._me in waiters_of(final.state):
            return
        raise report.refused.error(f"The worker with wait key {self._me}")

    def _end(self, lapsed: str) -> None:
        """A member's keep-alive key ``lapsed``: delete the state if it did not change."""
        final = self.final
        if final is None:  # pragma: no cover
            return
        self._on_lapse(lapsed)
        if self._conn.compare_and_delete(final.node.key, final.node, deadline=self._deadline):
            logger.info("Destroyed rendezvous version %s successfully.", self._version)


def await_end_of_final(
    conn: Transport,
    layout: LegacyLayout,
    version: str,
    *,
    parse: Callable[[Node], dict[str, Any]],
    on_lapse: Callable[[str], None],
    deadline: Deadline,
    timeout_error: Callable[[], Exception],
    waiter: tuple[str, int] | None = None,
) -> dict[str, Any] | None:
    """Return once the final ``version`` ended (see docs/how-it-works.rst), counting the
    wait keys if ``waiter`` (the name and creation index of ours, already written) calls
    for it. Returns the
    last final state seen (``None``: the version had ended before the first read).

    When a member's keep-alive key lapsed, ``on_lapse(key)`` is called, then the state is
    deleted if it is still the one that named the key.

    Raises:
        RendezvousStateError: the state is corrupt (``parse`` says so).
        the error of ``timeout_error``: ``deadline`` passed first.
    """
    while True:
        wait = _Wait(conn, layout, version, parse, on_lapse, waiter, deadline)
        # The stream first, from now, then the reads: a stream opened from the index of
        # a read would, on v2, cost a request per change made since (many workers are
        # announcing themselves just then). Changes between the two are in both.
        try:
            stream = conn.watch_stream(layout.rdzv_dir, 0, recursive=True, deadline=deadline)
            with stream:
                try:
                    if not wait.observe():
                        return wait.final_state
                except KeyNotFoundError:
                    return wait.final_state  # the state is gone: the version ended
                if wait.follow(stream):
                    return wait.final_state
        except WatchHistoryLostError:
            logger.info("etcd no longer holds the changes below %s; reading again", layout.rdzv_dir)
            continue
        raise timeout_error()
