"""The dynamic rendezvous, ported from ``torch.distributed.elastic.rendezvous.dynamic_rendezvous``.

:class:`DynamicRendezvousHandler` is PyTorch's recommended rendezvous. All nodes share one
:class:`_RendezvousState` kept by a :class:`RendezvousBackend` (for instance the
``etcd-v2`` backend) and changed only by fenced writes: a node reads the state, decides
what to do with a pure function of it (an *operation* such as :class:`_RendezvousJoinOp`
returns an :class:`_Action`), applies the action locally and writes the state back with
the fencing token it read. If another node wrote first, the write fails, the node gets
the newer state and decides again. The protocol, step by step:

* **join**: nodes add themselves to ``participants``. Once ``min_nodes`` joined, a
  *last call* deadline is set; the round completes when ``max_nodes`` joined or the
  deadline passed, and ranks are assigned in :class:`_NodeDesc` order.
* **late nodes** go to the ``wait_list`` (the agents of the running group see them in
  :meth:`DynamicRendezvousHandler.num_nodes_waiting` and start a new round), or, if the
  group is already at ``max_nodes``, to the ``redundancy_list``.
* **heartbeats**: every node refreshes its entry in ``last_heartbeats`` every
  ``keep_alive_interval``; a node missing ``keep_alive_max_attempt`` of them is dead and
  removed by whoever reads the state next.
* **close**: ``closed`` is set once and never cleared; joining a closed rendezvous
  raises :class:`~etcd_rendezvous.api.RendezvousClosedError`, or
  :class:`~etcd_rendezvous.api.RendezvousGracefulExitError` for a redundant node.

**Wire format.** PyTorch stores ``pickle.dumps(state)`` of its own classes. This module
writes the same bytes: its :class:`_RendezvousState` and :class:`_NodeDesc` pickle under
PyTorch's module path (``torch.distributed.elastic.rendezvous.dynamic_rendezvous``) with
the same attributes, without PyTorch installed, so PyTorch 2.13 workers and ours share
one rendezvous. It does **not** decode with ``pickle.loads``: a restricted unpickler
resolves only the handful of globals such a state contains, the result is checked
attribute by attribute, and anything else raises
:class:`~etcd_rendezvous.api.RendezvousStateError` naming the backend's key, before any
code could run.

What else differs from the reference, none of it visible in the state:

* With a backend that keeps node keys (this package's ``etcd-v2`` backend, see
  :mod:`etcd_rendezvous._dynamic_admission`), a node does not add itself to the state:
  it announces itself with a key of its own and the oldest waiting node admits every
  announced node in one write; and one aggregator writes the heartbeats of all the
  nodes whose keys are alive, once per interval. PyTorch's nodes in the same run keep
  their own protocol; other backends get PyTorch's.
* While waiting for other nodes, a backend that can watch (see
  :meth:`RendezvousBackend.wait_for_change`) wakes the node as soon as the state
  changes, or when a deadline, a heartbeat or a node expiry falls due, instead of
  polling every second; other backends are polled every second, as in PyTorch.
* A lost write race backs off with jitter before the next attempt.
* Every backend call runs under the deadline of the operation that made it (see
  :meth:`RendezvousBackend.bounded_by`): ``next_rendezvous()`` never outlives
  ``join_timeout``, nor a heartbeat ``heartbeat_timeout``, by more than about a second,
  whatever etcd does, and failures such as an etcd election are retried until then.
* The keep-alive thread survives any error (logging it) and stops on :meth:`shutdown`.
* Events are recorded through :mod:`etcd_rendezvous.events`: the same events as
  PyTorch's (names, node states, messages, ranks), delivered to
  ``torch.distributed.elastic.events`` when the process has loaded it, and to the
  callbacks of :func:`~etcd_rendezvous.events.add_event_handler` and the log in any case.
* PyTorch is never imported at import time; it is used only if installed, to share the
  agent's ``TCPStore`` and to wrap PyTorch stores in its ``PrefixStore``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from datetime import timedelta
from enum import Enum
from typing import Any

from ._dynamic_admission import NodeKeys, NodeRegistry
from ._dynamic_backend import _POLL_INTERVAL, RendezvousBackend, _delay
from ._dynamic_backend import Token as _Token
from ._dynamic_holder import (
    _BackendRendezvousStateHolder,
    _remove_participant_epilogue,
    _RendezvousStateHolder,
)
from ._dynamic_settings import RendezvousSettings, RendezvousTimeout, _now
from ._dynamic_state import (
    NodeDesc,
    RendezvousState,
    _NodeDesc,
    _NodeDescGenerator,
    _RendezvousState,
    decode_state,
)
from ._periodic import _PeriodicTimer
from ._prefix_store import _prefix_store
from ._retry import CONTENTION, Deadline, Retry
from ._torch import adapt_store, torch_available, torch_store_wanted
from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    Store,
)
from .events import NodeState, _records_failure, record_rdzv_event
from .layout import dynamic_store_prefix

__all__ = [
    "DynamicRendezvousHandler",
    "NodeDesc",
    "RendezvousBackend",
    "RendezvousSettings",
    "RendezvousState",
    "RendezvousTimeout",
    "Token",
    "create_handler",
    "decode_state",
]

logger = logging.getLogger(__name__)

# Bound (and documented) here, where users import it from.
Token = _Token
"""An opaque fencing token used by the rendezvous backend."""

#: Environment variable with which PyTorch opts out of sharing the agent's TCPStore.
_DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

#: Least time given to the exchange of the master address after a round completed, in
#: seconds (rank 0 publishes it at once; see :meth:`DynamicRendezvousHandler.next_rendezvous`).
_EXCHANGE_GRACE = 0.5

#: Longest a node spends deleting its key when it leaves without a deadline of its own
#: (``close()``, a failed ``next_rendezvous()``), in seconds: the key expires anyway.
_WITHDRAW_TIMEOUT = 1.0

#: Margin added to a wake-up time so that a strict comparison (``deadline < now``) holds
#: when the node wakes up, instead of waking it a few microseconds too early.
_WAKE_UP_MARGIN = 0.01


# The shared state (PyTorch's classes) and its codec live in _dynamic_state.


# -- deciding and acting ------------------------------------------------------------------


class _Action(Enum):
    """Specifies the possible actions based on the state of the rendezvous."""

    KEEP_ALIVE = 1
    ADD_TO_PARTICIPANTS = 2
    ADD_TO_WAIT_LIST = 3
    ADD_TO_REDUNDANCY_LIST = 4
    REMOVE_FROM_PARTICIPANTS = 5
    REMOVE_FROM_WAIT_LIST = 6
    REMOVE_FROM_REDUNDANCY_LIST = 7
    MARK_RENDEZVOUS_COMPLETE = 8
    MARK_RENDEZVOUS_CLOSED = 9
    SYNC = 10
    ERROR_CLOSED = 11
    ERROR_TIMEOUT = 12
    FINISH = 13


class _RendezvousContext:
    """Holds the context of the rendezvous.

    Attributes:
        node: The node descriptor associated with the current rendezvous handler
            instance.
        state: The current state of the rendezvous.
        settings: The rendezvous settings.
        keep_alive_period: How old the node's heartbeat may get before the node
            refreshes it itself: ``keep_alive_interval``, as in PyTorch, unless another
            node refreshes it (see :mod:`etcd_rendezvous._dynamic_admission`).
    """

    node: _NodeDesc
    state: _RendezvousState
    settings: RendezvousSettings
    keep_alive_period: timedelta

    def __init__(
        self,
        node: _NodeDesc,
        state: _RendezvousState,
        settings: RendezvousSettings,
        keep_alive_period: timedelta | None = None,
    ) -> None:
        self.node = node
        self.state = state
        self.settings = settings
        self.keep_alive_period = keep_alive_period or settings.keep_alive_interval


_StateHandler = Callable[[_RendezvousContext, float], _Action]


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
    :mod:`etcd_rendezvous._dynamic_admission`), the node does not add itself to the
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
        # Whether the node announced itself and waits for a batch to admit it.
        self._awaiting_admission = False
        # The nodes whose heartbeats the aggregator is writing into the state.
        self._fold: set[_NodeDesc] | None = None

    def _record(
        self,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        *,
        method: str | None = None,
    ) -> None:
        """Record an event named after ``method`` (by default, the caller)."""
        record_rdzv_event(
            name=f"{type(self).__name__}.{method or sys._getframe(1).f_code.co_name}",
            run_id=self._settings.run_id,
            message=message,
            node_state=node_state,
            hostname=self._node.addr,
            pid=self._node.pid,
            local_id=self._node.local_id,
        )

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
            has_set = self._sync(deadline, retry)
            if self._refold(has_set) or self._heartbeat(deadline):
                continue

            ctx = _RendezvousContext(
                self._node, self._state, self._settings, self._keep_alive_period()
            )
            # Determine the next action to take based on the current state.
            action = state_handler(ctx, deadline)
            self._note_admission(action)

            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError

            # Nothing to do until another node changes the state (for an admission: by
            # admitting us) or one of our deadlines falls due.
            if action == _Action.SYNC:
                self._wait(deadline)
                continue
            if action in _ADMISSIONS:
                wait = self._admit(action, deadline)
                if wait is not None:
                    self._wait(deadline, at_most=wait)
                    continue
            if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                # Update the deadline since the node may participate in the rendezvous.
                deadline = update_deadline(self._settings.timeout.join)
                retry = CONTENTION.start(Deadline.at(deadline))
            if action not in _ADMISSIONS:
                self._apply(action)

            # Attempt to sync our changes back to other nodes.
            self._state_holder.mark_dirty()

    def _sync(self, deadline: float, retry: Retry) -> bool | None:
        """Read the latest state shared by all nodes, or write ours back (which fails if
        another node synced its changes first). The backend retries etcd failures (an
        election) until the step's deadline, then raises. Returns what
        :meth:`_RendezvousStateHolder.sync` returns."""
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            has_set = self._state_holder.sync()
        if has_set is not None:
            if has_set:
                retry.reset()
                msg = (
                    f"The node '{self._node}' has successfully synced its local changes "
                    f"with other nodes in the rendezvous '{self._settings.run_id}'."
                )
            else:
                msg = (
                    f"The node '{self._node}' has a stale state and failed to sync its "
                    f"local changes with other nodes in the rendezvous "
                    f"'{self._settings.run_id}'."
                )
            self._record(message=msg, method="run")
            logger.debug(msg)
            if not has_set and self._fold is None:
                # The aggregator's fold retries at once: it refreshes every node with a
                # key, and each moment it waits more of them may write their own.
                retry.pause()
        self._state = self._state_holder.state
        return has_set

    def _wait(self, deadline: float, at_most: float | None = None) -> None:
        """Wait for another node to change the state, or until something is due."""
        timeout = self._time_to_next_event(deadline)
        if at_most is not None:
            timeout = min(timeout, at_most + _WAKE_UP_MARGIN)
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            self._state_holder.wait_for_change(timeout)

    def _apply(self, action: _Action) -> None:
        """Carry out an action that changes the state (other than an admission)."""
        if action == _Action.KEEP_ALIVE:
            self._keep_alive(self._node)
        elif action == _Action.REMOVE_FROM_PARTICIPANTS:
            self._remove_from_participants()
        elif action == _Action.REMOVE_FROM_WAIT_LIST:
            self._remove_from_wait_list()
        elif action == _Action.REMOVE_FROM_REDUNDANCY_LIST:
            self._remove_from_redundancy_list()
        elif action == _Action.MARK_RENDEZVOUS_COMPLETE:
            self._mark_rendezvous_complete()
        elif action == _Action.MARK_RENDEZVOUS_CLOSED:
            self._mark_rendezvous_closed()

    # -- admission and heartbeats ---------------------------------------------------------

    def _admit(self, action: _Action, deadline: float) -> float | None:
        """Take the admission ``action`` the join decision chose for this node: by itself
        (PyTorch's protocol), or with node keys in a batch of every announced node, if
        it is the oldest waiting. Returns ``None`` if it changed the state, or else the
        longest to wait for another node to admit it before looking again (see
        :meth:`NodeKeys.admission`)."""
        keys = self._keys
        if keys is None:
            self._admit_node(self._node, action)
            return None

        def wants(node: _NodeDesc) -> bool:
            return _admission_action(self._state, node, self._settings) is not None

        state = self._state
        mark = (state.round, len(state.participants), len(state.wait_list))
        with self._state_holder.bounded_by(self._step_deadline(deadline)):
            outcome = keys.admission(wants, (*mark, len(state.redundancy_list)))
        if isinstance(outcome, float):
            self._awaiting_admission = True
            return outcome
        for node in outcome:
            # The join decision for each node, on the state as the batch left it.
            admission = _admission_action(self._state, node, self._settings)
            if admission is not None:
                self._admit_node(node, admission)
        # The same write refreshes the heartbeats of the nodes whose keys were listed
        # (alive), as the aggregator does: a round completes with fresh heartbeats.
        now, heartbeats = _now(), self._state.last_heartbeats
        for node in keys.listed() & heartbeats.keys():
            heartbeats[node] = now
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
        """Once a node that waited for its admission is in the state, record how (the
        event a node records when it adds itself, saying who did)."""
        if action in _ADMISSIONS or not self._awaiting_admission:
            return
        self._awaiting_admission = False
        if self._keys is not None:
            self._keys.admitted()
        state, node = self._state, self._node
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
        self._record(message=msg, method=method)
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
            alive = keys.tick(self._state, _now())
        if not alive:
            return False
        self._fold = alive
        return self._refold(False)

    def _refold(self, has_set: bool | None) -> bool:
        """Refresh the heartbeats of the nodes the aggregator found alive, until the
        state with them is written: again on the newer state after a lost race (the
        fold does not wait for the next tick). Returns whether there is a fold to write."""
        alive = self._fold
        if alive is None or has_set is not False:
            self._fold = None
            return False
        now = _now()
        heartbeats = self._state.last_heartbeats
        for node in alive:
            if node in heartbeats:
                heartbeats[node] = now
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
        now = _now()
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
        return min((wait for wait in waits if wait > 0), default=_POLL_INTERVAL) + _WAKE_UP_MARGIN

    # -- the actions --------------------------------------------------------------------

    def _tell(self, node: _NodeDesc, msg: str, node_state: NodeState = NodeState.RUNNING) -> None:
        """Record the event of an action on ``node`` (named after the caller); for an
        action on another node (in a batch), only log it: that node records its own."""
        if node == self._node:
            self._record(message=msg, node_state=node_state, method=sys._getframe(1).f_code.co_name)
        logger.debug(msg)

    def _whom(self, node: _NodeDesc) -> str:
        return "itself" if node == self._node else f"the node '{node}'"

    def _keep_alive(self, node: _NodeDesc) -> None:
        whose = "its" if node == self._node else "the"
        of = "" if node == self._node else f" of the node '{node}'"
        msg = (
            f"The node '{self._node}' updated {whose} keep-alive heartbeat time{of} for the "
            f"rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell(node, msg)
        self._state.last_heartbeats[node] = _now()

    def _add_to_participants(self, node: _NodeDesc) -> None:
        msg = (
            f"The node '{self._node}' added {self._whom(node)} to the participants of round "
            f"{self._state.round} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell(node, msg)
        state = self._state
        state.wait_list.discard(node)

        # The ranks of the participants will be set once the rendezvous is complete.
        state.participants[node] = 0

        self._keep_alive(node)

        if len(state.participants) == self._settings.min_nodes:
            state.deadline = _now() + self._settings.timeout.last_call

        if len(state.participants) == self._settings.max_nodes:
            self._mark_rendezvous_complete()

    def _add_to_wait_list(self, node: _NodeDesc) -> None:
        msg = (
            f"The node '{self._node}' added {self._whom(node)} to the wait list of round "
            f"{self._state.round + 1} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell(node, msg)
        self._state.redundancy_list.discard(node)
        self._state.wait_list.add(node)
        self._keep_alive(node)

    def _add_to_redundancy_list(self, node: _NodeDesc) -> None:
        msg = (
            f"The node '{self._node}' added {self._whom(node)} to the redundancy list of round "
            f"{self._state.round + 1} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell(node, msg)
        self._state.redundancy_list.add(node)
        self._keep_alive(node)

    def _remove_from_participants(self) -> None:
        msg = (
            f"The node '{self._node}' removed itself from the participants of round "
            f"{self._state.round} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._record(message=msg)
        logger.debug(msg)
        state = self._state
        del state.participants[self._node]
        del state.last_heartbeats[self._node]

        # Common epilogue shared with _BackendRendezvousStateHolder._sanitize().
        _remove_participant_epilogue(state, self._settings)

    def _remove_from_wait_list(self) -> None:
        msg = (
            f"The node '{self._node}' removed itself from the wait list of round "
            f"{self._state.round + 1} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._record(message=msg)
        logger.debug(msg)
        self._state.wait_list.remove(self._node)
        del self._state.last_heartbeats[self._node]

    def _remove_from_redundancy_list(self) -> None:
        msg = (
            f"The node '{self._node}' removed itself from the redundant list of round "
            f"{self._state.round + 1} of the rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._record(message=msg)
        logger.debug(msg)
        self._state.redundancy_list.remove(self._node)
        del self._state.last_heartbeats[self._node]

    def _mark_rendezvous_complete(self) -> None:
        msg = (
            f"The node '{self._node}' marked round {self._state.round} of the rendezvous "
            f"'{self._settings.run_id}' as complete. Pending sync."
        )
        self._record(message=msg, node_state=NodeState.SUCCEEDED)
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
        self._record(message=msg, node_state=NodeState.SUCCEEDED)
        logger.debug(msg)
        self._state.closed = True


def _should_keep_alive(ctx: _RendezvousContext) -> bool:
    """Determine whether a keep-alive heartbeat should be sent."""
    try:
        last_heartbeat = ctx.state.last_heartbeats[ctx.node]
    except KeyError:
        return False

    return last_heartbeat <= _now() - ctx.keep_alive_period


#: The actions that add a node to the state (which a batch admission takes for others).
_ADMISSIONS = frozenset(
    {_Action.ADD_TO_PARTICIPANTS, _Action.ADD_TO_WAIT_LIST, _Action.ADD_TO_REDUNDANCY_LIST}
)


def _admission_action(
    state: _RendezvousState, node: _NodeDesc, settings: RendezvousSettings
) -> _Action | None:
    """The action of :class:`_RendezvousJoinOp` that adds ``node`` to ``state``, if it
    takes one (the decision before its deadline: a node past it does not join).

    Not complete: a node that is not a participant joins the participants (leaving the
    wait list). Complete: a node that is not a participant goes to the wait list if the
    round has room, else to the redundancy list (unless it waits already). A closed
    rendezvous and a node on the redundancy list (which leaves it first) add nobody.
    """
    if state.closed or node in state.redundancy_list:
        return None
    if not state.complete:
        return None if node in state.participants else _Action.ADD_TO_PARTICIPANTS
    if node in state.participants or node in state.wait_list:
        return None
    if len(state.participants) < settings.max_nodes:
        return _Action.ADD_TO_WAIT_LIST
    return _Action.ADD_TO_REDUNDANCY_LIST


class _RendezvousExitOp:
    """Represent a rendezvous exit operation."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        if ctx.node in ctx.state.participants:
            if time.monotonic() > deadline:
                return _Action.ERROR_TIMEOUT
            return _Action.REMOVE_FROM_PARTICIPANTS
        return _Action.FINISH


class _RendezvousJoinOp:
    """Represent a rendezvous join operation."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        state = ctx.state

        # A closed rendezvous means that it no longer accepts new nodes.
        if state.closed:
            if ctx.node in state.redundancy_list:
                raise RendezvousGracefulExitError(
                    f"The rendezvous '{ctx.settings.run_id}' is closed, terminating pending "
                    "rendezvous."
                )
            return _Action.ERROR_CLOSED

        if ctx.node in state.redundancy_list:
            logger.debug("The node %s is in redundancy list", ctx.node)
            # Do not apply the timeout logic here, to allow the node to rejoin.
            if len(state.participants) == ctx.settings.max_nodes:
                if _should_keep_alive(ctx):
                    return _Action.KEEP_ALIVE
                return _Action.SYNC
            # Transition to the waiting state that respects timeouts.
            logger.debug("The node %s is removed from redundancy list", ctx.node)
            return _Action.REMOVE_FROM_REDUNDANCY_LIST

        is_participant = ctx.node in state.participants

        # If we are part of the rendezvous and it is already complete there is no
        # further action to take.
        if state.complete and is_participant:
            return _Action.FINISH

        now = time.monotonic()
        if now > deadline:
            rollback_period = 5  # seconds

            # If we still have time to roll back (a short period on top of the operation
            # deadline), try to remove ourselves from the rendezvous. It is okay if we
            # cannot, as our keep-alive will eventually expire.
            if now <= deadline + rollback_period:
                # A participant could not find enough participants to complete on time.
                if is_participant:
                    return _Action.REMOVE_FROM_PARTICIPANTS
                # A waiting node could not wait till the next round.
                if ctx.node in state.wait_list:
                    return _Action.REMOVE_FROM_WAIT_LIST
            return _Action.ERROR_TIMEOUT

        admission = _admission_action(state, ctx.node, ctx.settings)
        if admission is not None:
            return admission
        if not state.complete and is_participant:
            # If the rendezvous has enough participants including us, check whether we
            # have passed the last-call deadline. If yes, complete it.
            if (
                ctx.settings.min_nodes <= len(state.participants) <= ctx.settings.max_nodes
                and state.deadline is not None
            ):
                if state.deadline < _now():
                    logger.debug(
                        "The node '%s' marking the rendezvous complete, quorum established "
                        "within deadline",
                        ctx.node,
                    )
                    return _Action.MARK_RENDEZVOUS_COMPLETE
                logger.debug("The node '%s' can't complete rendezvous: deadline reached", ctx.node)
            else:
                logger.debug(
                    "The node '%s' can't complete rendezvous: not enough participants", ctx.node
                )

        if _should_keep_alive(ctx):
            return _Action.KEEP_ALIVE

        # Either the rendezvous is not complete but we are part of it, so we wait for
        # other participants to join; or it is complete but we are not part of it, so we
        # wait for the next round.
        return _Action.SYNC


class _RendezvousCloseOp:
    """Represent a rendezvous close operation."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        if ctx.state.closed:
            return _Action.FINISH
        if time.monotonic() > deadline:
            return _Action.ERROR_TIMEOUT
        return _Action.MARK_RENDEZVOUS_CLOSED


class _RendezvousKeepAliveOp:
    """Represent a rendezvous keep-alive update operation."""

    def __call__(self, ctx: _RendezvousContext, deadline: float) -> _Action:
        if _should_keep_alive(ctx):
            if time.monotonic() > deadline:
                return _Action.ERROR_TIMEOUT
            return _Action.KEEP_ALIVE
        return _Action.FINISH


# -- the handler ----------------------------------------------------------------------------


class DynamicRendezvousHandler(RendezvousHandler):
    """Represent a handler that sets up a rendezvous among a set of nodes.

    Created with :meth:`from_backend` or :func:`create_handler`. Use one handler per
    agent, and call :meth:`shutdown` when done: it closes the rendezvous and stops the
    keep-alive thread. :meth:`close` (also called on leaving a ``with`` block) stops
    the thread and releases the backend if the handler owns it, without closing the
    rendezvous for the other nodes.
    """

    # Static
    _node_desc_generator = _NodeDescGenerator()

    _this_node: _NodeDesc
    _settings: RendezvousSettings
    _backend_name: str
    _store: Store
    _state_holder: _RendezvousStateHolder
    _op_executor: _RendezvousOpExecutor
    _heartbeat_lock: threading.Lock
    _keep_alive_timer: _PeriodicTimer | None

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Store,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: int = 5,
        keep_alive_max_attempt: int = 3,
        *,
        backend_name: str | None = None,
        owns_backend: bool = False,
    ) -> DynamicRendezvousHandler:
        """Create a new :class:`DynamicRendezvousHandler`.

        Args:
            run_id: The run id of the rendezvous.
            store: The c10d store to return as part of the rendezvous.
            backend: The backend to use to hold the rendezvous state.
            min_nodes: The minimum number of nodes to admit to the rendezvous.
            max_nodes: The maximum number of nodes to admit to the rendezvous.
            local_addr: The local node address.
            timeout: The timeout configuration of the rendezvous.
            keep_alive_interval: The amount of time, in seconds, a node waits before
                sending a heartbeat to keep it alive in the rendezvous.
            keep_alive_max_attempt: The maximum number of failed heartbeat attempts after
                which a node is considered dead.
            backend_name: What :meth:`get_backend` reports; ``backend.name`` if ``None``.
            owns_backend: Whether :meth:`close` closes ``backend`` (set by whoever
                created the backend and hands it over).

        Raises:
            ValueError: A setting is invalid; the message names it.
        """
        # We associate each handler instance with a unique node descriptor.
        node = cls._node_desc_generator.generate(local_addr)

        settings = RendezvousSettings(
            run_id,
            min_nodes,
            max_nodes,
            timeout or RendezvousTimeout(),
            keep_alive_interval=timedelta(seconds=keep_alive_interval),
            keep_alive_max_attempt=keep_alive_max_attempt,
        )

        state_holder = _BackendRendezvousStateHolder(backend, settings)
        # A backend that keeps node keys gets batched admission and aggregated heartbeats.
        node_keys = NodeKeys(backend, node, settings) if isinstance(backend, NodeRegistry) else None

        return cls(
            node,
            settings,
            backend_name or backend.name,
            store,
            state_holder,
            owned_backend=backend if owns_backend else None,
            node_keys=node_keys,
        )

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: _RendezvousStateHolder,
        *,
        owned_backend: RendezvousBackend | None = None,
        node_keys: NodeKeys | None = None,
    ) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")

        if settings.min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({settings.min_nodes}) must be greater than zero."
            )

        if settings.max_nodes < settings.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({settings.max_nodes}) must be greater than or "
                f"equal to the minimum number of nodes ({settings.min_nodes})."
            )

        self._this_node = node
        self._settings = settings
        self._backend_name = backend_name
        self._store = store
        self._state_holder = state_holder
        self._node_keys = node_keys
        self._op_executor = _DistributedRendezvousOpExecutor(
            self._this_node, self._state_holder, self._settings, node_keys
        )
        self._heartbeat_lock = threading.Lock()
        # Guards starting and stopping the keep-alive timer.
        self._timer_lock = threading.Lock()
        self._keep_alive_timer = None
        # The shared TCPStore server, when this node hosts it (rank 0, torch installed).
        self._shared_tcp_store_server: Any = None
        self._bootstrap_store_info: RendezvousStoreInfo | None = None
        # The backend released by close(), if the handler owns it.
        self._owned_backend = owned_backend
        self._close_lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> DynamicRendezvousHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _record(
        self,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        rank: int | None = None,
        *,
        method: str | None = None,
    ) -> None:
        """Record an event named after ``method`` (by default, the caller)."""
        record_rdzv_event(
            name=f"{type(self).__name__}.{method or sys._getframe(1).f_code.co_name}",
            run_id=self._settings.run_id,
            message=message,
            node_state=node_state,
            hostname=self._this_node.addr,
            pid=self._this_node.pid,
            local_id=self._this_node.local_id,
            rank=rank,
        )

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        """Start the agent's shared ``TCPStore`` server (needs PyTorch)."""
        # Imported by name: PyTorch is optional and must not be imported at import time.
        dist = importlib.import_module("torch.distributed")
        return dist.TCPStore(
            host_name=master_addr, port=master_port, is_master=True, multi_tenant=True
        )

    @property
    def settings(self) -> RendezvousSettings:
        """Get the settings of the rendezvous."""
        return self._settings

    def get_backend(self) -> str:
        """See base class."""
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        """Whether rank 0 hosts a ``TCPStore`` shared with the trainers.

        As in PyTorch, true unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; but a
        ``TCPStore`` needs PyTorch, so without it installed this is always false.
        """
        return os.getenv(_DISABLE_SHARED_STORE_ENV, "0") != "1" and torch_available()

    @_records_failure
    def next_rendezvous(self) -> RendezvousInfo:
        """See base class.

        Returns or raises within ``join_timeout`` (plus about a second), whatever the
        backend does: every backend call runs under the join deadline (see
        :meth:`RendezvousBackend.bounded_by`), retrying failures such as an etcd
        election until then. Only a node on the redundancy list waits on past it.
        """
        deadline = self._get_deadline(self._settings.timeout.join)
        msg = (
            f"The node '{self._this_node}' attempts to join the next round of the rendezvous "
            f"'{self._settings.run_id}'."
        )
        self._record(message=msg)
        logger.info(msg)

        # A heartbeat in progress ends by its own deadline; we wait no longer than ours.
        self._stop_heartbeats(deadline)
        with self._locked(deadline, "join"):
            pass

        # Delay the execution for a small random amount of time if this is our first
        # run. This slightly skews the rendezvous attempts across the nodes and reduces
        # the load on the backend.
        if self._state_holder.state.round == 0:
            _delay(seconds=(0, 0.3))

        exit_op = _RendezvousExitOp()
        join_op = _RendezvousJoinOp()

        keys = self._node_keys
        if keys is not None:
            keys.begin_join()
        try:
            self._op_executor.run(exit_op, deadline)
            self._op_executor.run(join_op, deadline, self._get_deadline)
        except RendezvousConnectionError:
            raise  # etcd is out of reach: the key expires on its own.
        except BaseException:
            # Stop announcing the node, lest a batch admit it after all.
            self._withdraw(Deadline(_WITHDRAW_TIMEOUT))
            raise
        finally:
            if keys is not None:
                keys.end_join()

        self._start_heartbeats()

        rank, world_size = self._get_world()
        store = self._get_store()
        # Rank 0 publishes its address in the store just after completing the round, so
        # the exchange gets a moment even if the round completed right at the deadline.
        exchange = Deadline(max(deadline - time.monotonic(), _EXCHANGE_GRACE))
        with self._state_holder.bounded_by(exchange):
            return self._bootstrap(rank, world_size, store)

    def _bootstrap(self, rank: int, world_size: int, store: Store) -> RendezvousInfo:
        """The end of :meth:`next_rendezvous`: exchange the master address in the store."""
        msg = (
            f"The node '{self._this_node}' has joined round {self._state_holder.state.round} of "
            f"the rendezvous '{self._settings.run_id}' as rank {rank} in a world of size "
            f"{world_size}."
        )
        self._record(message=msg, rank=rank, method="next_rendezvous")
        logger.info(msg)

        if not self.use_agent_store:
            # Opted out of TCPStore sharing (or no PyTorch): rank 0 publishes a free port.
            bootstrap_store_info = RendezvousStoreInfo.build(
                rank, store, local_addr=self._this_node.addr
            )
            return RendezvousInfo(store, rank, world_size, bootstrap_store_info)

        # PyTorch builds the bootstrap info only in a node's first round, so a node
        # admitted in a later round waits for a MASTER_ADDR that rank 0 never publishes
        # under the new round's prefix (until the store times out). Here rank 0 hosts
        # the shared TCPStore (starting it when it first becomes rank 0) and publishes
        # its address every round, and the other ranks read it every round.
        if rank == 0:
            if self._shared_tcp_store_server is None:
                self._shared_tcp_store_server = self._create_tcp_store_server(
                    self._this_node.addr, 0
                )
            self._bootstrap_store_info = RendezvousStoreInfo.build(
                rank,
                store,
                local_addr=self._this_node.addr,
                server_port=self._shared_tcp_store_server.port,
            )
        else:
            self._bootstrap_store_info = RendezvousStoreInfo.build(
                rank, store, local_addr=self._this_node.addr
            )

        return RendezvousInfo(store, rank, world_size, self._bootstrap_store_info)

    @_records_failure
    def is_closed(self) -> bool:
        """See base class. Ends within ``join_timeout`` (plus about a second)."""
        with self._synced(self._settings.timeout.join, "read the state of") as state:
            return state.closed

    @_records_failure
    def set_closed(self) -> None:
        """See base class. Ends within ``close_timeout`` (plus about a second)."""
        deadline = self._get_deadline(self._settings.timeout.close)
        with self._locked(deadline, "close"):
            self._close(deadline)

    @_records_failure
    def num_nodes_waiting(self) -> int:
        """See base class. Ends within ``join_timeout`` (plus about a second)."""
        with self._synced(self._settings.timeout.join, "read the state of") as state:
            return len(state.wait_list)

    @contextlib.contextmanager
    def _synced(self, timeout: timedelta, what: str) -> Iterator[_RendezvousState]:
        """The state, synced with the backend within ``timeout``."""
        deadline = self._get_deadline(timeout)
        with self._locked(deadline, what):
            with self._state_holder.bounded_by(Deadline.at(deadline)):
                self._state_holder.sync()
            yield self._state_holder.state

    @contextlib.contextmanager
    def _locked(self, deadline: float, what: str) -> Iterator[None]:
        """Hold the heartbeat lock, waiting for it (a heartbeat in progress) no later
        than ``deadline``.

        Raises:
            RendezvousTimeoutError: the lock was not free by ``deadline``.
        """
        if not self._heartbeat_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise RendezvousTimeoutError(
                f"Could not {what} the rendezvous '{self._settings.run_id}' in time: a "
                "keep-alive heartbeat held on to the backend until the deadline."
            )
        try:
            yield
        finally:
            self._heartbeat_lock.release()

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    @_records_failure
    def shutdown(self) -> bool:
        """Stop the keep-alive thread and close the rendezvous.

        As in PyTorch, the backend stays open; :meth:`close` releases it.

        Returns:
            Whether the rendezvous could be closed; the thread is stopped either way.
        """
        deadline = self._get_deadline(self._settings.timeout.close)
        self._stop_heartbeats(deadline)

        try:
            with self._locked(deadline, "close"):
                self._close(deadline)
                self._withdraw(Deadline.at(deadline))
        except RendezvousError as ex:
            msg = (
                f"The node '{self._this_node}' has failed to shutdown the rendezvous "
                f"'{self._settings.run_id}' due to an error of type {type(ex).__name__}."
            )
            self._record(message=msg, node_state=NodeState.FAILED)
            logger.warning(msg)
            return False
        return True

    def close(self) -> None:
        """Stop the keep-alive thread and close the backend if the handler owns it.

        Unlike :meth:`shutdown`, the rendezvous is not closed for the other nodes: they
        see this node's heartbeats stop. Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_heartbeats()
        self._withdraw(Deadline(_WITHDRAW_TIMEOUT))
        # Backends that do not derive from RendezvousBackend may lack close().
        close_backend = getattr(self._owned_backend, "close", None)
        if close_backend is not None:
            close_backend()

    def _withdraw(self, deadline: Deadline) -> None:
        """Delete the node's key (with node keys), by ``deadline``; a failure is only
        logged: the key expires on its own."""
        if self._node_keys is None:
            return
        try:
            with self._state_holder.bounded_by(deadline):
                self._node_keys.withdraw()
        except RendezvousError as ex:
            logger.warning(
                "The node '%s' could not delete its key from the rendezvous '%s' (%s: %s); "
                "it expires on its own.",
                self._this_node,
                self._settings.run_id,
                type(ex).__name__,
                ex,
            )

    def _close(self, deadline: float) -> None:
        op = _RendezvousCloseOp()
        self._op_executor.run(op, deadline)
        msg = f"The node '{self._this_node}' has closed the rendezvous '{self._settings.run_id}'."
        self._record(message=msg, node_state=NodeState.SUCCEEDED)
        logger.info(msg)

    @staticmethod
    def _keep_alive_weak(weak_self: weakref.ref[DynamicRendezvousHandler]) -> None:
        self = weak_self()
        if self is not None:
            self._keep_alive()

    def _keep_alive(self) -> None:
        with self._heartbeat_lock:
            op = _RendezvousKeepAliveOp()
            deadline = self._get_deadline(self._settings.timeout.heartbeat)
            try:
                self._op_executor.run(op, deadline)
            except (RendezvousConnectionError, RendezvousTimeoutError) as ex:
                # Transient: the next heartbeat tries again.
                self._record_heartbeat_failure(ex)
                logger.warning(
                    "The node '%s' has failed to send a keep-alive heartbeat to the rendezvous "
                    "'%s' due to an error of type %s (%s); will retry.",
                    self._this_node,
                    self._settings.run_id,
                    type(ex).__name__,
                    ex,
                )
            except Exception as ex:
                self._record_heartbeat_failure(ex)
                logger.exception(
                    "The node '%s' has failed to send a keep-alive heartbeat to the rendezvous "
                    "'%s'; will retry.",
                    self._this_node,
                    self._settings.run_id,
                )
            else:
                self._record(
                    message=f"The node '{self._this_node}' has sent a keep-alive heartbeat to "
                    f"the rendezvous '{self._settings.run_id}'."
                )
                logger.debug(
                    "The node '%s' has sent a keep-alive heartbeat to the rendezvous '%s'.",
                    self._this_node,
                    self._settings.run_id,
                )

    def _record_heartbeat_failure(self, ex: Exception) -> None:
        self._record(
            message=f"The node '{self._this_node}' has failed to send a keep-alive heartbeat to "
            f"the rendezvous '{self._settings.run_id}' due to an error of type "
            f"{type(ex).__name__}.",
            node_state=NodeState.FAILED,
            method="_keep_alive",
        )

    def _start_heartbeats(self) -> None:
        with self._timer_lock:
            if self._keep_alive_timer is not None:
                self._keep_alive_timer.cancel()
            self._keep_alive_timer = _PeriodicTimer(
                self._settings.keep_alive_interval, self._keep_alive_weak, weakref.ref(self)
            )
            self._keep_alive_timer.set_name(f"RendezvousKeepAliveTimer_{self._this_node.local_id}")
            self._keep_alive_timer.start()

    def _stop_heartbeats(self, deadline: float | None = None) -> None:
        """Stop the keep-alive timer, waiting for a heartbeat in progress to end (no
        later than ``deadline``, a ``time.monotonic()`` time, if given)."""
        with self._timer_lock:
            if self._keep_alive_timer is None:
                return
            timeout = None if deadline is None else deadline - time.monotonic()
            self._keep_alive_timer.cancel(timeout)
            self._keep_alive_timer = None

    def _get_world(self) -> tuple[int, int]:
        state = self._state_holder.state
        return state.participants[self._this_node], len(state.participants)

    def _wrap_store(self, store: Store) -> Store:
        key_prefix = dynamic_store_prefix(self._settings.run_id, self._state_holder.state.round)
        return _prefix_store(key_prefix, store)

    def _get_store(self) -> Store:
        return self._wrap_store(self._store)

    def _get_deadline(self, timeout: timedelta) -> float:
        return time.monotonic() + timeout.total_seconds()


def _get_timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    timeout = params.get_as_int(key + "_timeout")
    if timeout is None:
        return None
    return timedelta(seconds=timeout)


def create_handler(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    *,
    backend_name: str | None = None,
    owns_backend: bool = False,
) -> DynamicRendezvousHandler:
    """Create a new :class:`DynamicRendezvousHandler` from the specified parameters.

    Args:
        store: The c10d store to return as part of the rendezvous. An
            :class:`~etcd_rendezvous.etcd_store.EtcdStore` is handed out as a
            :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` when PyTorch is
            installed (see ``torch_store`` below).
        backend: The backend to use to hold the rendezvous state.
        backend_name: What the handler's ``get_backend()`` reports; ``backend.name``
            if ``None``.
        owns_backend: Whether the handler's ``close()`` closes ``backend`` (and with it
            the connection :func:`~etcd_rendezvous.etcd_rendezvous_backend.create_backend`
            opened); set it when handing over a backend nobody else closes. The backend
            is then also closed if this function raises.
        params: The rendezvous parameters; these options are read from its config:

    +--------------------------+--------------------------------------------------------+
    | Parameter                | Description                                            |
    +==========================+========================================================+
    | join_timeout             | The total time, in seconds, within which the           |
    |                          | rendezvous is expected to complete. Defaults to 600.   |
    +--------------------------+--------------------------------------------------------+
    | last_call_timeout        | An additional wait amount, in seconds, before          |
    |                          | completing the rendezvous once the minimum number of   |
    |                          | nodes has been reached. Defaults to 30.                |
    +--------------------------+--------------------------------------------------------+
    | close_timeout            | The time, in seconds, within which the rendezvous is   |
    |                          | expected to close after a call to ``set_closed`` or    |
    |                          | ``shutdown``. Defaults to 30.                          |
    +--------------------------+--------------------------------------------------------+
    | heartbeat_timeout        | The time, in seconds, within which a keep-alive        |
    |                          | heartbeat is expected to complete. Defaults to 5.      |
    +--------------------------+--------------------------------------------------------+
    | keep_alive_interval      | Seconds between heartbeats. Defaults to 5.             |
    +--------------------------+--------------------------------------------------------+
    | keep_alive_max_attempt   | Missed heartbeats after which a node is dead.          |
    |                          | Defaults to 3.                                         |
    +--------------------------+--------------------------------------------------------+
    | torch_store              | ``auto``, ``true`` or ``false``: whether an            |
    |                          | ``EtcdStore`` is handed out as a                       |
    |                          | ``torch.distributed.Store``. ``auto`` (the default)    |
    |                          | does so when PyTorch is installed.                     |
    +--------------------------+--------------------------------------------------------+

    Raises:
        ValueError: An option is invalid; the message names it.
        TypeError: ``keep_alive_interval`` or ``keep_alive_max_attempt`` is ``None``.
    """
    try:
        return _handler_from_params(store, backend, params, backend_name, owns_backend)
    except BaseException as e:
        if isinstance(e, Exception):
            record_rdzv_event(
                message=f"{type(e).__name__}: {e}",
                run_id=params.run_id,
                node_state=NodeState.FAILED,
            )
        close_backend = getattr(backend, "close", None)
        if owns_backend and close_backend is not None:
            close_backend()
        raise


def _handler_from_params(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    backend_name: str | None,
    owns_backend: bool,
) -> DynamicRendezvousHandler:
    """The body of :func:`create_handler`: read the options, then build the handler."""
    timeout = RendezvousTimeout(
        _get_timeout(params, "join"),
        _get_timeout(params, "last_call"),
        _get_timeout(params, "close"),
        _get_timeout(params, "heartbeat"),
    )
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    if keep_alive_interval is None:
        raise TypeError(
            "You passed 'keep_alive_interval=None' as a rendezvous configuration option"
        )
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive_max_attempt is None:
        raise TypeError(
            "You passed 'keep_alive_max_attempt=None' as a rendezvous configuration option"
        )

    store = adapt_store(store, torch_store_wanted(params))

    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
        backend_name=backend_name,
        owns_backend=owns_backend,
    )
