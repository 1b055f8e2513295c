"""The legacy ``etcd`` backend's rendezvous state: its fields, TTLs and validation.

The state is the JSON object PyTorch's workers keep in ``rdzv/active_version``
(:attr:`~etcd_rendezvous.layout.LegacyLayout.state_key`), with the fields our workers
add, ``members`` and ``waiting`` (docs/how-it-works.rst, "Joining in a few requests" and
"Waiting in a few requests"). Every worker checks every state it reads, so that a
corrupt key is reported, naming it, instead of derailing the state machine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .._transport.interface import Node, Transport
from .._transport.limits import Refusal
from ..api import Deadline, RendezvousStateError
from ..layout import normalize_key
from ..metrics import record_metric

__all__ = [
    "CONST_ETCD_FROZEN_TTL",
    "CONST_ETCD_JOINABLE_EPHEMERAL_TTL",
    "CONST_ETCD_SETUP_TTL",
    "CONST_WORKER_KEEPALIVE_TTL",
    "LOGGER_NAME",
    "MEMBERS",
    "WAITING",
    "Hint",
    "confirmed_keys",
    "describe",
    "member_ranks",
    "members_of",
    "parse_state",
    "preview",
    "read_state",
    "status_in",
    "supersedes",
    "waiters_of",
]

#: The logger of the legacy backend, whichever of its modules logs: the public module's,
#: whose log users turn on.
LOGGER_NAME = "etcd_rendezvous.etcd_rendezvous"

# TTLs, in seconds, of the state in each status and of a member's keep-alive key. They
# are part of the protocol: PyTorch's workers use the same ones.
CONST_ETCD_SETUP_TTL = 5
CONST_ETCD_FROZEN_TTL = 10
CONST_ETCD_JOINABLE_EPHEMERAL_TTL = 10
CONST_WORKER_KEEPALIVE_TTL = 10

#: The state field mapping the names of our admitted member keys to their ranks
#: (see :mod:`etcd_rendezvous._legacy.admission`).
MEMBERS = "members"
#: The state field listing the names of the wait keys counted in ``num_workers_waiting``
#: (see :mod:`etcd_rendezvous._legacy.waiting`).
WAITING = "waiting"

_STATUSES = frozenset({"setup", "joinable", "frozen", "final", "closed"})
#: The hint's field reporting a refused write (see :class:`Hint`).
_REFUSED = "refused"


def preview(value: str | None, limit: int = 200) -> str:
    """``value`` for an error message: quoted, cut after ``limit`` characters."""
    if value is None:
        return "<no value>"
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _state_problem(state: Any) -> str | None:
    """Describe what is wrong with a decoded state, or return ``None`` if it is valid."""
    if not isinstance(state, dict):
        return "it is not a JSON object"
    status = state.get("status")
    if status not in _STATUSES:
        return f"unknown status {status!r} (expected one of {sorted(_STATUSES)})"
    if status in ("setup", "closed"):
        return None
    if not isinstance(state.get("version"), str):
        return f"'version' must be a string in a {status!r} state"
    # type() is rather than isinstance(): bool is an int, and each worker validates
    # every state it sees, of hundreds of entries at scale.
    participants = state.get("participants")
    if not isinstance(participants, list) or not all(type(p) is int for p in participants):
        return "'participants' must be a list of integers"
    if status in ("frozen", "final"):
        keep_alives = state.get("keep_alives")
        if not isinstance(keep_alives, list) or not all(type(k) is str for k in keep_alives):
            return "'keep_alives' must be a list of strings"
    if status == "final":
        waiting = state.get("num_workers_waiting")
        if not isinstance(waiting, int) or isinstance(waiting, bool) or waiting < 0:
            return "'num_workers_waiting' must be a non-negative integer"
    members = state.get(MEMBERS, {})
    if not isinstance(members, dict) or not all(type(r) is int for r in members.values()):
        # (JSON object keys are always strings.)
        return f"'{MEMBERS}' must map member key names to ranks"
    waiting = state.get(WAITING, [])
    if not isinstance(waiting, list) or not all(type(name) is str for name in waiting):
        return f"'{WAITING}' must be a list of wait key names"
    return None


def read_state(conn: Transport, key: str, deadline: Deadline) -> Node:
    """Read the state key ``key`` by ``deadline`` (one request, counted as
    ``rendezvous.state_reads``).

    Raises:
        KeyNotFoundError: there is no state (``etcd_index`` tells when).
    """
    record_metric("rendezvous.state_reads", backend="etcd")
    return conn.get(key, deadline=deadline)


def parse_state(node: Node) -> dict[str, Any]:
    """Decode and validate the rendezvous state stored in ``node``.

    ``node`` is the state key, ``<prefix>/run_<run_id>/rdzv/active_version``
    (:attr:`~etcd_rendezvous.layout.LegacyLayout.state_key`), as read from etcd. The
    result is the JSON object PyTorch's workers write: ``status`` and, from
    ``joinable`` on, ``version`` and ``participants`` (then ``keep_alives`` and
    ``num_workers_waiting``), each checked for its type, and the fields our workers
    add: ``members`` (member key name -> rank; see
    :mod:`etcd_rendezvous._legacy.admission`), ``waiting`` (the wait keys counted in
    ``num_workers_waiting``; see :mod:`etcd_rendezvous._legacy.waiting`) and ``tag``
    (random hex digits making a write its writer's own, in the ``setup`` state, in
    each admission and count, and after
    :meth:`~etcd_rendezvous.etcd_rendezvous.EtcdRendezvous.announce_self_waiting`;
    not checked). See docs/how-it-works.rst, "Waiting in a few requests".

    Raises:
        RendezvousStateError: the value is not a valid state. The key is not modified.
    """
    record_metric("rendezvous.state_decodes", backend="etcd")
    try:
        state = json.loads(node.value) if node.value is not None else None
    except ValueError as exc:
        problem: str | None = f"it is not valid JSON ({exc})"
    else:
        problem = _state_problem(state)
    if problem is not None:
        raise RendezvousStateError(
            f"The rendezvous state in etcd key {node.key!r} is invalid: {problem}. "
            f"Stored value: {preview(node.value)}. The key was left untouched; inspect "
            "it, then delete it to let the workers start a new rendezvous version."
        )
    assert isinstance(state, dict)  # checked by _state_problem
    return state


def member_ranks(state: dict[str, Any]) -> dict[str, int]:
    """The ranks our workers were admitted with, by member key name (``node_<hex>``):
    the ``members`` field of a state :func:`parse_state` returned (empty in a state only
    PyTorch's workers wrote)."""
    return dict(members_of(state))


def status_in(state: dict[str, Any] | None, version: str) -> str | None:
    """The status of ``state``, if it is a state of ``version``; ``None`` otherwise."""
    if state is None or state.get("version") != version:
        return None
    return str(state["status"])


def confirmed_keys(state: dict[str, Any]) -> set[str]:
    """The keep-alive keys of ``state`` (its confirmed members), as etcd spells them."""
    return {normalize_key(key) for key in state.get("keep_alives", [])}


def members_of(state: dict[str, Any]) -> dict[str, int]:
    """The state's ``members`` (name -> rank); empty in a state PyTorch's workers made."""
    members: dict[str, int] = state.get(MEMBERS) or {}
    return members


def waiters_of(state: dict[str, Any]) -> set[str]:
    """The wait keys (names) already counted in ``state``."""
    return set(state.get(WAITING) or ())


def torch_waiting(state: dict[str, Any]) -> int:
    """How many of the workers counted in ``state``'s ``num_workers_waiting`` are
    PyTorch's: each of them adds 1, where ours are counted by their wait keys' names
    (:func:`waiters_of`)."""
    try:
        counted = int(state.get("num_workers_waiting") or 0)
    except (TypeError, ValueError):
        return 0
    return max(0, counted - len(waiters_of(state)))


@dataclass(frozen=True)
class Hint:
    """The version's ``progress`` key (:meth:`~etcd_rendezvous.layout.LegacyLayout.progress_key`):
    what one of our workers wrote about a state write, right after making it. A hint
    only: it tells a waiting worker whether reading the state is worth it, never what
    the state holds (PyTorch's workers neither read nor write it, so it can be stale).
    """

    #: The modification index of the state write it describes.
    index: int
    #: That state's status and version.
    status: str
    version: str | None
    #: Every member key created at or before this index was decided by that write (or
    #: an earlier one): admitted, or left out of a full rendezvous.
    decided_upto: int
    #: The state's participants and ``num_workers_waiting``.
    count: int
    waiting: int
    #: A write of ours that etcd refused for its size, made on the state of ``index``
    #: (``None``: none; see :func:`~etcd_rendezvous._legacy.admission.refusal_verdict`).
    refused: Refusal | None = None

    @property
    def newness(self) -> tuple[int, int, int]:
        """What orders two hints: the state's index, then a report of a refused write on
        that state (which comes after its hints; of two, the one with the later
        listing), then the decided index."""
        reported = -1 if self.refused is None else self.refused.upto
        return self.index, reported, self.decided_upto

    def encode(self) -> str:
        """The key's value (JSON, a few dozen bytes; a report adds a few hundred)."""
        fields: dict[str, Any] = {
            "index": self.index,
            "status": self.status,
            "version": self.version,
            "decided_upto": self.decided_upto,
            "count": self.count,
            "waiting": self.waiting,
        }
        if self.refused is not None:
            fields[_REFUSED] = self.refused.encode()
        return json.dumps(fields)

    @classmethod
    def decode(cls, value: str | None) -> Hint | None:
        """The hint in ``value``; ``None`` if it is not one (garbage is ignored: the
        workers then read the state, which is the authority). A report of a refused write
        that cannot be read is left out."""
        try:
            data = json.loads(value or "")
            hint = cls(
                index=data["index"],
                status=data["status"],
                version=data["version"],
                decided_upto=data["decided_upto"],
                count=data["count"],
                waiting=data["waiting"],
            )
        except (ValueError, TypeError, KeyError):
            return None
        ints = (hint.index, hint.decided_upto, hint.count, hint.waiting)
        if not all(type(n) is int for n in ints) or type(hint.status) is not str:
            return None
        if hint.version is not None and type(hint.version) is not str:
            return None
        refused = Refusal.decode(data.get(_REFUSED))
        return hint if refused is None else dataclasses.replace(hint, refused=refused)


def supersedes(stored: Node, hint: Hint) -> bool:
    """Whether the hint key ``stored`` holds a hint at least as new as ``hint`` (a stored
    hint of an index etcd has not reached yet is a lie: never)."""
    known = Hint.decode(stored.value)
    return known is not None and known.newness >= hint.newness and known.index <= stored.etcd_index


def describe(state: dict[str, Any], index: int, decided_upto: int) -> Hint:
    """The hint describing ``state``, written at ``index``, whose writer had decided every
    member key created at or before ``decided_upto``."""
    return Hint(
        index=index,
        status=str(state.get("status")),
        version=state.get("version"),
        decided_upto=decided_upto,
        count=len(state.get("participants", ())),
        waiting=int(state.get("num_workers_waiting", 0)),
    )
