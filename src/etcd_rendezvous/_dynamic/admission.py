"""Batched admission and aggregated heartbeats for the dynamic rendezvous (node keys).

With a backend that keeps the run's other keys (a :class:`~.keys.KeyedBackend`: this
package's ``etcd-v2`` backend), each node announces itself with a key of its own; a
candidate admitter (the node whose key is the oldest not yet decided, or the next one if
it is slow) admits every announced node (or takes it out of the round it leaves) in one
state write, and summarises that write in the progress key
(:mod:`etcd_rendezvous._dynamic.progress`), which the other nodes wait on instead of the
state; one *aggregator* refreshes the heartbeats of every node with a live key in one
write; and the first node of the wait list takes out the participants whose keys are
gone. A constant number of requests per node instead of PyTorch's O(N^2), writing the
same state.

:class:`Admission` is one node's side of it, beside the requests it makes: its key, its
admission attempts, the batches it makes, its heartbeat ticks and the aggregator's fold,
the participants it reaps, and its view of the progress key. The executor asks it one
question per step (:meth:`Admission.join`, :meth:`Admission.reap`,
:meth:`Admission.fold`, :meth:`Admission.wait`); the changes it makes to the state are
:mod:`etcd_rendezvous._dynamic.changes`'s, decided by
:func:`~etcd_rendezvous._dynamic.ops.admission_action`. The protocol step by step: see
docs/how-it-works.rst, section "Our nodes: node keys, batched admission, one heartbeat
writer".
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .._transport.retry import Deadline
from ..api import RequestTooLargeError
from ..events import NodeState
from .backend import Token
from .changes import Changes
from .clock import LOCAL_CLOCK, Clock
from .keys import AnnouncedNode, KeyedBackend, Progress
from .ops import ADMISSIONS, Action, admission_action
from .progress import PROGRESS_SILENCE, Heard, ProgressKey
from .settings import (
    EXECUTOR_EVENTS,
    RendezvousSettings,
    event_source,
    record_node_event,
)
from .state import NodeDesc, RendezvousState

__all__ = [
    "ADMISSION_GRACE",
    "ADMIT_GATHER",
    "ADMIT_STAGGER",
    "CHANGED",
    "EXIT_GATHER",
    "Admission",
    "Changed",
    "Refresh",
    "Wait",
    "grace_wait",
    "stagger_wait",
]

logger = logging.getLogger(__name__)

#: Seconds a node whose key is older than the progress key says was decided waits for
#: the keys older than its own to be admitted, while no node is admitted at all, before it
#: admits them itself (with every other listed key) in a batch of its own.
ADMISSION_GRACE = 2.0

#: Seconds between the candidate admitters (see :func:`stagger_wait`): the node whose key
#: is the k-th after the last decided index makes the batch after ``k`` steps without
#: progress.
ADMIT_STAGGER = 0.25
#: Seconds the first candidate waits after it asks, unless a batch decides its key first:
#: the nodes that arrive meanwhile are admitted in the same write (fewer state writes,
#: each a change every waiting node hears of).
ADMIT_GATHER = 0.1
#: Beyond this many steps, a node waits as the last candidate does, plus a random part
#: of :data:`_TAIL_JITTER`: it makes a batch only if nobody did for that long.
_STAGGER_CAP = 8
_TAIL_JITTER = 2.0


#: Seconds a node that asked to leave its round waits before it lists the keys: the
#: nodes of a round ask within moments of each other (each agent sees the same waiting
#: node), and a node only waits for the older ones it sees asking, so without a pause
#: several would make batches of their own at once (each a large state write, all but
#: one lost).
EXIT_GATHER = 0.1

#: How many participants' key lifetimes a waiting node reads to know when to look at
#: the keys again (on v3 each is a request; the others are looked at every interval).
_REAP_PROBES = 2
#: Seconds after a key's expiry as a listing (or its lease) tells it, whole seconds,
#: when the node looks again; and between looks at a key that is due to expire.
_REAP_STEP = 0.3

#: How many keep-alive intervals old a node's heartbeat in the state is when the node
#: takes it that nobody aggregates (and looks at the lock, to take it if it is free).
_LATE = 1.25
#: How many keep-alive intervals old a node with a key lets its heartbeat in the state
#: get before it writes it itself (the aggregator failed to fold it): a point drawn once
#: per node in this range, so that the nodes do not all write at once when the
#: aggregator dies. The node looks at its heartbeat when it reaches that age (see
#: :meth:`Admission.heartbeat_due`), not only every interval, so it writes it by two
#: intervals old at the latest: the latest a PyTorch node does (it looks every interval
#: and writes one interval old). With ``keep_alive_max_attempt < 3`` the node follows
#: PyTorch's rule instead.
_FALLBACK_AGE = (1.5, 2.0)
#: The TTL of the aggregator lock, in keep-alive intervals (whole seconds, at least one
#: more than an interval): the holder renews it every interval; if it dies, the lock
#: lapses before the first node's fallback age (1.5 intervals) comes (with a
#: ``keep_alive_interval`` of 3 s or more, give or take etcd's half-second sweep of
#: expired keys), and that node, which looks at the lock first, takes over and folds
#: everyone's heartbeats. With shorter intervals the whole seconds outlast it: the
#: first nodes write their own heartbeats, and a later one takes over.
_LOCK_INTERVALS = 1.4


@dataclass(frozen=True)
class Changed:
    """The node made its changes to the state (a batch, or dead participants taken
    out): write it."""


#: The one :class:`Changed`.
CHANGED = Changed()


@dataclass(frozen=True)
class Wait:
    """Nothing for this node to do yet: look again within ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Refresh:
    """This node would make the batch now, but the state it holds is older than the
    one the progress key describes: read the state first, then ask again."""


