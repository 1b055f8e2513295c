"""Batched admission: how a worker of the legacy ``etcd`` backend joins in a few requests.

Workers announce themselves with a member key ``rdzv/v_<V>/node_<hex>`` (also their
keep-alive key); a few candidates, the workers whose keys are the oldest not yet
decided, each after a stagger on that age, list the member keys and admit every
announced one in one compare-and-swap, recording their ranks in the state's ``members``
field, then write the version's ``progress`` hint; the others wait on the hint and read
the state only when it concerns them. A state frozen by PyTorch's workers is confirmed
the same way. The protocol, its delays and the wire format: docs/how-it-works.rst,
section "Joining in a few requests".

The decisions (:func:`admission_step`, :func:`confirmation_step`, :func:`plan_admission`,
:func:`plan_freeze`, :func:`plan_confirmation`) are plain functions of what a worker
observed; :class:`BatchJoin` carries them out, waiting on a
:class:`~etcd_rendezvous._legacy.feed.StateFeed`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from .._transport.interface import (
    CompareFailedError,
    KeyNotFoundError,
    Node,
    Transport,
)
from .._transport.retry import Deadline
from ..api import RendezvousError, RendezvousStateError
from ..layout import LegacyLayout, member_name, new_member_name, normalize_key
from .feed import Observed, StateFeed
from .state import (
    CONST_ETCD_FROZEN_TTL,
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
    CONST_WORKER_KEEPALIVE_TTL,
    LOGGER_NAME,
    MEMBERS,
    Hint,
    describe,
    members_of,
)

__all__ = [
    "ADMISSION_GRACE",
    "ADMIT_CANDIDATES",
    "ADMIT_GATHER",
    "ADMIT_STAGGER",
    "ADMIT_TAIL",
    "AdmissionStep",
    "Admit",
    "Admitted",
    "Announced",
    "BatchJoin",
    "Complete",
    "Confirm",
    "ConfirmationStep",
    "Leave",
    "Read",
    "RestartAttempt",
    "Wait",
    "Write",
    "admission_step",
    "admit_delay",
    "announced",
    "confirmation_step",
    "create_spread",
    "grace",
    "plan_admission",
    "plan_confirmation",
    "plan_freeze",
]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds the state may stay unchanged before a worker confirms without the
#: lower-ranked unconfirmed members it waits for.
ADMISSION_GRACE = 2.0

#: Admission by candidates (:func:`admit_delay`): a worker not yet admitted makes the
#: batch once nothing happened for ``ADMIT_GATHER`` seconds (more keys arrive meanwhile)
#: plus ``ADMIT_STAGGER`` per index step its key is behind the last decided one, for the
#: first ``ADMIT_CANDIDATES`` steps; further behind, it waits a moment more, drawn from
#: ``ADMIT_TAIL`` seconds. The oldest undecided worker fires first; should it be slow, the
#: next takes over one step later and admits it too.
ADMIT_GATHER = 0.02
ADMIT_STAGGER = 0.05
ADMIT_CANDIDATES = 8
ADMIT_TAIL = 1.0
#: Each such key (member) adds this much to the grace, up to twice the grace: the
#: worker next in line acts first, and its write spares the others the trouble.
_GRACE_STAGGER = 0.1

#: A worker that finds no state watches it for a random moment before creating it, so
#: that of many workers arriving at once only a few try (a failed try costs a write, two
#: on v3: the lease, then the transaction). The moment is drawn from a window of
#: ``max_workers`` times this many etcd round trips (the initial read's), at least a
#: millisecond each, and at most :data:`_CREATE_SPREAD_CAP` seconds: a loaded etcd
#: answers slowly, and a creation then takes longer to be seen.
_CREATE_SPREAD_ROUND_TRIPS = 3
_CREATE_SPREAD_MIN = 0.001
_CREATE_SPREAD_CAP = 2.0


class RestartAttempt(Exception):  # noqa: N818 (a signal, as PyTorch's retry exceptions)
    """The state left the version being joined: start the attempt over at once."""


def grace(waited_for: int) -> float:
    """Seconds of an unchanged state after which a worker stops waiting for the
    ``waited_for`` workers ahead of it (see :data:`ADMISSION_GRACE`)."""
    stagger = _GRACE_STAGGER * max(0, waited_for - 1)
    return ADMISSION_GRACE + min(stagger, ADMISSION_GRACE)


def admit_delay(behind: int, name: str) -> float:
    """Seconds of quiet after which the worker whose member key ``name`` was created
    ``behind`` index steps after the last decided key makes the admission batch (see
    :data:`ADMIT_STAGGER`); past :data:`ADMIT_CANDIDATES` steps, a part of
    :data:`ADMIT_TAIL` drawn from the name's hex digits. See docs/how-it-works.rst,
    "Joining in a few requests"."""
    steps = max(1, behind)
    if steps < ADMIT_CANDIDATES:
        return ADMIT_GATHER + ADMIT_STAGGER * (steps - 1)
    try:
        spread = int(name[-4:], 16) / 0x10000
    except ValueError:
        spread = 0.5
    return ADMIT_GATHER + ADMIT_STAGGER * (ADMIT_CANDIDATES - 1) + ADMIT_TAIL * spread


def create_spread(max_workers: int, round_trip: float) -> float:
    """Seconds to watch a missing state before creating it: random, in a window that
    grows with ``max_workers`` and with etcd's ``round_trip`` time (see
    :data:`_CREATE_SPREAD_ROUND_TRIPS`)."""
    per_worker = max(_CREATE_SPREAD_MIN, _CREATE_SPREAD_ROUND_TRIPS * round_trip)
    window = min(_CREATE_SPREAD_CAP, per_worker * max_workers)
    return window * secrets.randbelow(1 << 20) / (1 << 20)


# -- the member keys ------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Announced:
    """A member key found in a version directory (ordered by creation)."""

    created_index: int
    name: str
    key: str


def announced(listing: Node) -> list[Announced]:
    """The member keys among the children of a version directory, oldest first (keys as
    etcd spells them, which is the form :func:`~etcd_rendezvous.layout.normalize_key`
    gives)."""
    found = []
    for child in listing.children:
        name = member_name(child.key)
        if name is not None and not child.is_dir:
            found.append(Announced(child.created_index, name, child.key.rstrip("/")))
    return sorted(found)


# -- the decisions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Write:
    """A state to compare-and-swap in, with its TTL (``None``: none)."""

    state: dict[str, Any]
    ttl: int | None


def _with_ttl(state: dict[str, Any], min_workers: int) -> Write:
    """``state`` with the TTL PyTorch's workers give a state of its status and size."""
    if state["status"] == "final":
        return Write(state, None)
    if state["status"] == "frozen":
        return Write(state, CONST_ETCD_FROZEN_TTL)
    ephemeral = len(state["participants"]) >= min_workers
    return Write(state, CONST_ETCD_JOINABLE_EPHEMERAL_TTL if ephemeral else None)


