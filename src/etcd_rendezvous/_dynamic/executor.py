"""The executor of the dynamic rendezvous: it carries out the actions the operations of
:mod:`etcd_rendezvous._dynamic.ops` decide, on the state shared by all nodes.

:class:`_DistributedRendezvousOpExecutor` syncs the state, asks the operation for the
next action, applies it and writes the state back, until the operation finishes. Between
steps it waits for the other nodes (or for its next deadline); with node keys (see
:mod:`etcd_rendezvous._dynamic.admission`) it admits the announced nodes in batches and
folds their heartbeats into the state. The protocol: see docs/how-it-works.rst, section
"The dynamic rendezvous".
"""

from __future__ import annotations

import enum
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import datetime, timedelta

from .._transport.retry import CONTENTION, Deadline, Retry
from ..api import RendezvousClosedError, RendezvousTimeoutError, RequestTooLargeError
from ..events import NodeState
from .admission import Batch, NodeKeys, Refresh, Wait
from .backend import POLL_INTERVAL
from .holder import _remove_participant_epilogue, _RendezvousStateHolder
from .ops import (
    _ADMISSIONS,
    _Action,
    _admission_action,
    _RendezvousCloseOp,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _RendezvousKeepAliveOp,
    _StateHandler,
)
from .progress import Heard
from .settings import (
    EXECUTOR_EVENTS,
    LOGGER_NAME,
    RendezvousSettings,
    event_source,
    record_node_event,
)
from .state import _NodeDesc, _RendezvousState

__all__ = ["_DistributedRendezvousOpExecutor", "_RendezvousOpExecutor"]

logger = logging.getLogger(LOGGER_NAME)

#: Margin added to a wake-up time so that a strict comparison (``deadline < now``) holds
#: when the node wakes up, instead of waking it a few microseconds too early.
_WAKE_UP_MARGIN = 0.01


class _Synced(enum.Enum):
    """What a sync did: :meth:`_RendezvousStateHolder.sync`'s ``bool | None``, named."""

    READ = None
    """The node read the state (or kept the one it had): it had nothing to write."""
    WRITTEN = True
    """The node's changes were written."""
    LOST_RACE = False
    """Another node wrote first: the node now holds the newer state, without its changes."""


