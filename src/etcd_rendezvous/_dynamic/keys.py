"""What this package's ``etcd-v2`` backend keeps besides PyTorch's state key, as the
node-key protocol sees it: the interface (:class:`KeyedBackend`) and the values it
hands over (:class:`AnnouncedNode`, the progress key's :class:`Progress`).

A backend with this interface gets batched admission, aggregated heartbeats and the
progress key (:mod:`etcd_rendezvous._dynamic.admission`); any other (PyTorch's, a
user's) keeps PyTorch's protocol. Every call takes the deadline of the operation that
makes it: etcd failures (an election, an unreachable member) are retried until then,
never longer. See docs/how-it-works.rst, "Our nodes: node keys, batched admission, one
heartbeat writer".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .._transport.interface import Transport
from .._transport.limits import Refusal
from .._transport.retry import Deadline
from .backend import Token
from .state import NodeDesc, RendezvousState

__all__ = ["AnnouncedNode", "KeyedBackend", "Progress"]

#: The fields of the progress key's JSON value, in the order of :class:`Progress`.
_FIELDS = ("token", "round", "complete", "closed", "decided_upto", "participants", "waiting")
#: The field of the writer's heartbeat lifetime, which older writers leave out (and older
#: readers ignore): the operator commands' measure of how long a node may stay silent.
_LIFETIME = "lifetime"
#: The field of a report of a refused write (see :class:`Progress`).
_REFUSED = "refused"


@dataclass(frozen=True)
class AnnouncedNode:
    """A node key as listed: the node, the etcd index at which its key was created, and
    the complete round the node asked to leave, if its key says so (see
    :meth:`KeyedBackend.mark_leaving`)."""

    node: NodeDesc
    created_index: int
    leaving: int | None = None


@dataclass(frozen=True)
class Progress:
    """What the progress key says: a summary of one state write (a hint; the state is
    the authority). See "The progress key" in docs/how-it-works.rst."""

    #: The token (etcd index) of the state write it describes (0: none yet).
    token: int
    round: int
    complete: bool
    closed: bool
    #: Every node key created at or before this etcd index was decided by a batch.
    decided_upto: int
    #: How many participants, and how many nodes on the wait list.
    participants: int
    waiting: int
    #: The writer's heartbeat lifetime (``keep_alive_interval`` times ``keep_alive_max_attempt``,
    #: in whole seconds; 0: not said, by an older writer): how long its nodes may stay
    #: silent before they count as dead, which ``etcd-rendezvous`` reads to tell a run
    #: whose nodes are gone. It says nothing of the state: summaries are compared
    #: without it.
    lifetime: int = field(default=0, compare=False)
    #: A batch's write that etcd refused for its size, made on the state of ``token``
    #: (``None``: none; see the module's docs).
    refused: Refusal | None = None

    @classmethod
    def of(
        cls, token: int, state: RendezvousState, decided_upto: int, lifetime: int = 0
    ) -> Progress:
        """The summary of ``state``, written with ``token`` by a node whose heartbeat
        lifetime is ``lifetime`` seconds."""
        return cls(
            token,
            state.round,
            state.complete,
            state.closed,
            decided_upto,
            len(state.participants),
            len(state.wait_list),
            lifetime,
        )

    def encode(self) -> str:
        """The progress key's value: the summary as a small JSON object."""
        fields: dict[str, object] = {name: getattr(self, name) for name in _FIELDS}
        if self.lifetime:
            fields[_LIFETIME] = self.lifetime
        if self.refused is not None:
            fields[_REFUSED] = self.refused.encode()
        return json.dumps(fields)

    @property
    def newness(self) -> tuple[int, int, int]:
        """What orders two summaries: the token; then, of the same state, the decided
        index (a relay of a batch's state, written before the batch's own summary, knows
        less); then a report of a refused write on that state (which comes after its
        summary; of two, the one with the later listing)."""
        return self.token, self.decided_upto, -1 if self.refused is None else self.refused.upto

    @classmethod
    def decode(cls, value: str | None) -> Progress | None:
        """The summary a progress key's value holds; ``None`` for anything else (a
        summary that cannot be read is as good as none: the reader falls back on the
        state). A lifetime that is missing (an older writer) or not a positive whole
        number reads as 0; a report of a refused write that cannot be read is left out."""
        try:
            fields = json.loads(value or "")
        except ValueError:
            return None
        if not isinstance(fields, dict):
            return None
        values = [fields.get(name) for name in _FIELDS]
        flags = (values[2], values[3])
        counts = values[:2] + values[4:]
        if any(type(v) is not bool for v in flags) or any(type(v) is not int for v in counts):
            return None
        progress = cls(*values)  # type: ignore[arg-type]
        lifetime = fields.get(_LIFETIME)
        if type(lifetime) is int and lifetime > 0:
            progress = dataclasses.replace(progress, lifetime=lifetime)
        refused = Refusal.decode(fields.get(_REFUSED))
        return progress if refused is None else dataclasses.replace(progress, refused=refused)