def plan_admission(
    state: dict[str, Any],
    entries: Sequence[Announced],
    *,
    min_workers: int,
    max_workers: int,
    skip_older_than: int | None = None,
) -> Write | None:
    """Admit every un-admitted key of ``entries`` (a listing, oldest first) into the
    joinable ``state``, up to ``max_workers``; ``None`` if there is none.

    Keys created before ``skip_older_than`` are left out (their workers did not act
    within the grace period). Reaching ``max_workers`` freezes the state
    (:func:`plan_freeze`).

    Raises:
        RendezvousStateError: the state already has ``max_workers`` participants
            (workers disagree about ``max_workers``).
    """
    participants = list(state["participants"])
    members = dict(members_of(state))
    room = max_workers - len(participants)
    if room <= 0:
        raise RendezvousStateError(
            f"The joinable rendezvous state already has {len(participants)} participants, "
            f"the maximum for this worker is {max_workers}: do all workers use the same "
            "max_workers?"
        )
    floor = -1 if skip_older_than is None else skip_older_than
    pending = [e for e in entries if e.name not in members and e.created_index >= floor]
    if not pending:
        return None
    for entry in pending[:room]:
        members[entry.name] = len(participants)
        participants.append(len(participants))
    admitted = {**state, "participants": participants, MEMBERS: members}
    if len(participants) == max_workers:
        return plan_freeze(admitted, entries, min_workers=min_workers)
    return _with_ttl(admitted, min_workers)