class _RendezvousOpExecutor(ABC):
    """Execute rendezvous operations."""

    @abstractmethod
    def run(
        self,
        state_handler: _StateHandler,
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """Execute a rendezvous operation.

        An operation is run inside a state machine and is expected to transition the
        rendezvous from one state to another.

        Args:
            state_handler: A callable that returns the next state transition action
                based on the current state of the rendezvous.
            deadline: The time, in seconds (``time.monotonic()``), at which the
                operation will be considered timed-out.
            update_deadline: Function to generate a new operation deadline if the
                current node may participate in the next rendezvous.
        """


class _DistributedRendezvousOpExecutor(_RendezvousOpExecutor):
    """Execute rendezvous operations using a shared state.

    With ``node_keys`` (a backend with node keys, see
    :mod:`etcd_rendezvous._dynamic.admission`), the node does not add itself to the
    state: it announces itself and is admitted in a batch, by itself or by another node;
    and its heartbeat refreshes its key, folded into the state by the aggregator.

    Args:
        node: The node descriptor associated with the current rendezvous handler
            instance.
        state_holder: The ``RendezvousStateHolder`` to use to sync the rendezvous state
            with other nodes.
        settings: The rendezvous settings.
        node_keys: The node's key and admission protocol, or ``None`` for PyTorch's.
    """

    _node: _NodeDesc
    _state: _RendezvousState
    _state_holder: _RendezvousStateHolder
    _settings: RendezvousSettings

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: _RendezvousStateHolder,
        settings: RendezvousSettings,
        node_keys: NodeKeys | None = None,
    ) -> None:
        self._node = node
        self._state_holder = state_holder
        self._settings = settings
        self._keys = node_keys
        # Whether the node announced itself and waits for a batch to admit it (or to
        # take it out of the round it leaves: which one, then).
        self._awaiting_admission = False
        self._awaiting_exit: int | None = None
        # The nodes whose heartbeats the aggregator is writing into the state.
        self._fold: set[_NodeDesc] | None = None
        self._events = event_source(EXECUTOR_EVENTS, settings.run_id)

    def _record(self, method: str, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        """Record an event of ``method`` for this node."""
        record_node_event(self._events, method, message, node_state, self._node)

    def _now(self) -> datetime:
        """The time on the clock of the state's times (see
        :mod:`etcd_rendezvous._dynamic.clock`): etcd's, over this package's connection."""
        return self._state_holder.clock.now()

    def run(
        self,
        state_handler: _StateHandler,
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        """See base class."""
        # Losers of a write race retry at once with the newer state in PyTorch; a short
        # jittered back-off spreads many contending nodes out instead. It only pauses:
        # the operation decides what a passed deadline means (a joining node may still
        # roll back, a redundant node waits on), returning ERROR_TIMEOUT when it is time.
        retry = CONTENTION.start(Deadline.at(deadline))
        action = None
        while action != _Action.FINISH:
            synced = self._sync(deadline, retry)
            if self._refold(synced) or self._heartbeat(deadline):
                continue

            ctx = _RendezvousContext(
                self._node, self._state, self._settings, self._keep_alive_period(), self._now()
            )
            # Determine the next action to take based on the current state.
            action = state_handler(ctx, deadline)
            self._note_admission(action)

            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError(
                    f"The rendezvous '{self._settings.run_id}' is closed: the node "
                    f"'{self._node}' cannot join a new round of it."
                )
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(self._timeout_message(state_handler))

            # Nothing to do until another node changes the state (for an admission: by
            # admitting us) or one of our deadlines falls due.
            if action == _Action.SYNC:
                wait = self._reap(deadline)
                if wait is not None:
                    self._wait(deadline, at_most=wait)
                    continue
                self._state_holder.mark_dirty()
                continue
            if action in _ADMISSIONS or self._exits_in_batch(action):
                outcome = self._admit(action, deadline)
                if isinstance(outcome, Refresh):
                    self._state_holder.invalidate()  # Read the state the batch needs.
                    continue
                if isinstance(outcome, Wait):
                    self._wait(deadline, at_most=outcome.seconds)
                    continue
            else:
                if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                    # Update the deadline since the node may participate in the rendezvous.
                    deadline = update_deadline(self._settings.timeout.join)
                    retry = CONTENTION.start(Deadline.at(deadline))
                self._apply(action)

            # Attempt to sync our changes back to other nodes.
            self._state_holder.mark_dirty()

    def _timeout_message(self, op: _StateHandler) -> str:
        """The error message of ``op`` past its deadline: the run, what the node could not
        do, and the option that limits it."""
        timeout = self._settings.timeout
        what, option, limit = "complete its operation on", "its deadline", None
        if isinstance(op, (_RendezvousJoinOp, _RendezvousExitOp)):
            what, option, limit = "join", "join_timeout", timeout.join
        elif isinstance(op, _RendezvousCloseOp):
            what, option, limit = "close", "close_timeout", timeout.close
        elif isinstance(op, _RendezvousKeepAliveOp):
            what, option, limit = (
                "write its heartbeat to",
                "heartbeat_timeout",
                timeout.heartbeat,
            )
        within = option if limit is None else f"{option} ({limit.total_seconds():g} s)"
        return (
            f"The node '{self._node}' could not {what} the rendezvous "
            f"'{self._settings.run_id}' within {within}."
        )

    def _sync(self, deadline: float, retry: Retry) -> _Synced:
        """Read the latest state shared by all nodes, or write ours back (which fails if
        another node synced its changes first). The backend retries etcd failures (an
        election) until the step's deadline, then raises."""
        holder = self._state_holder
        fetches = holder.fetches
        with holder.bounded_by(self._step_deadline(deadline)):
            try:
                synced = _Synced(holder.sync())
            except RequestTooLargeError as exc:
                # etcd refused our state write for its size: tell the nodes it would
                # have admitted (they follow the progress key), then give up ourselves.
                token, refused = holder.token, holder.state  # (the state refused)
                if self._keys is not None:
                    held = token if isinstance(token, int) else 0
                    count = len(refused.participants)
                    self._keys.refused(exc, held, count, refused.complete)
                raise
            keys, token = self._keys, holder.token
            fetched = holder.fetches != fetches
            if (
                keys is not None
                and isinstance(token, int)
                and (fetched or synced is not _Synced.READ)
            ):
                # Summarise our write in the progress key, or relay a write it misses.
                keys.state_read(token, holder.state, synced is _Synced.WRITTEN)
        if synced is _Synced.WRITTEN:
            retry.reset()
            msg = (
                f"The node '{self._node}' has successfully synced its local changes "
                f"with other nodes in the rendezvous '{self._settings.run_id}'."
            )
        elif synced is _Synced.LOST_RACE:
            msg = (
                f"The node '{self._node}' has a stale state and failed to sync its "
                f"local changes with other nodes in the rendezvous "
                f"'{self._settings.run_id}'."
            )
            if self._fold is None:
                # The aggregator's fold retries at once: it refreshes every node with a
                # key, and each moment it waits more of them may write their own.
                retry.pause()
        if synced is not _Synced.READ:
            self._record("run", msg)
            logger.debug(msg)
        self._state = self._state_holder.state
        return synced

    def _wait(self, deadline: float, at_most: float | None = None) -> None:
        """Wait for another node to change the state, or until something is due."""
        timeout = self._time_to_next_event(deadline)
        if at_most is not None:
            timeout = min(timeout, at_most + _WAKE_UP_MARGIN)
        holder, keys = self._state_holder, self._keys
        token = holder.token
        with holder.bounded_by(self._step_deadline(deadline)):
            if keys is not None and keys.follows_progress:
                # Wait on the small progress key; read the state only if it says so.
                held = token if isinstance(token, int) else 0
                heard = keys.await_progress(timeout, held, self._state)
                if heard is Heard.READ:
                    holder.invalidate()
                else:
                    holder.keep()
                return
            holder.wait_for_change(timeout)

    def _apply(self, action: _Action) -> None:
        """Carry out an action that changes the state (other than an admission)."""
        if action == _Action.KEEP_ALIVE:
            self._keep_alive(self._node)
        elif action == _Action.REMOVE_FROM_PARTICIPANTS:
            self._remove_from_participants(self._node)
        elif action == _Action.REMOVE_FROM_WAIT_LIST:
            self._remove_from_wait_list()
        elif action == _Action.REMOVE_FROM_REDUNDANCY_LIST:
            self._remove_from_redundancy_list()
        elif action == _Action.MARK_RENDEZVOUS_COMPLETE:
            self._mark_rendezvous_complete()
        elif action == _Action.MARK_RENDEZVOUS_CLOSED:
            self._mark_rendezvous_closed()

    # -- admission and heartbeats ---------------------------------------------------------

    def _exits_in_batch(self, action: _Action) -> bool:
        """Whether the node leaves its round in a batch (see
        :mod:`etcd_rendezvous._dynamic.admission`): with node keys, from a complete
        round. Leaving an incomplete round (a rollback) is the node's own write."""
        return (
            self._keys is not None
            and action == _Action.REMOVE_FROM_PARTICIPANTS
            and self._state.complete
        )

    def _leaves(self, node: _NodeDesc) -> bool:
        """Whether ``node`` is a participant of the complete round its key says it leaves."""
        state = self._state
        return (
            self._keys is not None
            and state.complete
            and node in state.participants
            and self._keys.leaving(node) == state.round
        )

    def _admit(self, action: _Action, deadline: float) -> Wait | Refresh | None:
        """Take the admission ``action`` the join decision chose for this node, or leave
        the complete round: by itself (PyTorch's protocol), or with node keys in a
        batch of every announced node. Returns ``None`` if it changed the state, else
        how long to wait for another node to make the batch, or :class:`Refresh` to read
        the state first (see :meth:`NodeKeys.admission`)."""
        keys = self._keys
        if keys is None:
            self._admit_node(self._node, action)
            return None

        def wants(node: _NodeDesc) -> bool:
            if self._leaves(node):
                return True
            return _admission_action(self._state, node, self._settings) is not None

        state = self._state
        mark = (state.round, len(state.participants), len(state.wait_list))
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            if action == _Action.REMOVE_FROM_PARTICIPANTS:
                keys.leave(state.round)
            token = self._state_holder.token
            outcome = keys.admission(
                wants,
                (*mark, len(state.redundancy_list)),
                token if isinstance(token, int) else None,
            )
        if isinstance(outcome, Batch):
            self._awaiting_admission, self._awaiting_exit = False, None
            self._make_batch(outcome, keys.listed())
            return None
        self._awaiting_admission = True
        if isinstance(outcome, Wait) and action == _Action.REMOVE_FROM_PARTICIPANTS:
            self._awaiting_exit = state.round
        return outcome

    def _make_batch(self, batch: Batch, listed: set[_NodeDesc]) -> None:
        """This node makes ``batch`` in its state (to be written): the nodes leaving
        first (the last one out ends the round, and the join decisions then admit
        everyone to the next one's participants), then each node's join decision on the
        state as that left it; the heartbeats of the ``listed`` nodes (their keys were
        alive) are refreshed as the aggregator does, so a round completes with fresh
        heartbeats."""
        for node in [node for node in batch.nodes if self._leaves(node)]:
            self._remove_from_participants(node)
        for node in batch.nodes:
            admission = _admission_action(self._state, node, self._settings)
            if admission is not None:
                self._admit_node(node, admission)
        now, heartbeats = self._now(), self._state.last_heartbeats
        for node in listed & heartbeats.keys():
            # Never back: a heartbeat moved back could make the node look dead.
            heartbeats[node] = max(heartbeats[node], now)

    def _reap(self, deadline: float) -> float | None:
        """With node keys, while this node is the first of the wait list of a complete
        round: take out the participants whose keys are gone (see "Dead participants" in
        :mod:`etcd_rendezvous._dynamic.admission`). Returns ``None`` if it changed the
        state (to be written), or else the longest to wait before looking again
        (``inf``: nothing to look at)."""
        keys, state = self._keys, self._state
        if (
            keys is None
            or state.closed
            or not state.complete
            or not state.wait_list
            or min(state.wait_list) != self._node
        ):
            return math.inf
        blockers = [n for n in sorted(state.participants) if keys.leaving(n) != state.round]
        if not blockers:
            return math.inf
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            outcome = keys.reap(state.round, blockers)
        if isinstance(outcome, Wait):
            return outcome.seconds
        for node in outcome.nodes:
            logger.info(
                "The key of the node '%s' is gone (it died or left): the node '%s' takes it "
                "out of round %d of the rendezvous '%s'.",
                node,
                self._node,
                state.round,
                self._settings.run_id,
            )
            self._remove_from_participants(node)
        return None

    def _admit_node(self, node: _NodeDesc, action: _Action) -> None:
        """Carry out the admission ``action`` for ``node``."""
        if action == _Action.ADD_TO_PARTICIPANTS:
            self._add_to_participants(node)
        elif action == _Action.ADD_TO_WAIT_LIST:
            self._add_to_wait_list(node)
        elif action == _Action.ADD_TO_REDUNDANCY_LIST:
            self._add_to_redundancy_list(node)

    def _note_admission(self, action: _Action) -> None:
        """Once a node that waited for a batch was taken out of its round or admitted,
        record how (the events a node records when it does it itself, saying who did)."""
        if action in _ADMISSIONS or self._exits_in_batch(action) or not self._awaiting_admission:
            return
        self._awaiting_admission = False
        if self._keys is not None:
            self._keys.admitted()
        state, node = self._state, self._node
        left, self._awaiting_exit = self._awaiting_exit, None
        if left is not None and (node not in state.participants or state.round != left):
            msg = (
                f"The node '{node}' was removed from the participants of round {left} of "
                f"the rendezvous '{self._settings.run_id}' by another node."
            )
            self._record("_remove_from_participants", msg)
            logger.debug(msg)
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
            f"The node '{node}' was added to {where} of the rendezvous "
            f"'{self._settings.run_id}' by another node."
        )
        self._record(method, msg)
        logger.debug(msg)

    def _keep_alive_period(self) -> timedelta:
        """How old our heartbeat in the state may get before we write it ourselves."""
        interval = self._settings.keep_alive_interval
        return interval if self._keys is None else self._keys.heartbeat_period(interval)

    def _heartbeat(self, deadline: float) -> bool:
        """With node keys: the node's heartbeat, if due (see :meth:`NodeKeys.tick`).
        Returns whether the node, as the aggregator, refreshed heartbeats in the state
        (to be written back)."""
        keys = self._keys
        if keys is None or not keys.tick_due():
            return False
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            alive = keys.tick(self._state, self._now())
        if not alive:
            return False
        self._fold = alive
        return self._refold(_Synced.LOST_RACE)

    def _refold(self, synced: _Synced) -> bool:
        """Refresh the heartbeats of the nodes the aggregator found alive, until the
        state with them is written: again on the newer state after a lost race (the
        fold does not wait for the next tick). Returns whether there is a fold to write."""
        alive = self._fold
        if alive is None or synced is not _Synced.LOST_RACE:
            self._fold = None
            return False
        now = self._now()
        heartbeats = self._state.last_heartbeats
        for node in alive:
            if node in heartbeats:
                heartbeats[node] = max(heartbeats[node], now)  # never back (see _make_batch)
        logger.debug(
            "The node '%s' refreshed the heartbeats of %d node(s) with a live key in the "
            "rendezvous '%s'. Pending sync.",
            self._node,
            len(alive),
            self._settings.run_id,
        )
        self._state_holder.mark_dirty()
        return True

    # -- timing -------------------------------------------------------------------------

    def _step_deadline(self, deadline: float) -> Deadline:
        """The deadline of the backend calls of one step: the operation's.

        Except for a node on the redundancy list, which waits for a free place without
        a deadline (as in PyTorch): its steps get a join timeout each, so that it rides
        out an etcd election like any other node.
        """
        if self._node in self._state_holder.state.redundancy_list:
            join = self._settings.timeout.join.total_seconds()
            return Deadline.at(max(deadline, time.monotonic() + join))
        return Deadline.at(deadline)

    def _time_to_next_event(self, deadline: float) -> float:
        """Seconds until something may change the decision without a write by another node.

        That is the operation deadline, the last-call deadline, our own next heartbeat
        (in the state, or of our key), or the expiry of another node's heartbeat. Events
        already past are ignored (they were acted upon), and the wait is capped by the
        keep-alive interval.
        """
        state = self._state
        settings = self._settings
        now = self._now()
        waits = [settings.keep_alive_interval.total_seconds(), deadline - time.monotonic()]
        if state.deadline is not None:
            waits.append((state.deadline - now).total_seconds())
        lifetime = settings.keep_alive_interval * settings.keep_alive_max_attempt
        own = self._keep_alive_period()
        for node, last_heartbeat in state.last_heartbeats.items():
            due = last_heartbeat + (own if node == self._node else lifetime)
            waits.append((due - now).total_seconds())
        tick = None if self._keys is None else self._keys.seconds_to_tick()
        if tick is not None:
            waits.append(tick)
        return min((wait for wait in waits if wait > 0), default=POLL_INTERVAL) + _WAKE_UP_MARGIN

    # -- the actions --------------------------------------------------------------------

    def _tell(self, method: str, node: _NodeDesc, msg: str) -> None:
        """Record the event of ``method``, an action on ``node``; for an action on
        another node (in a batch), only log it: that node records its own."""
        if node == self._node:
            self._record(method, msg)
        logger.debug(msg)

    def _whom(self, node: _NodeDesc) -> str:
        return "itself" if node == self._node else f"the node '{node}'"

    def _pending(self, change: str, round_: int) -> str:
        """The message of a change to round ``round_`` of the state (PyTorch's words)."""
        return (
            f"The node '{self._node}' {change} of round {round_} of the rendezvous "
            f"'{self._settings.run_id}'. Pending sync."
        )

    def _keep_alive(self, node: _NodeDesc) -> None:
        whose = "its" if node == self._node else "the"
        of = "" if node == self._node else f" of the node '{node}'"
        msg = (
            f"The node '{self._node}' updated {whose} keep-alive heartbeat time{of} for the "
            f"rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell("_keep_alive", node, msg)
        now, heartbeats = self._now(), self._state.last_heartbeats
        # Another node's heartbeat (a batch admits it) never moves back: whoever wrote it
        # last may have had a later clock, and moving it back could drop the node.
        heartbeats[node] = now if node == self._node else max(heartbeats.get(node, now), now)

    def _add_to_participants(self, node: _NodeDesc) -> None:
        change = f"added {self._whom(node)} to the participants"
        self._tell("_add_to_participants", node, self._pending(change, self._state.round))
        state = self._state
        state.wait_list.discard(node)

        # The ranks of the participants will be set once the rendezvous is complete.
        state.participants[node] = 0

        self._keep_alive(node)

        if len(state.participants) == self._settings.min_nodes:
            state.deadline = self._now() + self._settings.timeout.last_call

        if len(state.participants) == self._settings.max_nodes:
            self._mark_rendezvous_complete()

    def _add_to_wait_list(self, node: _NodeDesc) -> None:
        change = f"added {self._whom(node)} to the wait list"
        self._tell("_add_to_wait_list", node, self._pending(change, self._state.round + 1))
        self._state.redundancy_list.discard(node)
        self._state.wait_list.add(node)
        self._keep_alive(node)

    def _add_to_redundancy_list(self, node: _NodeDesc) -> None:
        change = f"added {self._whom(node)} to the redundancy list"
        self._tell("_add_to_redundancy_list", node, self._pending(change, self._state.round + 1))
        self._state.redundancy_list.add(node)
        self._keep_alive(node)

    def _remove_from_participants(self, node: _NodeDesc) -> None:
        change = f"removed {self._whom(node)} from the participants"
        self._tell("_remove_from_participants", node, self._pending(change, self._state.round))
        state = self._state
        del state.participants[node]
        state.last_heartbeats.pop(node, None)

        # Common epilogue shared with _BackendRendezvousStateHolder._sanitize().
        _remove_participant_epilogue(state, self._settings)

    def _remove_from_wait_list(self) -> None:
        self._remove_itself("_remove_from_wait_list", "wait list", self._state.wait_list)

    def _remove_from_redundancy_list(self) -> None:
        # "redundant list": PyTorch's wording of this one message.
        self._remove_itself(
            "_remove_from_redundancy_list", "redundant list", self._state.redundancy_list
        )

    def _remove_itself(self, method: str, name: str, members: set[_NodeDesc]) -> None:
        """Take this node off the wait or redundancy list ``members`` (called ``name``)."""
        change = f"removed itself from the {name}"
        self._tell(method, self._node, self._pending(change, self._state.round + 1))
        members.remove(self._node)
        del self._state.last_heartbeats[self._node]

    def _mark_rendezvous_complete(self) -> None:
        msg = (
            f"The node '{self._node}' marked round {self._state.round} of the rendezvous "
            f"'{self._settings.run_id}' as complete. Pending sync."
        )
        self._record("_mark_rendezvous_complete", msg, NodeState.SUCCEEDED)
        logger.debug(msg)
        state = self._state
        state.complete = True
        state.deadline = None

        # Assign the ranks.
        for rank, node in enumerate(sorted(state.participants)):
            state.participants[node] = rank

    def _mark_rendezvous_closed(self) -> None:
        msg = (
            f"The node '{self._node}' marked the rendezvous '{self._settings.run_id}' as "
            "closed. Pending sync."
        )
        self._record("_mark_rendezvous_closed", msg, NodeState.SUCCEEDED)
        logger.debug(msg)
        self._state.closed = True