@runtime_checkable
class KeyedBackend(Protocol):
    """What this package's backend adds to PyTorch's
    :class:`~etcd_rendezvous._dynamic.backend.RendezvousBackend`: calls that take the
    caller's deadline (PyTorch's callers never pass one), the connection whose clock
    dates the state's times, the run's node keys and aggregator lock, and its progress
    key.

    Every call may raise :class:`~etcd_rendezvous.api.RendezvousConnectionError` (etcd
    out of reach until ``deadline``).
    """

    # -- the state (PyTorch's key), within a deadline -------------------------------------

    def get_state(self, *, deadline: Deadline | None = None) -> tuple[bytes, Token] | None:
        """PyTorch's ``get_state()``, retried until ``deadline``."""

    def set_state(
        self, state: bytes, token: Token | None = None, *, deadline: Deadline | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """PyTorch's ``set_state()``, retried until ``deadline``."""

    def wait_for_change(
        self, token: Token | None, timeout: float, *, deadline: Deadline | None = None
    ) -> tuple[bytes, Token] | None:
        """:meth:`RendezvousBackend.wait_for_change`, its requests retried until ``deadline``."""

    @property
    def connection(self) -> Transport:
        """The connection the backend sends its requests through (its clock is etcd's)."""

    # -- node keys ------------------------------------------------------------------------

    def announce_node(self, node: NodeDesc, ttl: int, deadline: Deadline) -> int:
        """Create the key of ``node`` (or find it made by an earlier attempt of ours);
        return the index at which it was created."""

    def refresh_node(self, node: NodeDesc, ttl: int, deadline: Deadline) -> bool:
        """Restart the TTL of the key of ``node``; ``False`` if the key is gone."""

    def withdraw_node(self, node: NodeDesc, deadline: Deadline) -> None:
        """Delete the key of ``node`` (nothing if it is gone)."""

    def mark_leaving(self, node: NodeDesc, round_: int, ttl: int, deadline: Deadline) -> None:
        """Write the key of ``node`` saying that the node leaves the complete round
        ``round_`` (create it, with ``ttl``, if it is gone); listings report it."""

    def list_nodes(self, deadline: Deadline) -> list[AnnouncedNode]:
        """Every node key of the run, oldest first."""

    @property
    def listed_at(self) -> int:
        """The etcd index at which the last :meth:`list_nodes` was served."""

    @property
    def absent_at(self) -> int | None:
        """The etcd index at which the last read of the state found none (``None``:
        the last read found one, or none was made)."""

    def expires_in(self, node: NodeDesc, deadline: Deadline) -> int | None:
        """Whole seconds until the key of ``node`` expires, as far as the last listing
        tells (on v3: one request for its lease); ``0`` or ``None`` if its time is up
        (or it is gone)."""

    def remove_expired(self, node: NodeDesc, deadline: Deadline) -> bool:
        """Delete the key of ``node`` if it is still the one the last listing showed;
        whether the key is gone now (``False``: it was written since, its node lives)."""

    # -- the aggregator lock --------------------------------------------------------------

    def aggregator(self, deadline: Deadline) -> NodeDesc | None:
        """The holder of the aggregator lock, or ``None`` if nobody holds it."""

    def claim_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline) -> bool:
        """Create the aggregator lock for ``node`` if nobody holds it; whether it did."""

    def renew_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline) -> bool:
        """Restart the TTL of the lock if ``node`` holds it; ``False`` if gone or another's."""

    def release_aggregator(self, node: NodeDesc, deadline: Deadline) -> None:
        """Delete the aggregator lock if ``node`` holds it."""

    # -- the progress key -----------------------------------------------------------------

    def read_progress(self, deadline: Deadline) -> tuple[Progress | None, int | None, int]:
        """The progress key's summary (``None`` if absent or not a summary), its
        modification index (``None`` if absent), and the etcd index of the read, from
        which to wait for its next change."""

    def create_progress(self, progress: Progress, deadline: Deadline) -> int | None:
        """Create the progress key with ``progress`` (with the state's TTL); the write's
        modification index, or ``None`` if the key exists."""

    def write_progress(self, progress: Progress, index: int, deadline: Deadline) -> int | None:
        """Write ``progress`` into the progress key unless it holds a summary of a newer
        state (compare-and-swap on its modification index ``index``, ``0`` if absent,
        read again after a lost race); the write's modification index, or ``None`` if
        the key holds a summary at least as new."""

    def replace_progress(self, progress: Progress, index: int, deadline: Deadline) -> int | None:
        """Write ``progress`` only if the key was not written since its modification
        index ``index`` (create it if it is gone); the write's modification index, or
        ``None`` if it did not write."""

    def wait_progress(
        self, after: int, timeout: float, deadline: Deadline
    ) -> list[tuple[Progress | None, int]]:
        """The changes of the progress key after the etcd index ``after``, waiting up to
        ``timeout`` seconds for the first: each summary (``None``: deleted, or not a
        summary) with its modification index. Empty if none came."""

    def stop_waiting(self) -> None:
        """Close the watches of the state and of the progress key (reopened on demand)."""

    def check_size(self, size: int, deadline: Deadline) -> None:
        """Ask etcd whether it accepts a write of ``size`` bytes among the run's keys
        (nothing is written); raise its
        :class:`~etcd_rendezvous.api.RequestTooLargeError` if not."""