def plan_freeze(state: dict[str, Any], entries: Sequence[Announced], *, min_workers: int) -> Write:
    """Freeze the joinable ``state``, with our live members already confirmed."""
    frozen = {**state, "status": "frozen", "keep_alives": []}
    return plan_confirmation(frozen, entries, min_workers=min_workers) or _with_ttl(
        frozen, min_workers
    )


def plan_confirmation(
    state: dict[str, Any],
    entries: Sequence[Announced],
    *,
    min_workers: int,
    skip_below_rank: int | None = None,
) -> Write | None:
    """Add the keys of our admitted members found in ``entries`` (a listing) to the frozen
    ``state``'s ``keep_alives``; final if that completes them. ``None`` if none is missing.

    Members ranked below ``skip_below_rank`` are left out (they did not confirm within
    the grace period).
    """
    members = members_of(state)
    keep_alives = list(state["keep_alives"])
    confirmed = {normalize_key(key) for key in keep_alives}
    floor = -1 if skip_below_rank is None else skip_below_rank
    live = sorted(
        (members[e.name], e.key)
        for e in entries
        if e.name in members and members[e.name] >= floor and e.key not in confirmed
    )
    if not live:
        return None
    keep_alives.extend(key for _, key in live)
    confirming = {**state, "keep_alives": keep_alives}
    if len(keep_alives) >= len(state["participants"]):
        confirming.update(status="final", num_workers_waiting=0)
    return _with_ttl(confirming, min_workers)


# What a worker does next: one small type per decision. An admission step is one of
# Admitted, Leave, Read, Admit, Wait; a confirmation step one of Complete, Leave, Read,
# Confirm, Wait.


@dataclass(frozen=True)
class Admitted:
    """We were admitted, with ``rank``."""

    rank: int


@dataclass(frozen=True)
class Complete:
    """The version is final with us in it, in a world of ``world_size``."""

    world_size: int


@dataclass(frozen=True)
class Leave:
    """The version ended for us (``reason``): start the attempt over."""

    reason: str


@dataclass(frozen=True)
class Read:
    """Read the state: a hint says it changed in a way that concerns us, or we heard
    nothing for a while."""


@dataclass(frozen=True)
class Admit:
    """Our turn: read the state, list the member keys and admit every announced one
    (older ones included, however slow their workers are)."""


@dataclass(frozen=True)
class Confirm:
    """Confirm our live members, leaving out the lower-ranked unconfirmed ones if
    ``without_lower`` (they did not confirm within the grace period)."""

    without_lower: bool = False


@dataclass(frozen=True)
class Wait:
    """Wait for the state to change (or a hint of it), at most ``timeout`` seconds
    (``None``: until it does)."""

    timeout: float | None = None


#: What a worker waiting to be admitted does next (:func:`admission_step`).
AdmissionStep: TypeAlias = Admitted | Leave | Read | Admit | Wait
#: What an admitted worker does next until the version is final (:func:`confirmation_step`).
ConfirmationStep: TypeAlias = Complete | Leave | Read | Confirm | Wait


def _concerns(news: Hint, version: str, status: str | None) -> bool:
    """Whether the state ``news`` describes is worth reading for a worker that saw
    ``version`` in ``status``: it left that status or version (or the version is frozen,
    where every confirmation counts)."""
    return news.version != version or news.status != status or status == "frozen"


