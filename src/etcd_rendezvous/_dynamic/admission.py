"""Batched admission and aggregated heartbeats for the dynamic rendezvous (node keys).

With a backend that implements :class:`NodeRegistry` (this package's ``etcd-v2``
backend), each node announces itself with a key of its own; a candidate admitter (the
node whose key is the oldest not yet decided, or the next one if it is slow) admits
every announced node (or takes it out of the round it leaves) in one state write, and
summarises that write in the progress key (:mod:`etcd_rendezvous._dynamic.progress`),
which the other nodes wait on instead of the state; one *aggregator* refreshes the
heartbeats of every node with a live key in one write; and the first node of the wait
list takes out the participants whose keys are gone. A constant number of requests per
node instead of
PyTorch's O(N^2), writing the same state.

:class:`NodeKeys` is one node's side of it: its key, its admission attempt, its
heartbeat ticks and their requests to the registry. What a batch does to the state is
decided by :mod:`etcd_rendezvous._dynamic.ops` and carried out by
:mod:`etcd_rendezvous._dynamic.executor`. The protocol step by step: see
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
from typing import Protocol, runtime_checkable

from ..api import RequestTooLargeError
from .progress import PROGRESS_SILENCE, Heard, Progress, ProgressBoard, ProgressKey
from .settings import RendezvousSettings
from .state import NodeDesc, RendezvousState

__all__ = [
    "ADMISSION_GRACE",
    "ADMIT_GATHER",
    "ADMIT_STAGGER",
    "EXIT_GATHER",
    "AnnouncedNode",
    "Batch",
    "Gone",
    "NodeKeys",
    "NodeRegistry",
    "Refresh",
    "Wait",
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
#: How many keep-alive intervals before its heartbeat in the state expires a node with a
#: key writes it itself, at the latest: the aggregator failed. The node looks once per
#: interval, so it writes between this and one interval less before the expiry.
_FALLBACK_MARGIN = 1.5
#: The TTL of the aggregator lock, in keep-alive intervals: the holder renews it every
#: interval; if it dies, another node takes over within this time.
_LOCK_INTERVALS = 2


@dataclass(frozen=True)
class AnnouncedNode:
    """A node key as listed: the node, the etcd index at which its key was created, and
    the complete round the node asked to leave, if its key says so (see
    :meth:`NodeRegistry.mark_leaving`)."""

    node: NodeDesc
    created_index: int
    leaving: int | None = None


@dataclass(frozen=True)
class Wait:
    """Nothing for this node to do yet: look again within ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Batch:
    """This node makes the batch now: ``nodes`` are the listed nodes, oldest first, but
    those taken for dead. For each, the caller takes it out of its round if it leaves,
    and admits it if the join decision says so."""

    nodes: list[NodeDesc]


@dataclass(frozen=True)
class Gone:
    """Participants whose keys are gone (died or withdrew): the caller takes them out
    of the round."""

    nodes: list[NodeDesc]


@dataclass(frozen=True)
class Refresh:
    """This node would make the batch now, but the state it holds is older than the
    one the progress key describes: read the state first, then ask again."""


def stagger_wait(created: int, decided_upto: int, idle: float, jitter: float = 0.0) -> float:
    """Seconds until the node whose key was created at ``created`` makes the batch, when
    every key up to ``decided_upto`` was decided and nobody made progress for ``idle``
    seconds (0: now); ``jitter`` in [0, 1) spreads the nodes beyond
    :data:`_STAGGER_CAP` steps. The distance of the indexes bounds from above how many
    undecided keys are ahead (see docs/how-it-works.rst, "Our nodes: node keys, batched
    admission, one heartbeat writer", candidate admitters).
    """
    ahead = max(created - decided_upto - 2, 0)
    steps = ADMIT_GATHER + min(ahead, _STAGGER_CAP) * ADMIT_STAGGER
    if ahead >= _STAGGER_CAP:
        steps += jitter * _TAIL_JITTER
    return max(steps - idle, 0.0)


