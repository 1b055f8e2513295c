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
observed; :class:`~etcd_rendezvous._legacy.join.BatchJoin` carries them out.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from .._transport.interface import (
    Node,
)
from .._transport.limits import Verdict
from ..api import RendezvousStateError
from ..layout import member_name, normalize_key
from .feed import Observed
from .state import (
    CONST_ETCD_FROZEN_TTL,
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
    MEMBERS,
    Hint,
    confirmed_keys,
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
    "Complete",
    "Confirm",
    "ConfirmationStep",
    "Leave",
    "Read",
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
    "refusal_verdict",
]


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
    confirmed = confirmed_keys(state)
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
    """Read the state: a hint says it changed in a way that concerns us, or (``silence``)
    we heard nothing that called for it for a while."""

    silence: bool = False


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
        if news.count >= min_workers:
            return Read()
        if unheard <= 0:
            return Read(silence=True)
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
    if news is not None and _concerns(news, version, status):
        return Read()
    if unheard <= 0:
        return Read(silence=True)
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


def refusal_verdict(
    report: Hint,
    written_at: int,
    observed: Observed,
    version: str,
    me: Announced,
    *,
    min_workers: int,
) -> Verdict:
    """What our worker that announced ``me`` in ``version`` does about ``report``, a hint
    reporting a write of the state that etcd refused for its size, written in the hint
    key at ``written_at``, given the state it last saw.

    The report concerns the workers of its version when the version cannot complete: the
    refused write would have frozen it (its participants are then fixed: every later
    try is as large), or it is joinable and needs at least ``min_workers`` participants,
    no fewer than the refused write had; and the workers whose member keys were in the
    refused write (created at or before its listing) and are still undecided. A report
    about a state older than the one seen, which has moved on to another status since,
    is stale. A worker that announced itself after the report was written checks
    etcd's limit first (:attr:`Verdict.VERIFY`). The report's own hint stands for a state
    the worker has not read yet.
    """
    refusal = report.refused
    if refusal is None or report.version != version:
        return Verdict.IGNORE
    if report.index >= observed.index:
        decided = me.created_index <= report.decided_upto
    elif observed.status_in(version) != report.status:
        return Verdict.IGNORE  # the version moved on since
    else:
        decided = me.name in members_of(observed.state or {})
    joinable = report.status == "joinable"
    stuck = refusal.completing or (joinable and min_workers >= refusal.count)
    if not stuck and (decided or me.created_index > refusal.upto):
        return Verdict.IGNORE
    return Verdict.FAIL if me.created_index < written_at else Verdict.VERIFY