def admission_step(
    observed: Observed,
    news: Hint | None,
    decided_upto: int,
    version: str,
    me: Announced,
    quiet_for: float,
    other_writes: Sequence[int] = (),
    *,
    min_workers: int = 1,
    unheard: float = float("inf"),
) -> AdmissionStep:
    """What a worker that announced ``me`` in ``version`` does next, given the state it
    last saw, the hint (``news``) that the state changed since, if any, the newest
    index up to which member keys are known to be decided (0: unknown), the seconds
    nothing changed, the indexes of writes known not to be member keys (the state's,
    the hint's), which do not count in our distance, and the seconds left of the
    silence after which to read the state anyway. The hint only tells when to read the
    state; admission is what the state says (see docs/how-it-works.rst, "Joining in a
    few requests", the progress key)."""
    state = observed.state
    status = observed.status_in(version)
    if state is None or status not in ("joinable", "frozen", "final"):
        return Leave(f"version {version} ended before we were admitted")
    members = members_of(state)
    if me.name in members:
        return Admitted(members[me.name])
    if status != "joinable":
        return Leave(f"version {version} became {status} without us: late")
    if news is not None and _concerns(news, version, status):
        return Read()
    if news is not None and news.decided_upto >= me.created_index:
        if news.count >= min_workers or unheard <= 0:
            return Read()
        return Wait(unheard)  # admitted, as far as the hint says: nothing to do yet
    base = decided_upto or observed.index
    between = {w for w in other_writes if base < w < me.created_index}
    delay = admit_delay(me.created_index - base - len(between), me.name)
    if quiet_for >= delay:
        return Admit()
    return Wait(delay - quiet_for)


def confirmation_step(
    observed: Observed,
    news: Hint | None,
    version: str,
    me: str,
    version_dir: str,
    quiet_for: float,
    unheard: float,
) -> ConfirmationStep:
    """What our admitted member named ``me`` does next until ``version`` is final, given
    the state last seen, the hint (``news``) that it changed since, if any, the seconds
    it has been unchanged and the seconds left of the silence after which to read it
    anyway (``unheard``; 0 or less: read now)."""
    state = observed.state
    status = observed.status_in(version)
    ongoing = status in ("joinable", "frozen", "final")
    if state is None or not ongoing or me not in members_of(state):
        return Leave("Rendezvous state transition no longer possible.")
    if status == "final":
        return Complete(len(state["participants"]))
    if (news is not None and _concerns(news, version, status)) or unheard <= 0:
        return Read()
    if status == "joinable":
        return Wait(unheard)
    confirmed = {normalize_key(key) for key in state["keep_alives"]}
    missing = sorted(
        (rank, name)
        for name, rank in members_of(state).items()
        if normalize_key(f"{version_dir}/{name}") not in confirmed
    )
    names = [name for _, name in missing]
    if me not in names:
        return Wait(unheard)
    position = names.index(me)
    patience = grace(position) - quiet_for
    if position and patience > 0:
        return Wait(min(patience, unheard))
    return Confirm(without_lower=position > 0)


# -- carrying the decisions out --------------------------------------------------------


class KeepAlive(Protocol):
    """What :class:`BatchJoin` needs of the thread that keeps a key alive."""

    def stop(self, timeout: float = ...) -> None: ...


@dataclass(frozen=True)
class _Member:
    """Our member key in one version, and what keeps it alive."""

    version: str
    entry: Announced
    keeper: KeepAlive