@runtime_checkable
class NodeRegistry(Protocol):
    """What a backend provides for node keys.

    A backend with all these methods gets batched admission and aggregated heartbeats;
    any other backend (PyTorch's, a user's) keeps PyTorch's protocol. Every method may
    raise :class:`~etcd_rendezvous.api.RendezvousConnectionError`.
    """

    def announce_node(self, node: NodeDesc, ttl: int) -> int:
        """Create the key of ``node`` (or find it made by an earlier attempt of ours);
        return the index at which it was created."""

    def refresh_node(self, node: NodeDesc, ttl: int) -> bool:
        """Restart the TTL of the key of ``node``; ``False`` if the key is gone."""

    def withdraw_node(self, node: NodeDesc) -> None:
        """Delete the key of ``node`` (nothing if it is gone)."""

    def mark_leaving(self, node: NodeDesc, round_: int, ttl: int) -> None:
        """Write the key of ``node`` saying that the node leaves the complete round
        ``round_`` (create it, with ``ttl``, if it is gone); listings report it."""

    def list_nodes(self) -> list[AnnouncedNode]:
        """Every node key of the run, oldest first."""

    def expires_in(self, node: NodeDesc) -> int | None:
        """Whole seconds until the key of ``node`` expires, as far as the last listing
        tells (on v3: one request for its lease); ``0`` or ``None`` if its time is up
        (or it is gone)."""

    def remove_expired(self, node: NodeDesc) -> bool:
        """Delete the key of ``node`` if it is still the one the last listing showed;
        whether the key is gone now (``False``: it was written since, its node lives)."""

    def aggregator(self) -> NodeDesc | None:
        """The holder of the aggregator lock, or ``None`` if nobody holds it."""

    def claim_aggregator(self, node: NodeDesc, ttl: int) -> bool:
        """Create the aggregator lock for ``node`` if nobody holds it; whether it did."""

    def renew_aggregator(self, node: NodeDesc, ttl: int) -> bool:
        """Restart the TTL of the lock if ``node`` holds it; ``False`` if gone or another's."""

    def release_aggregator(self, node: NodeDesc) -> None:
        """Delete the aggregator lock if ``node`` holds it."""


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
    #: What the state's admissions looked like at the last look (see ``admission``).
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