@dataclass(frozen=True)
class _Batch:
    """This node makes the batch now: ``nodes`` are the listed nodes, oldest first, but
    those taken for dead. Each is taken out of its round if it leaves, and admitted if
    the join decision says so."""

    nodes: list[NodeDesc]


def stagger_wait(created: int, decided_upto: int, idle: float, jitter: float = 0.0) -> float:
    """Seconds until the node whose key was created at ``created`` makes the batch, when
    every key up to ``decided_upto`` was decided and nobody made progress for ``idle``
    seconds (0: now); ``jitter`` in [0, 1) spreads the nodes beyond
    :data:`_STAGGER_CAP` steps. The distance of the indexes bounds from above how many
    undecided keys are ahead (see docs/how-it-works.rst, "Our nodes: node keys, batched
    admission, one heartbeat writer", candidate admitters).
    """
    ahead = max(created - decided_upto - 2, 0)
    return max(ADMIT_GATHER + _stagger(ahead, jitter) - idle, 0.0)


def grace_wait(blockers: int, waited: float, jitter: float = 0.0) -> float:
    """Seconds until a node held up by ``blockers`` older nodes that still wait for
    admission (or to leave), after ``waited`` seconds without progress, makes the batch of
    them all: :data:`ADMISSION_GRACE`, and a step of :data:`ADMIT_STAGGER` more for each
    blocker but the first (capped as in :func:`stagger_wait`; ``jitter`` in [0, 1)
    spreads the nodes beyond the cap). Of the nodes stuck behind the same slow node, the
    next one makes the batch, and the others hear of it before their turn."""
    return max(ADMISSION_GRACE + _stagger(max(blockers - 1, 0), jitter) - waited, 0.0)


def _stagger(ahead: int, jitter: float) -> float:
    """Seconds of stagger for a node with ``ahead`` nodes before it: a step of
    :data:`ADMIT_STAGGER` each, up to :data:`_STAGGER_CAP`, and beyond that a random
    part (``jitter`` in [0, 1)) of :data:`_TAIL_JITTER`."""
    steps = min(ahead, _STAGGER_CAP) * ADMIT_STAGGER
    if ahead >= _STAGGER_CAP:
        steps += jitter * _TAIL_JITTER
    return steps


#: Tells whether a batch would do something for a node on the state at hand: take it
#: out of the round it asked to leave, or admit it (the join decision adds it to the
#: participants, the wait list or the redundancy list).
WantsAdmission = Callable[[NodeDesc], bool]


@dataclass
class _Attempt:
    """What a node knows while it waits to be admitted."""

    #: The keys older than ours, from the listing taken after announcing, oldest first.
    predecessors: dict[NodeDesc, int]
    #: When the admissions last made progress (``time.monotonic()``).
    progress_at: float
    #: What the state's admissions looked like at the last look (see ``_admission``).
    mark: object = None
    #: Whether the node waits for its turn as a candidate admitter (see
    #: :func:`stagger_wait`) rather than for its listed predecessors.
    staggered: bool = False
    #: The random part of the wait of a node far behind (see :func:`stagger_wait`).
    jitter: float = field(default_factory=random.random)

    def blockers(self, wants: WantsAdmission) -> list[NodeDesc]:
        """The predecessors still waiting for admission, oldest first."""
        waiting = [n for n in self.predecessors if wants(n)]
        return sorted(waiting, key=self.predecessors.__getitem__)

    def blocked(self, wants: WantsAdmission) -> bool:
        """Whether a predecessor still waits for admission. Looks at the youngest first:
        they are the likeliest to wait, and one is enough."""
        return any(wants(node) for node in reversed(self.predecessors))