class BatchJoin:
    """One worker's side of the batched join (docs/how-it-works.rst, "Joining in a few
    requests").

    Args:
        conn: the etcd connection.
        layout: the run's keys.
        feed: the state feed of the barrier in progress.
        min_workers, max_workers: the rendezvous' bounds.
        keep_alive: starts keeping a key alive (every TTL/2), given the key and the v3
            lease of our write of it (0 on v2); returns the keeper.
        timeout_error: the error to raise when the rendezvous deadline passes.
    """

    def __init__(
        self,
        conn: Transport,
        layout: LegacyLayout,
        feed: StateFeed,
        *,
        min_workers: int,
        max_workers: int,
        keep_alive: Callable[[str, int], KeepAlive],
        timeout_error: Callable[[], Exception],
    ) -> None:
        self._conn = conn
        self._layout = layout
        self._feed = feed
        self._min = min_workers
        self._max = max_workers
        self._keep_alive = keep_alive
        self._timeout_error = timeout_error
        self._deadline = Deadline.never()
        self._member: _Member | None = None
        #: The newest index up to which member keys were decided by our own writes.
        self._decided = 0

    @property
    def member_key(self) -> str | None:
        """Our member key in the version being joined (or joined), if any."""
        return None if self._member is None else self._member.entry.key

    def begin(self, deadline: Deadline) -> None:
        """Start a barrier ending at ``deadline``. The member key of the previous one is
        left to lapse (its keeper was stopped)."""
        self._deadline = deadline
        self._member = None
        self._decided = 0

    def opening_state(self, version: str) -> Write:
        """Announce ourselves in the new ``version`` we are creating: its first joinable
        state, with us admitted."""
        me = self._announce(version)
        self._decided = me.created_index
        opening = {"status": "joinable", "version": version, "participants": []}
        write = plan_admission(opening, [me], min_workers=self._min, max_workers=self._max)
        if write is None:  # pragma: no cover (an empty state has room for us)
            raise RendezvousStateError(f"Could not admit ourselves into version {version}.")
        return write

    def admit(self, version: str) -> int:
        """Announce ourselves in the joinable ``version`` (once) and wait until we are
        admitted, admitting others when it is our turn. Returns our rank.

        Raises:
            RestartAttempt: the version ended, or froze without us (our key is deleted).
        """
        observed = self._feed.current()
        members = members_of(observed.state or {}) if observed.status_in(version) else {}
        mine = self._member
        if mine is not None and mine.version == version and mine.entry.name in members:
            return members[mine.entry.name]  # we created the version
        # Hints from before our announce on: none that decides our key is missed.
        self._feed.follow_hints(self._layout.progress_key(version))
        self._announce(version)
        since = time.monotonic()
        while True:
            observed = self._feed.current()
            match self._admission_step(version, observed, since):
                case Admitted(rank):
                    return rank
                case Leave(reason):
                    self.discard()
                    raise RestartAttempt(reason)
                case Read():
                    self._read(version)
                case Admit():
                    self._batch(version, observed)
                case Wait(timeout):
                    self._wait(timeout)

    def _admission_step(self, version: str, observed: Observed, since: float) -> AdmissionStep:
        """:func:`admission_step` on what the feed knows now (waiting since ``since``)."""
        feed = self._feed
        return admission_step(
            observed,
            feed.news,
            self._decided_upto(),
            version,
            self._require_member(version).entry,
            self._quiet(since),
            (observed.index, feed.hint_written_at),
            min_workers=self._min,
            unheard=feed.silence - feed.silent_for,
        )

    def confirm(self, version: str, rank: int) -> int:
        """Wait until ``version`` is final, confirming our members if it was frozen
        without them. Returns the world size.

        Raises:
            RestartAttempt: the version ended.
        """
        me = self._require_member(version).entry
        version_dir = self._layout.version_dir(version)
        self._feed.follow_hints(self._layout.progress_key(version))
        since = time.monotonic()
        while True:
            observed = self._feed.current()
            feed = self._feed
            unheard = feed.silence - feed.silent_for
            quiet = self._quiet(since)
            match confirmation_step(
                observed, feed.news, version, me.name, version_dir, quiet, unheard
            ):
                case Complete(world_size):
                    return world_size
                case Leave(reason):
                    raise RestartAttempt(f"{reason} Must re-enter.")
                case Read():
                    self._read(version)
                case Confirm(without_lower):
                    self._confirm(version, me, rank if without_lower else None)
                case Wait(timeout):
                    self._wait(timeout)

    def _confirm(self, version: str, me: Announced, skip_below_rank: int | None) -> None:
        """Our turn to confirm the members of the frozen ``version`` (see
        :func:`plan_confirmation`), on the state read now (unless it is no longer
        frozen: decide again).

        Raises:
            RestartAttempt: our member key ``me`` is gone.
        """
        observed = self._read(version, relay=False)
        if observed.status_in(version) != "frozen" or observed.state is None:
            return
        listed_at, entries = self._list(version)
        write = plan_confirmation(
            observed.state, entries, min_workers=self._min, skip_below_rank=skip_below_rank
        )
        if write is None:
            raise RestartAttempt(f"Our member key {me.key} is gone; must re-enter.")
        self._swap(version, observed, write, listed_at)

    def freeze(self, version: str) -> bool:
        """Freeze the joinable ``version`` at the end of the last call, our live members
        confirmed. Returns whether our write won (if not, the state changed: decide again)."""
        observed = self._feed.current()
        if observed.status_in(version) != "joinable" or observed.state is None:
            return False
        listed_at, entries = self._list(version)
        write = plan_freeze(observed.state, entries, min_workers=self._min)
        return self._swap(version, observed, write, listed_at)

    def publish(self, version: str, node: Node, state: dict[str, Any]) -> None:
        """Write the ``progress`` hint of ``version`` for our write ``node`` of ``state``
        (one we made outside the batches: the opening state, a TTL refresh)."""
        self._hint(version, describe(state, node.modified_index, self._decided_upto()))

    def discard(self) -> None:
        """Stop keeping our member key alive and delete it (a failure is only logged).

        Past the rendezvous deadline the key is left to lapse (within its TTL) instead:
        the caller is due to return.
        """
        member, self._member = self._member, None
        if member is None:
            return
        member.keeper.stop()
        if self._deadline.expired():
            return
        try:
            self._conn.delete(member.entry.key)
        except RendezvousError as exc:
            logger.info("Could not delete our member key %s (it lapses): %s", member.entry.key, exc)

    # -- the requests ------------------------------------------------------------------

    def _announce(self, version: str) -> Announced:
        """Write our member key in ``version`` unless we did; keep it alive from now on."""
        if self._member is not None:
            if self._member.version == version:
                return self._member.entry
            self.discard()
        self._decided = 0
        key = self._layout.member_key(version, new_member_name(secrets.randbits(64)))
        # The value says who we are, for operators (``etcd-rendezvous status -v``); no
        # worker reads it.
        who = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        node = self._conn.set(key, who, ttl=CONST_WORKER_KEEPALIVE_TTL)
        entry = Announced(node.created_index, key.rsplit("/", 1)[1], normalize_key(key))
        self._member = _Member(version, entry, self._keep_alive(key, node.lease))
        logger.info("Announced ourselves in rendezvous version %s as %s", version, key)
        return entry

    def _require_member(self, version: str) -> _Member:
        if self._member is None or self._member.version != version:
            raise RestartAttempt(f"We hold no member key in version {version}.")
        return self._member

    def _list(self, version: str) -> tuple[int, list[Announced]]:
        """The member keys of ``version`` and the store index at which they were listed
        (every key created at or before it is among them)."""
        listing = self._conn.list_dir(self._layout.version_dir(version))
        entries = announced(listing)
        member = self._require_member(version)
        listed = [e for e in entries if e.name == member.entry.name]
        if not listed:
            self.discard()
            raise RestartAttempt(f"Our member key {member.entry.key} is gone; must re-enter.")
        # The listing has the key's creation index for sure (the answer to our write may
        # have been to a second copy of it, sent after a connection failure).
        self._member = dataclasses.replace(member, entry=listed[0])
        listed_at = max([listing.etcd_index, *(e.created_index for e in entries)])
        return listed_at, entries

    def _decided_upto(self) -> int:
        """The newest index up to which member keys are known decided (0: unknown)."""
        hint = self._feed.hint
        return max(self._decided, hint.decided_upto if hint is not None else 0)

    def _read(self, version: str, *, relay: bool = True) -> Observed:
        """Read the state; if it is newer than the hint says (a write by PyTorch's
        workers, or by one of ours that died before its hint), pass the word on, unless
        not to ``relay`` (a candidate's read, which may come between a write and its
        hint: the others hear of the write from its writer, or read after a silence)."""
        observed = self._feed.refresh()
        hint = self._feed.hint
        if (
            relay
            and observed.state is not None
            and observed.status_in(version) is not None
            and (hint is None or hint.index < observed.index)
        ):
            self._hint(version, describe(observed.state, observed.index, self._decided_upto()))
        return observed

    def _batch(self, version: str, seen: Observed) -> None:
        """Our turn to admit: read the state (unless it changed meanwhile, as a hint
        might not have said), list the member keys, admit every announced one."""
        observed = self._read(version, relay=False)
        if observed.index != seen.index or observed.status_in(version) != "joinable":
            return  # decide again on what we read
        if observed.state is None:  # pragma: no cover (checked by status_in)
            return
        listed_at, entries = self._list(version)
        write = plan_admission(
            observed.state, entries, min_workers=self._min, max_workers=self._max
        )
        self._swap(version, observed, write, listed_at)

    def _swap(self, version: str, observed: Observed, write: Write | None, listed_at: int) -> bool:
        """Compare-and-swap ``write`` (made from a listing at ``listed_at``) in place of
        ``observed``, then write the hint. Returns whether ours won (if not, the caller
        decides again: the next hint, or read, tells what came first)."""
        if write is None or observed.node is None:
            self._wait(self._feed.silence)
            return False
        # A tag (which PyTorch's workers ignore and carry along) makes the swap ours
        # alone: a retry that finds another admitter's identical state is not misled.
        state = {**write.state, "tag": secrets.token_hex(8)}
        try:
            node = self._conn.compare_and_swap(
                self._layout.state_key, json.dumps(state), observed.node, ttl=write.ttl
            )
        except (CompareFailedError, KeyNotFoundError):
            logger.debug("Rendezvous state CAS unsuccessful; deciding again")
            self._wait(ADMIT_GATHER)
            return False
        self._decided = max(self._decided, listed_at)
        self._feed.note(node)
        self._hint(version, describe(write.state, node.modified_index, self._decided))
        return True

    def _hint(self, version: str, hint: Hint) -> None:
        """Write ``hint`` in ``version``'s ``progress`` key, unless it holds a hint of a
        newer state already (a failure is only logged: the others then read the state
        after a silence).

        Two writers may hint at once, the older state's last: the key is advanced
        (:meth:`~etcd_rendezvous._transport.interface.Transport.advance`), so it never
        goes back to an older state. A stored hint of an index etcd has not reached yet
        is a lie, and is replaced."""

        def holds_newer(stored: Node) -> bool:
            known = Hint.decode(stored.value)
            return (
                known is not None
                and (known.index, known.decided_upto) >= (hint.index, hint.decided_upto)
                and known.index <= stored.etcd_index
            )

        key = self._layout.progress_key(version)
        try:
            self._conn.advance(key, hint.encode(), holds_newer=holds_newer)
        except RendezvousError as exc:
            logger.info("Could not write the progress hint of version %s: %s", version, exc)

    def _quiet(self, since: float) -> float:
        """Seconds the state has been unchanged while we waited (since ``since``)."""
        return min(self._feed.quiet_for, time.monotonic() - since)

    def _wait(self, timeout: float | None = None) -> bool:
        """Wait for a change of the state, at most ``timeout`` seconds and never past the
        rendezvous deadline."""
        remaining = self._deadline.remaining()
        changed = self._feed.wait(remaining if timeout is None else min(timeout, remaining))
        if self._deadline.expired():
            raise self._timeout_error()
        return changed