class NodeKeys:
    """The node-key protocol of one handler's node.

    The handler calls :meth:`begin_join` and :meth:`end_join` around
    ``next_rendezvous()`` and :meth:`withdraw` when it leaves (or fails to join); its
    operation executor
    calls :meth:`admission` instead of adding the node itself, and :meth:`tick` when
    :meth:`tick_due` says so. Thread-safe.

    Args:
        registry: the backend that keeps the keys.
        node: this handler's node.
        settings: the rendezvous settings (the keep-alive interval and attempts).
        clock: the monotonic clock (replaceable in tests).
    """

    def __init__(
        self,
        registry: NodeRegistry,
        node: NodeDesc,
        settings: RendezvousSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._node = node
        interval = settings.keep_alive_interval.total_seconds()
        attempts = settings.keep_alive_max_attempt
        self._interval = interval
        self._ttl = max(1, math.ceil(interval * attempts))
        self._lock_ttl = max(1, math.ceil(interval * _LOCK_INTERVALS))
        # A node with a live key compare-and-swaps its own heartbeat only this late
        # (never earlier than PyTorch's interval).
        self._period = settings.keep_alive_interval * max(1.0, attempts - _FALLBACK_MARGIN)
        self._late = settings.keep_alive_interval * _LATE
        self._clock = clock
        self._lock = threading.RLock()
        self._created: int | None = None
        self._next_tick = math.inf
        self._joining = False
        self._attempt: _Attempt | None = None
        self._leading = False
        self._listed: set[NodeDesc] = set()
        # The complete round our key says we leave (see ``leave``), and what the keys of
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
        board = registry if isinstance(registry, ProgressBoard) else None
        self._progress = ProgressKey(board, node, settings.min_nodes, clock, self._ttl)

    @property
    def node(self) -> NodeDesc:
        """This handler's node."""
        return self._node

    @property
    def announced(self) -> bool:
        """Whether the node's key exists (as far as this node knows)."""
        return self._created is not None

    def heartbeat_period(self, default: timedelta) -> timedelta:
        """How old the node's heartbeat in the state may get before the node writes it
        itself: ``default`` without a key, later with one (the aggregator's job)."""
        return self._period if self._created is not None else default

    # -- joining and leaving --------------------------------------------------------------

    def begin_join(self) -> None:
        """``next_rendezvous()`` started: keep the key whatever the state says."""
        with self._lock:
            self._joining = True
            self._attempt = None

    def end_join(self) -> None:
        """``next_rendezvous()`` ended (if it failed, the handler withdraws the node):
        stop watching, lest every later state write (the heartbeat folds) reach us."""
        with self._lock:
            self._joining = False
            self._attempt = None
            self._progress.stop_waiting()

    def withdraw(self) -> None:
        """Delete the node's key and release the aggregator lock if the node holds it."""
        with self._lock:
            created, leading = self._created, self._leading
            self._created, self._leading, self._leaving = None, False, None
            self._next_tick = math.inf
            self._attempt = None
            if leading:
                self._registry.release_aggregator(self._node)
            if created is not None:
                self._registry.withdraw_node(self._node)

    def admitted(self) -> None:
        """The join decision no longer adds the node: forget the attempt."""
        with self._lock:
            self._attempt = None

    def leave(self, round_: int) -> None:
        """The node leaves the complete round ``round_`` (the exit of
        ``next_rendezvous()``): write its key saying so (once per round), for a batch
        to take it out (see :meth:`admission`)."""
        with self._lock:
            if self._created is None:
                self._announce()
            if self._leaving != round_:
                self._registry.mark_leaving(self._node, round_, self._ttl)
                self._leaving, self._left_at = round_, self._clock()

    def leaving(self, node: NodeDesc) -> int | None:
        """The complete round ``node`` asked to leave, as its key said in the last
        listing (for this node: as it wrote it); ``None`` if it did not ask."""
        if node == self._node:
            return self._leaving
        return self._marks.get(node)

    # -- admission --------------------------------------------------------------------

    def admission(
        self, wants: WantsAdmission, mark: object, token: int | None = None
    ) -> Batch | Wait | Refresh:
        """The batch this node must make now, or else how long to wait (at most) for
        another node to make it; :class:`Refresh` if it must read the state first.

        ``wants`` tells whether a batch would do something for a node on the current
        state (take it out, or admit it); ``mark`` sums up the state's admissions: while
        it changes, the nodes ahead are making progress. ``token`` is the token of the
        state held. Only keys that are gone (or expired) are left out of a batch; a slow
        node is admitted by the next one. See docs/how-it-works.rst, "Our nodes: node keys,
        batched admission, one heartbeat writer" (candidate admitters, batch exits).
        """
        with self._lock:
            if self._created is None:
                self._progress.read()
                self._announce()
            gathering = self._left_at + EXIT_GATHER - self._clock()
            if self._attempt is None and gathering > 0:
                return Wait(gathering)  # Let the others of the round ask to leave too.
            now = self._clock()
            created = self._created if self._created is not None else 0
            listing: list[AnnouncedNode] | None = None
            if self._attempt is None and self._is_candidate(created):
                self._attempt = _Attempt({}, now, staggered=True)
            elif self._attempt is None:
                listing = self._list()
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
                listing = self._list()
                self._attempt = attempt = self._new_attempt(listing)
                attempt.mark = mark
            if attempt.staggered:
                return self._candidate_turn(attempt, created, wants, now, stale)
            return self._predecessors_turn(attempt, listing, wants, now)

    def _is_candidate(self, created: int) -> bool:
        """Whether the node, whose key was created at ``created``, is a candidate
        admitter (see :func:`stagger_wait`) rather than a node that waits for its listed
        predecessors: it follows a progress key, and its key was not decided yet."""
        return self._progress.known and created > self._progress.decided_upto

    def _candidate_turn(
        self, attempt: _Attempt, created: int, wants: WantsAdmission, now: float, stale: bool
    ) -> Batch | Wait | Refresh:
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
        return self._batch(self._list(), wants)

    def _predecessors_turn(
        self,
        attempt: _Attempt,
        listing: list[AnnouncedNode] | None,
        wants: WantsAdmission,
        now: float,
    ) -> Batch | Wait:
        """A node with a listed attempt makes the batch once its predecessors were
        admitted, or after :data:`ADMISSION_GRACE` without progress (admitting them too).
        ``listing`` is the one taken on this look, if any."""
        waited = now - attempt.progress_at
        if attempt.blocked(wants):
            if waited < ADMISSION_GRACE:
                return Wait(ADMISSION_GRACE - waited)
            listing = self._list()
            self._admit_the_slow(attempt, listing, wants, now)
            return self._batch(listing, wants)
        if listing is None:
            listing = self._list()
            # An older node that asked to leave since our last listing makes the batch
            # (the oldest that asks does, after its own listing).
            if attempt.blocked(wants):
                return Wait(max(ADMISSION_GRACE - waited, 0.0))
        return self._batch(listing, wants)

    def _list(self) -> list[AnnouncedNode]:
        """List the node keys, and note which nodes asked to leave their round."""
        listing = self._registry.list_nodes()
        self._seen.update(entry.node for entry in listing)
        listed = {entry.node: entry.created_index for entry in listing}
        self._dead = {n: i for n, i in self._dead.items() if listed.get(n) == i}
        self._forgive_renewed()
        listing = [e for e in listing if self._dead.get(e.node) != e.created_index]
        self._marks = {e.node: e.leaving for e in listing if e.leaving is not None}
        return listing

    def _forgive_renewed(self) -> None:
        """Forget the keys taken for dead that a probe finds with a whole second or more
        to live: their nodes renewed them in their last second (a v3 lease reading 0 s
        had under a second left, not none). At most ``_REAP_PROBES`` probes a listing,
        the longest unprobed first; a dead key is listed for a second or so at most."""
        for node in list(self._dead)[:_REAP_PROBES]:
            index = self._dead.pop(node)
            if (self._registry.expires_in(node) or 0) < 1:
                self._dead[node] = index  # still dead: to the back of the queue
            else:
                logger.info(
                    "The key of the node '%s' was renewed after it was taken for dead; "
                    "the node may be admitted again.",
                    node,
                )

    def reap(self, round_: int, blockers: list[NodeDesc]) -> Gone | Wait:
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
            alive = {entry.node: entry.created_index for entry in self._list()}
            gone = [node for node in blockers if node in seen and node not in alive]
            if gone:
                return Gone(gone)
            keyed = [node for node in blockers if node in alive]
            probed = {node: self._registry.expires_in(node) or 0 for node in keyed[:_REAP_PROBES]}
            # A key without a whole second left is as good as gone: its node, which
            # refreshes it every interval, missed all but the last second of its lifetime
            # (v2 lists a key past its expiry until it deletes it; a v3 lease counts down
            # in whole seconds and cannot be renewed once expired). Until etcd deletes it,
            # our listings leave it out, lest a batch admit the dead node again (unless
            # they find it renewed: at 0 s a v3 lease still had a fraction of a second).
            expired = [node for node, ttl in probed.items() if ttl <= 0]
            # Delete those keys before the caller takes their nodes out, so that no batch
            # made on the state without them admits them again from a listing of its own.
            expired = [node for node in expired if self._registry.remove_expired(node)]
            if expired:
                self._dead.update((node, alive[node]) for node in expired)
                return Gone(expired)
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

    def listed(self) -> set[NodeDesc]:
        """The nodes of the listing the last batch came from: their keys were alive, so
        the batch's write refreshes their heartbeats too (as the aggregator would)."""
        return self._listed

    def _batch(self, listing: list[AnnouncedNode], wants: WantsAdmission) -> Batch:
        if not self._leading and self._registry.aggregator() is None:
            # The first admitter aggregates from the start: the heartbeats of the nodes
            # it admits are folded before any of them is late.
            self._leading = self._registry.claim_aggregator(self._node, self._lock_ttl)
        self._listed = {entry.node for entry in listing}
        # This attempt is over: a later admission (the next round) lists afresh, lest it
        # wait for predecessors of this one that are gone.
        self._attempt = None
        self._progress.batch_listed()
        batch = [entry.node for entry in listing]
        if self._node not in self._listed and wants(self._node):
            # Our key vanished after we announced it (the refresh will re-create it).
            batch.append(self._node)
        return Batch(batch)

    def _announce(self) -> None:
        self._created = self._registry.announce_node(self._node, self._ttl)
        self._next_tick = self._clock() + self._interval
        logger.debug("The node '%s' announced itself (index %s).", self._node, self._created)

    # -- the progress key --------------------------------------------------------------

    @property
    def follows_progress(self) -> bool:
        """Whether the node, joining, waits on the progress key instead of the state."""
        return self._joining and self._progress.known

    def await_progress(self, timeout: float, token: int, state: RendezvousState) -> Heard:
        """See :meth:`.ProgressKey.await_change` (for this node's key)."""
        return self._progress.await_change(timeout, token, state, self._created)

    def refused(
        self, error: RequestTooLargeError, token: int, count: int, completing: bool
    ) -> None:
        """See :meth:`.ProgressKey.refused`."""
        self._progress.refused(error, token, count, completing)

    def state_read(self, token: int, state: RendezvousState, written: bool) -> None:
        """See :meth:`.ProgressKey.state_read` (a relay only while joining)."""
        self._progress.state_read(token, state, written, self._joining)

    def waiting_hint(self, token: int) -> Progress | None:
        """See :meth:`.ProgressKey.waiting_hint`."""
        return self._progress.waiting_hint(token)

    # -- heartbeats -------------------------------------------------------------------

    def seconds_to_tick(self) -> float | None:
        """Seconds until the next :meth:`tick` is due (``None``: no key, no ticks)."""
        if self._created is None:
            return None
        return max(self._next_tick - self._clock(), 0.0)

    def tick_due(self) -> bool:
        """Whether the next :meth:`tick` is due (within half an interval: the keep-alive
        timer fires every interval, give or take a little)."""
        return self._created is not None and self._next_tick - self._clock() <= self._interval / 2

    def tick(self, state: RendezvousState, now: datetime) -> set[NodeDesc]:
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
                self.withdraw()
                return set()
            if not self._registry.refresh_node(self._node, self._ttl):
                logger.info("The key of the node '%s' expired; announcing it again.", self._node)
                self._created = self._registry.announce_node(self._node, self._ttl)
                self._leaving = None
            if not self._lead(state, now):
                return set()
            alive = {entry.node for entry in self._list()}
            return {node for node in state.last_heartbeats if node in alive}

    def _lead(self, state: RendezvousState, now: datetime) -> bool:
        """Whether this node is the aggregator: it holds the lock (renewed here: the
        lock can only have changed hands if it lapsed, and then the renewal fails) or
        just took it because nobody held it.

        A node that does not hold the lock looks at it only when its own heartbeat in
        the state is late (:data:`_LATE` intervals old): while an aggregator folds the
        heartbeats, nobody else reads or tries to take the lock.
        """
        if self._leading:
            # Our lock, unless it lapsed: only then can another node have taken it.
            if self._registry.renew_aggregator(self._node, self._lock_ttl):
                return True
            self._leading = False
        beat = state.last_heartbeats.get(self._node)
        if beat is not None and now - beat < self._late:
            return False
        holder = self._registry.aggregator()
        if holder == self._node and self._registry.renew_aggregator(self._node, self._lock_ttl):
            self._leading = True
        elif holder is None or holder == self._node:
            self._leading = self._registry.claim_aggregator(self._node, self._lock_ttl)
            if self._leading:
                logger.info("The node '%s' aggregates the heartbeats now.", self._node)
        else:
            self._leading = False
        return self._leading