class Admission:
    """One node's side of the node-key protocol, with the requests it makes to
    ``keys``.

    The handler calls :meth:`begin` and :meth:`end` around ``next_rendezvous()`` and
    :meth:`withdraw` when the node leaves (or fails to join). The executor, after each
    sync, hands it the state (:meth:`synced`, :meth:`fold`); for each decision, asks
    whether it takes it (:meth:`decided`) and then to take it (:meth:`join`); and when
    the node has nothing to do, lets it reap (:meth:`reap`) and wait (:meth:`wait`).
    Thread-safe. Every request ends by the ``deadline`` its caller passes.

    Args:
        keys: the backend that keeps the run's keys.
        node: this handler's node.
        settings: the rendezvous settings.
        clock: the monotonic clock (replaceable in tests).
        state_clock: the clock of the state's times (the state holder's).
        progress_key: whether the node follows the progress key; without it, it always
            waits for the keys older than its own to be admitted (as it does when it
            leaves a round), which the unit tests of that path isolate.
    """

    def __init__(
        self,
        keys: KeyedBackend,
        node: NodeDesc,
        settings: RendezvousSettings,
        clock: Callable[[], float] = time.monotonic,
        *,
        state_clock: Clock = LOCAL_CLOCK,
        progress_key: bool = True,
    ) -> None:
        self._keys = keys
        self._node = node
        self._settings = settings
        self._state_clock = state_clock
        self._changes = Changes(node, settings, state_clock)
        # The events of a node admitted by another keep PyTorch's executor's names.
        self._events = event_source(EXECUTOR_EVENTS, settings.run_id)
        interval = settings.keep_alive_interval.total_seconds()
        attempts = settings.keep_alive_max_attempt
        self._interval = interval
        self._ttl = max(1, math.ceil(interval * attempts))
        self._lock_ttl = max(math.floor(interval) + 1, math.floor(interval * _LOCK_INTERVALS))
        # A node with a live key compare-and-swaps its own heartbeat only this late
        # (never later than PyTorch's nodes, see _FALLBACK_AGE).
        self._period = settings.keep_alive_interval
        if attempts >= 3:
            self._period *= random.uniform(*_FALLBACK_AGE)
        self._late = settings.keep_alive_interval * _LATE
        self._clock = clock
        self._lock = threading.RLock()
        self._created: int | None = None
        self._next_tick = math.inf
        self._joining = False
        self._attempt: _Attempt | None = None
        self._leading = False
        # The heartbeat of ours that the last tick between ticks was for (see
        # _fallback_tick).
        self._fallback_beat: datetime | None = None
        self._listed: set[NodeDesc] = set()
        # Whether the node waits for a batch to admit it (or to take it out of the round
        # it leaves: which one, then); the nodes whose heartbeats the aggregator's fold
        # is writing into the state.
        self._awaiting_admission = False
        self._awaiting_exit: int | None = None
        self._fold: set[NodeDesc] | None = None
        # The complete round our key says we leave (see ``_leave``), and what the keys of
        # the last listing said.
        self._leaving: int | None = None
        self._left_at = -math.inf
        self._marks: dict[NodeDesc, int] = {}
        # Every node listed with a key so far (ours, not PyTorch's), and when to look at
        # the keys of the participants of which complete round again (see ``reap``).
        self._seen: set[NodeDesc] = set()
        # The keys taken for dead (node: created index) while etcd still lists them:
        # no batch admits them, and they block nobody (see ``reap``), unless a later
        # probe finds them renewed (see ``_list``).
        self._dead: dict[NodeDesc, int] = {}
        self._reap_round: int | None = None
        self._reap_at = -math.inf
        board = keys if progress_key else None
        self._progress = ProgressKey(board, node, settings.min_nodes, clock, self._ttl)

    @property
    def announced(self) -> bool:
        """Whether the node's key exists (as far as this node knows)."""
        return self._created is not None

    def heartbeat_period(self, default: timedelta) -> timedelta:
        """How old the node's heartbeat in the state may get before the node writes it
        itself: ``default`` without a key, later with one (the aggregator's job)."""
        return self._period if self._created is not None else default

    def heartbeat_due(self, state: RendezvousState, now: datetime) -> float | None:
        """Seconds from ``now`` (the state's clock) until the node's heartbeat in
        ``state`` reaches the age at which the node writes it itself (0: it has), if
        that comes within the next keep-alive interval: the keep-alive timer runs again
        then, rather than up to an interval later. ``None`` without a key, when the node
        follows PyTorch's rule (it writes at one interval old, looking every interval),
        or when ``state`` has no heartbeat of the node."""
        beat = self._own_beat(state)
        if beat is None or self._period.total_seconds() <= self._interval:
            return None
        due = (beat + self._period - now).total_seconds()
        return max(due, 0.0) if due < self._interval else None

    def _fallback_tick(self, state: RendezvousState, now: datetime) -> bool:
        """Whether the node ticks now, between its ticks, because its heartbeat in
        ``state`` reached the age at which the node writes it itself: first it looks at
        the aggregator lock (see :meth:`_tick`), to take it over and fold everyone's if
        it lapsed. Once per heartbeat seen (a state held, not read again, shows the same
        one: no look at the lock at each step of a wait)."""
        beat = self._own_beat(state)
        if beat is None or now - beat < self._period or beat == self._fallback_beat:
            return False
        self._fallback_beat = beat
        return True

    def _own_beat(self, state: RendezvousState) -> datetime | None:
        """The node's heartbeat in ``state`` while it has a key (``None``: no key, or
        not in ``state``): the one the aggregator folds, and the node's fallback
        watches."""
        return None if self._created is None else state.last_heartbeats.get(self._node)

    # -- the handler's calls --------------------------------------------------------------

    def begin(self) -> None:
        """``next_rendezvous()`` started: keep the key whatever the state says."""
        with self._lock:
            self._joining = True
            self._attempt = None

    def end(self) -> None:
        """``next_rendezvous()`` ended (if it failed, the handler withdraws the node):
        stop watching, lest every later state write (the heartbeat folds) reach us."""
        with self._lock:
            self._joining = False
            self._attempt = None
            self._progress.stop_waiting()

    def withdraw(self, deadline: Deadline) -> None:
        """Delete the node's key and release the aggregator lock if the node holds it."""
        with self._lock:
            created, leading = self._created, self._leading
            self._created, self._leading, self._leaving = None, False, None
            self._next_tick = math.inf
            self._attempt = None
            if created is not None:
                # The key first: it is what admits the node.
                try:
                    self._keys.withdraw_node(self._node, deadline)
                except BaseException:
                    # Still there: a later withdraw tries again (the lock too).
                    self._created, self._leading = created, leading
                    raise
            if leading:
                self._keys.release_aggregator(self._node, deadline)

    def announce(self, deadline: Deadline) -> None:
        """Write the node's key if it has none (a node whose join finished after it
        withdrew: the round completed with it after all)."""
        with self._lock:
            if self._created is None:
                self._announce(deadline)

    def waiting_hint(self, token: Token, deadline: Deadline) -> Progress | None:
        """The progress key's summary (one small read), if it describes the state of
        ``token`` or a newer one, else ``None`` (read the state)."""
        return self._progress.waiting_hint(token if isinstance(token, int) else 0, deadline)

    # -- the executor's calls -------------------------------------------------------------

    def synced(
        self,
        state: RendezvousState,
        token: Token,
        written: bool | None,
        fetched: bool,
        deadline: Deadline,
    ) -> None:
        """The node synced ``state`` (read with ``token``): ``written`` as the holder's
        sync says (``True``: ours written, ``False``: lost the race, ``None``: read),
        ``fetched`` whether it read the backend. Summarise our write in the progress key,
        or relay a write it misses (see :meth:`.ProgressKey.state_read`). A read that
        found no state (``token`` ``None``) counts as one of token 0, older than any
        summary: a summary of a state deleted since is forgotten, lest the node wait for
        that state for ever (a candidate would read the absent state as fast as etcd
        answers); unless the read came from a member behind that summary
        (:meth:`.ProgressKey.absence_is_news`)."""
        if not (fetched or written is not None):
            return
        if token is None:
            if not self._progress.absence_is_news():
                return
            token = 0
        if isinstance(token, int):
            self._progress.state_read(token, state, written is True, self._joining, deadline)

    def refused(
        self, error: RequestTooLargeError, state: RendezvousState, token: Token, deadline: Deadline
    ) -> None:
        """etcd refused our write of ``state`` (made on the state of ``token``) for its
        size: tell the nodes it would have admitted (see :meth:`.ProgressKey.refused`)."""
        held = token if isinstance(token, int) else 0
        count = len(state.participants)
        self._progress.refused(error, held, count, state.complete, deadline)

    @property
    def folding(self) -> bool:
        """Whether the aggregator's fold waits to be written (it retries at once)."""
        return self._fold is not None

    def fold(self, state: RendezvousState, lost_race: bool, deadline: Deadline) -> bool:
        """The node's heartbeat, if due: refresh its key and, as the aggregator, the
        heartbeats in ``state`` of the nodes with a live key; again on the newer state
        after a ``lost_race`` (the fold does not wait for the next tick). Whether
        ``state`` changed (to be written)."""
        alive = self._fold
        if alive is None or not lost_race:
            self._fold = alive = None
            now = self._state_clock.now()
            if self.tick_due() or self._fallback_tick(state, now):
                alive = self._tick(state, now, deadline) or None
        if alive is None:
            return False
        self._fold = alive
        self._changes.refresh(state, alive)
        logger.debug(
            "The node '%s' refreshed the heartbeats of %d node(s) with a live key in the "
            "rendezvous '%s'. Pending sync.",
            self._node,
            len(alive),
            self._settings.run_id,
        )
        return True

    def decided(self, action: Action, state: RendezvousState) -> bool:
        """Whether :meth:`join` takes ``action``, the join (or exit) decision on
        ``state``: an admission, or leaving a complete round (both in a batch). Any
        other decision ends a wait for a batch: the events of the node admitted (or
        taken out) are recorded, saying who did it."""
        if action in ADMISSIONS or (action == Action.REMOVE_FROM_PARTICIPANTS and state.complete):
            return True
        if self._awaiting_admission:
            self._note_admitted(state)
        return False

    def join(
        self, action: Action, state: RendezvousState, token: Token, deadline: Deadline
    ) -> Changed | Wait | Refresh:
        """Take ``action`` (see :meth:`decided`): this node makes the batch of every
        announced node now, in ``state`` (:data:`CHANGED`), or waits for another node to
        make it (:class:`Wait`: how long at most), or must read the state first
        (:class:`Refresh`)."""
        settings = self._settings

        def wants(node: NodeDesc) -> bool:
            if self._leaves(state, node):
                return True
            return admission_action(state, node, settings) is not None

        counts = (len(state.participants), len(state.wait_list), len(state.redundancy_list))
        with self._lock:
            if action == Action.REMOVE_FROM_PARTICIPANTS:
                self._leave(state.round, deadline)
            if self._created is None:
                # Read the progress key first, so that our key is younger than the
                # decided index it holds (see stagger_wait).
                self._progress.read(deadline)
                self._announce(deadline)
            held = token if isinstance(token, int) else None
            # No state held (a read that found none, served by a member behind the
            # summary, keeps it): nothing to compare the summary with.
            moved = held is not None and self._progress.admitted_since(held, state)
            outcome = self._admission(wants, (state.round, *counts), held, moved, deadline)
        if isinstance(outcome, _Batch):
            self._awaiting_admission, self._awaiting_exit = False, None
            self._make_batch(state, outcome)
            return CHANGED
        self._awaiting_admission = True
        if isinstance(outcome, Wait) and action == Action.REMOVE_FROM_PARTICIPANTS:
            self._awaiting_exit = state.round
        return outcome

    def reap(self, state: RendezvousState, deadline: Deadline) -> Changed | Wait:
        """While this node is the first of the wait list of a complete round: take out
        of ``state`` the participants whose keys are gone (see "Dead participants" in
        docs/how-it-works.rst): :data:`CHANGED`; else how long to wait before looking
        again (``inf``: nothing to look at)."""
        if (
            state.closed
            or not state.complete
            or not state.wait_list
            or min(state.wait_list) != self._node
        ):
            return Wait(math.inf)
        blockers = [n for n in sorted(state.participants) if self._leaving_round(n) != state.round]
        if not blockers:
            return Wait(math.inf)
        outcome = self._reap(state.round, blockers, deadline)
        if isinstance(outcome, Wait):
            return outcome
        for node in outcome:
            logger.info(
                "The key of the node '%s' is gone (it died or left): the node '%s' takes it "
                "out of round %d of the rendezvous '%s'.",
                node,
                self._node,
                state.round,
                self._settings.run_id,
            )
            self._changes.remove_from_participants(state, node)
        return CHANGED

    @property
    def follows_progress(self) -> bool:
        """Whether the node, joining, waits on the progress key instead of the state."""
        return self._joining and self._progress.known

    def wait(
        self, state: RendezvousState, token: Token, timeout: float, deadline: Deadline
    ) -> Heard:
        """Wait up to ``timeout`` seconds on the progress key for a change that concerns
        the node, holding ``state`` read with ``token`` (see
        :meth:`.ProgressKey.await_change`)."""
        held = token if isinstance(token, int) else 0
        return self._progress.await_change(timeout, held, state, self._created, deadline)

    def seconds_to_tick(self) -> float | None:
        """Seconds until the next heartbeat tick is due (``None``: no key, no ticks)."""
        if self._created is None:
            return None
        return max(self._next_tick - self._clock(), 0.0)

    def tick_due(self) -> bool:
        """Whether the next heartbeat tick is due (within half an interval: the
        keep-alive timer fires every interval, give or take a little)."""
        return self._created is not None and self._next_tick - self._clock() <= self._interval / 2

    # -- leaving a round ------------------------------------------------------------------

    def _leave(self, round_: int, deadline: Deadline) -> None:
        """The node leaves the complete round ``round_`` (the exit of
        ``next_rendezvous()``): write its key saying so (once per round), for a batch
        to take it out."""
        with self._lock:
            if self._created is None:
                self._announce(deadline)
            if self._leaving != round_:
                self._keys.mark_leaving(self._node, round_, self._ttl, deadline)
                self._leaving, self._left_at = round_, self._clock()

    def _leaving_round(self, node: NodeDesc) -> int | None:
        """The complete round ``node`` asked to leave, as its key said in the last
        listing (for this node: as it wrote it); ``None`` if it did not ask."""
        if node == self._node:
            return self._leaving
        return self._marks.get(node)

    def _leaves(self, state: RendezvousState, node: NodeDesc) -> bool:
        """Whether ``node`` is a participant of the complete round its key says it leaves."""
        return (
            state.complete
            and node in state.participants
            and self._leaving_round(node) == state.round
        )

    # -- the batch ------------------------------------------------------------------------

    def _make_batch(self, state: RendezvousState, batch: _Batch) -> None:
        """Make ``batch`` in ``state``: the nodes leaving first (the last one out ends the
        round, and the join decisions then admit everyone to the next one's
        participants), then each node's join decision on the state as that left it; the
        heartbeats of the nodes of the listing (their keys were alive) are refreshed as
        the aggregator does, so a round completes with fresh heartbeats.

        The nodes on the wait list are admitted first (then the others, oldest first): a
        round that fills up at ``max_nodes`` leaves the members of the last round beyond
        it, which go to the redundancy list (``num_nodes_waiting()`` does not count them),
        rather than a node of the wait list, which the members' agents would see and
        re-rendezvous again for, to the same outcome, for ever."""
        changes = self._changes
        for node in [node for node in batch.nodes if self._leaves(state, node)]:
            changes.remove_from_participants(state, node)
        waiting = state.wait_list
        for node in sorted(batch.nodes, key=lambda node: node not in waiting):
            action = admission_action(state, node, self._settings)
            if action is not None:
                changes.admit(state, node, action)
        changes.refresh(state, self._listed)

    def _note_admitted(self, state: RendezvousState) -> None:
        """The node that waited for a batch was taken out of its round or admitted:
        record how (the events a node records when it does it itself, saying who did)."""
        self._awaiting_admission = False
        with self._lock:
            self._attempt = None
        node, run_id = self._node, self._settings.run_id
        left, self._awaiting_exit = self._awaiting_exit, None
        if left is not None and (node not in state.participants or state.round != left):
            msg = (
                f"The node '{node}' was removed from the participants of round {left} of "
                f"the rendezvous '{run_id}' by another node."
            )
            self._record("_remove_from_participants", msg)
        if node in state.participants:
            where, method = f"the participants of round {state.round}", "_add_to_participants"
        elif node in state.wait_list:
            where, method = f"the wait list of round {state.round + 1}", "_add_to_wait_list"
        elif node in state.redundancy_list:
            where = f"the redundancy list of round {state.round + 1}"
            method = "_add_to_redundancy_list"
        else:
            return
        msg = (
            f"The node '{node}' was added to {where} of the rendezvous '{run_id}' by another node."
        )
        self._record(method, msg)

    def _record(self, method: str, message: str) -> None:
        record_node_event(self._events, method, message, NodeState.RUNNING, self._node)
        logger.debug(message)

    # -- admission --------------------------------------------------------------------

    def _admission(
        self,
        wants: WantsAdmission,
        mark: object,
        token: int | None,
        moved: bool,
        deadline: Deadline,
    ) -> _Batch | Wait | Refresh:
        """The batch this node must make now, or else how long to wait (at most) for
        another node to make it; :class:`Refresh` if it must read the state first.

        ``wants`` tells whether a batch would do something for a node on the current
        state (take it out, or admit it); ``mark`` sums up the state's admissions: while
        it changes, the nodes ahead are making progress. ``token`` is the token of the
        state held; ``moved``: the progress key tells of a newer state with other
        admissions (see :meth:`.ProgressKey.admitted_since`). Only keys that are gone (or
        expired) are left out of a batch; a slow node is admitted by the next one. See
        docs/how-it-works.rst, "Our nodes: node keys, batched admission, one heartbeat
        writer" (candidate admitters, batch exits).
        """
        with self._lock:
            gathering = self._left_at + EXIT_GATHER - self._clock()
            if self._attempt is None and gathering > 0:
                return Wait(gathering)  # Let the others of the round ask to leave too.
            now = self._clock()
            created = self._created if self._created is not None else 0
            listing: list[AnnouncedNode] | None = None
            if self._attempt is None and self._is_candidate(created):
                self._attempt = _Attempt({}, now, staggered=True)
            elif self._attempt is None:
                listing = self._list(deadline)
                self._attempt = self._new_attempt(listing)
            attempt = self._attempt
            if mark != attempt.mark:
                attempt.mark, attempt.progress_at = mark, now
            stale = self._progress.newer_than(token or 0)
            if attempt.staggered and created <= self._progress.decided_upto:
                if stale:
                    # A batch decided our key: wait for the state that matters to us (the
                    # round complete, the last call) instead of reading it now.
                    return Wait(PROGRESS_SILENCE)
                # The state that decided our key does not have us (our key was taken for
                # dead, say): wait for the older keys, as a node with an old key does.
                listing = self._list(deadline)
                self._attempt = attempt = self._new_attempt(listing)
                attempt.mark = mark
            if attempt.staggered:
                return self._candidate_turn(attempt, created, wants, now, stale, deadline)
            behind = stale and token is not None
            return self._predecessors_turn(attempt, listing, wants, now, moved, behind, deadline)

    def _is_candidate(self, created: int) -> bool:
        """Whether the node, whose key was created at ``created``, is a candidate
        admitter (see :func:`stagger_wait`) rather than a node that waits for its listed
        predecessors: it follows a progress key, and its key was not decided yet."""
        return self._progress.known and created > self._progress.decided_upto

    def _candidate_turn(
        self,
        attempt: _Attempt,
        created: int,
        wants: WantsAdmission,
        now: float,
        stale: bool,
        deadline: Deadline,
    ) -> _Batch | Wait | Refresh:
        """A candidate admitter makes the batch of every listed key, older ones included,
        once its turn came without progress (a batch deciding more keys, not any write:
        heartbeat folds), on the state the progress key describes."""
        progress = self._progress
        idle = now - max(attempt.progress_at, progress.decided_at)
        wait = stagger_wait(created, progress.decided_upto, idle, attempt.jitter)
        if wait > 0:
            return Wait(wait)
        if stale:
            return Refresh()
        return self._batch(self._list(deadline), wants, deadline)

    def _predecessors_turn(
        self,
        attempt: _Attempt,
        listing: list[AnnouncedNode] | None,
        wants: WantsAdmission,
        now: float,
        moved: bool,
        behind: bool,
        deadline: Deadline,
    ) -> _Batch | Wait | Refresh:
        """A node with a listed attempt makes the batch once its predecessors were
        admitted, or after :data:`ADMISSION_GRACE` without progress, staggered by how
        many of them still wait (see :func:`grace_wait`), admitting them too. ``listing``
        is the one taken on this look, if any.

        A predecessor is judged on the state held. While the progress key tells of a
        newer state with other admissions (``moved``), a blocked node reads it first:
        a batch may have decided its predecessors (a leaving node whose listing came
        before the others asked takes out only itself). Without that read the younger
        nodes would wait out the grace and then all make batches at once, every one a
        large state write and all but one lost. A node about to make the batch on a state
        older than the summary heard (``behind``: a fold, say) reads it first, as a
        candidate does: its write would be lost."""
        waited = now - attempt.progress_at
        if attempt.blocked(wants):
            if moved:
                return Refresh()
            if waited < ADMISSION_GRACE:
                return Wait(ADMISSION_GRACE - waited)
            wait = grace_wait(len(attempt.blockers(wants)), waited, attempt.jitter)
            if wait > 0:
                return Wait(wait)
            if behind:
                return Refresh()
            listing = self._list(deadline)
            self._admit_the_slow(attempt, listing, wants, now)
            return self._batch(listing, wants, deadline)
        if behind:
            return Refresh()
        if listing is None:
            listing = self._list(deadline)
            # An older node that asked to leave since our last listing makes the batch
            # (the oldest that asks does, after its own listing).
            if attempt.blocked(wants):
                return Wait(max(ADMISSION_GRACE - waited, 0.0))
        return self._batch(listing, wants, deadline)

    def _list(self, deadline: Deadline) -> list[AnnouncedNode]:
        """List the node keys, and note which nodes asked to leave their round."""
        listing = self._keys.list_nodes(deadline)
        self._seen.update(entry.node for entry in listing)
        listed = {entry.node: entry.created_index for entry in listing}
        self._dead = {n: i for n, i in self._dead.items() if listed.get(n) == i}
        self._forgive_renewed(deadline)
        listing = [e for e in listing if self._dead.get(e.node) != e.created_index]
        self._marks = {e.node: e.leaving for e in listing if e.leaving is not None}
        return listing

    def _forgive_renewed(self, deadline: Deadline) -> None:
        """Forget the keys taken for dead that a probe finds with a whole second or more
        to live: their nodes renewed them in their last second (a v3 lease reading 0 s
        had under a second left, not none). At most ``_REAP_PROBES`` probes a listing,
        the longest unprobed first; a dead key is listed for a second or so at most."""
        for node in list(self._dead)[:_REAP_PROBES]:
            index = self._dead.pop(node)
            if (self._keys.expires_in(node, deadline) or 0) < 1:
                self._dead[node] = index  # still dead: to the back of the queue
            else:
                logger.info(
                    "The key of the node '%s' was renewed after it was taken for dead; "
                    "the node may be admitted again.",
                    node,
                )

    def _reap(
        self, round_: int, blockers: list[NodeDesc], deadline: Deadline
    ) -> list[NodeDesc] | Wait:
        """The nodes among ``blockers`` whose keys are gone, or else how long to wait
        before looking again (see "Dead participants" in docs/how-it-works.rst).

        ``blockers`` are the participants of the complete round ``round_`` that did not
        ask to leave it, while this node waits for the next round. A node is judged only
        if a listing showed its key before (PyTorch's nodes have none); a key with less
        than a whole second to live counts as gone. Looks again when the first key may
        expire, and at least every keep-alive interval; a state change does not make it
        look earlier.
        """
        with self._lock:
            now = self._clock()
            if round_ != self._reap_round:
                self._reap_round, self._reap_at = round_, -math.inf
            if now < self._reap_at:
                return Wait(self._reap_at - now)
            seen = set(self._seen)
            alive = {entry.node: entry.created_index for entry in self._list(deadline)}
            gone = [node for node in blockers if node in seen and node not in alive]
            if gone:
                return gone
            keyed = [node for node in blockers if node in alive]
            probed = {
                node: self._keys.expires_in(node, deadline) or 0 for node in keyed[:_REAP_PROBES]
            }
            # A key without a whole second left is as good as gone: its node, which
            # refreshes it every interval, missed all but the last second of its lifetime
            # (v2 lists a key past its expiry until it deletes it; a v3 lease counts down
            # in whole seconds and cannot be renewed once expired). Until etcd deletes it,
            # our listings leave it out, lest a batch admit the dead node again (unless
            # they find it renewed: at 0 s a v3 lease still had a fraction of a second).
            expired = [node for node, ttl in probed.items() if ttl <= 0]
            # Delete those keys before the caller takes their nodes out, so that no batch
            # made on the state without them admits them again from a listing of its own.
            expired = [node for node in expired if self._keys.remove_expired(node, deadline)]
            if expired:
                self._dead.update((node, alive[node]) for node in expired)
                return expired
            lifetimes = list(probed.values())
            wait = self._interval
            if lifetimes:
                wait = max(min(lifetimes) - 1.0, 0.0) + _REAP_STEP
                if len(lifetimes) < len(keyed):
                    wait = min(wait, self._interval)
            self._reap_at = now + wait
            logger.debug(
                "The node '%s' waits for %d participant(s) of round %d with a live key to "
                "leave it (lifetimes read: %s); looking again in %.1f s.",
                self._node,
                len(keyed),
                round_,
                lifetimes,
                wait,
            )
            return Wait(wait)

    def _new_attempt(self, listing: list[AnnouncedNode]) -> _Attempt:
        created = self._created if self._created is not None else math.inf
        # Oldest first, as listed.
        predecessors = {
            entry.node: entry.created_index
            for entry in listing
            if entry.created_index < created and entry.node != self._node
        }
        return _Attempt(predecessors, self._clock())

    def _admit_the_slow(
        self, attempt: _Attempt, listing: list[AnnouncedNode], wants: WantsAdmission, now: float
    ) -> None:
        """A grace period passed without progress: forget the predecessors whose keys
        are gone; those still listed are slow, not dead, and the batch admits them."""
        alive = {entry.node for entry in listing}
        attempt.predecessors = {n: i for n, i in attempt.predecessors.items() if n in alive}
        slow = attempt.blockers(wants)
        if slow:
            logger.info(
                "The node '%s' waited %.1f s for %d older node(s) to be admitted (the "
                "oldest '%s'); admitting them with the others.",
                self._node,
                now - attempt.progress_at,
                len(slow),
                slow[0],
            )

    def _batch(
        self, listing: list[AnnouncedNode], wants: WantsAdmission, deadline: Deadline
    ) -> _Batch:
        """The batch of ``listing`` (the nodes of the listing are kept: their keys were
        alive, so the batch's write refreshes their heartbeats too, as the aggregator
        would)."""
        if not self._leading and self._keys.aggregator(deadline) is None:
            # The first admitter aggregates from the start: the heartbeats of the nodes
            # it admits are folded before any of them is late.
            self._leading = self._keys.claim_aggregator(self._node, self._lock_ttl, deadline)
        self._listed = {entry.node for entry in listing}
        # This attempt is over: a later admission (the next round) lists afresh, lest it
        # wait for predecessors of this one that are gone.
        self._attempt = None
        self._progress.batch_listed()
        batch = [entry.node for entry in listing]
        if self._node not in self._listed and wants(self._node):
            # Our key vanished after we announced it (the refresh will re-create it).
            batch.append(self._node)
        return _Batch(batch)

    def _announce(self, deadline: Deadline) -> None:
        self._created = self._keys.announce_node(self._node, self._ttl, deadline)
        self._next_tick = self._clock() + self._interval
        logger.debug("The node '%s' announced itself (index %s).", self._node, self._created)

    # -- heartbeats -------------------------------------------------------------------

    def _tick(self, state: RendezvousState, now: datetime, deadline: Deadline) -> set[NodeDesc]:
        """The node's heartbeat: refresh its key (re-create it if it expired) and, if the
        node is (or becomes) the aggregator, return the nodes of ``state`` whose keys are
        alive, whose heartbeats the caller refreshes in one state write (``now`` is the
        time of the state's clock).

        A node that is not joining and not in ``state`` was dropped (or left): its key
        is deleted instead, so that no batch admits it unasked.
        """
        with self._lock:
            if self._created is None:
                return set()
            self._next_tick = self._clock() + self._interval
            if not self._joining and self._node not in state.last_heartbeats:
                logger.info(
                    "The node '%s' is no longer in the rendezvous; deleting its key.", self._node
                )
                self.withdraw(deadline)
                return set()
            if not self._keys.refresh_node(self._node, self._ttl, deadline):
                logger.info("The key of the node '%s' expired; announcing it again.", self._node)
                self._created = self._keys.announce_node(self._node, self._ttl, deadline)
                self._leaving = None
            if not self._lead(state, now, deadline):
                return set()
            alive = {entry.node for entry in self._list(deadline)}
            return {node for node in state.last_heartbeats if node in alive}

    def _lead(self, state: RendezvousState, now: datetime, deadline: Deadline) -> bool:
        """Whether this node is the aggregator: it holds the lock (renewed here: the
        lock can only have changed hands if it lapsed, and then the renewal fails) or
        just took it because nobody held it.

        A node that does not hold the lock looks at it only when its own heartbeat in
        the state is late (:data:`_LATE` intervals old): while an aggregator folds the
        heartbeats, nobody else reads or tries to take the lock. Nor does a node whose
        held state has no heartbeat of its own.
        """
        lapsed = False
        if self._leading:
            # Our lock, unless it lapsed: only then can another node have taken it.
            if self._keys.renew_aggregator(self._node, self._lock_ttl, deadline):
                return True
            self._leading, lapsed = False, True
        beat = state.last_heartbeats.get(self._node)
        # (An aggregator whose lock lapsed, a renewal late, looks at it once: it takes it
        # again if nobody did, rather than leave everyone to their fallback.)
        if beat is None or (now - beat < self._late and not lapsed):
            # (None: the state held is not one we are in, a joiner's empty state for
            # instance: folding it would refresh nobody while holding the lock.)
            return False
        holder = self._keys.aggregator(deadline)
        lock_ttl = self._lock_ttl
        if holder == self._node and self._keys.renew_aggregator(self._node, lock_ttl, deadline):
            self._leading = True
        elif holder is None or holder == self._node:
            self._leading = self._keys.claim_aggregator(self._node, lock_ttl, deadline)
            if self._leading:
                logger.info("The node '%s' aggregates the heartbeats now.", self._node)
        else:
            self._leading = False
        return self._leading
