"""The executor of the dynamic rendezvous: PyTorch's loop, sync → decide → apply.

:class:`OpExecutor` (PyTorch's ``_DistributedRendezvousOpExecutor``) syncs the state with
the other nodes through the state holder (:mod:`etcd_rendezvous._dynamic.holder`), asks
the operation (:mod:`etcd_rendezvous._dynamic.ops`) for the next action, and carries it
out: by itself (:mod:`etcd_rendezvous._dynamic.changes`), or, with node keys, through the
admission (:mod:`etcd_rendezvous._dynamic.admission`), which admits the announced nodes
in batches and folds the heartbeats. Between steps it waits for another node's write,
or for its next deadline. Every request ends by the operation's deadline, which is
passed to each call. The protocol: see docs/how-it-works.rst, section "The dynamic
rendezvous".
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from datetime import timedelta

from .._transport.retry import CONTENTION, Deadline, Retry
from ..api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
    RequestTooLargeError,
)
from ..events import NodeState
from .admission import Admission, Changed, Refresh, Wait
from .backend import POLL_INTERVAL
from .changes import Changes
from .holder import StateHolder
from .ops import (
    Action,
    CloseOp,
    Context,
    ExitOp,
    JoinOp,
    KeepAliveOp,
    StateHandler,
    rollback_action,
)
from .progress import Heard
from .settings import (
    EXECUTOR_EVENTS,
    LOGGER_NAME,
    RendezvousSettings,
    event_source,
    record_node_event,
)
from .state import _NodeDesc

__all__ = ["OpExecutor"]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds a node whose join timed out spends withdrawing (see
#: ``OpExecutor._withdraw_after_timeout``), past its deadline: a few round trips are
#: enough, and the handler's calls end within their timeout plus 2 s.
WITHDRAW_PERIOD = 1.0

#: Margin added to a wake-up time so that a strict comparison (``deadline < now``) holds
#: when the node wakes up, instead of waking it a few microseconds too early.
_WAKE_UP_MARGIN = 0.01


class _Synced(enum.Enum):
    """What a sync did: :meth:`StateHolder.sync`'s ``bool | None``, named."""

    READ = None
    """The node read the state (or kept the one it had): it had nothing to write."""
    WRITTEN = True
    """The node's changes were written."""
    LOST_RACE = False
    """Another node wrote first: the node now holds the newer state, without its changes."""


class OpExecutor:
    """Execute rendezvous operations using a shared state.

    With an ``admission`` (a backend with node keys, see
    :mod:`etcd_rendezvous._dynamic.admission`), the node does not add itself to the
    state: it announces itself and is admitted in a batch, by itself or by another node;
    and its heartbeat refreshes its key, folded into the state by the aggregator.

    Args:
        node: The node descriptor associated with the current rendezvous handler
            instance.
        state_holder: The state holder to use to sync the rendezvous state with other
            nodes; its clock is the one of the state's times.
        settings: The rendezvous settings.
        admission: The node's side of the node-key protocol, or ``None`` for PyTorch's.
    """

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: StateHolder,
        settings: RendezvousSettings,
        admission: Admission | None = None,
    ) -> None:
        self._node = node
        self._holder = state_holder
        self._settings = settings
        self._admission = admission
        self._changes = Changes(node, settings, state_holder.clock)
        self._state = state_holder.state
        self._events = event_source(EXECUTOR_EVENTS, settings.run_id)

    def run(
        self,
        op: StateHandler,
        deadline: Deadline,
        renew: Callable[[], Deadline] | None = None,
    ) -> None:
        """Run the operation ``op`` until it finishes (or raises): sync the state, ask
        ``op`` for the next action, carry it out.

        Args:
            op: Returns the next action from the state (see
                :mod:`etcd_rendezvous._dynamic.ops`).
            deadline: When the operation times out; every request ends by then.
            renew: Makes a new deadline for a node that leaves the redundancy list (it
                may now take part in the rendezvous).
        """
        # Losers of a write race retry at once with the newer state in PyTorch; a short
        # jittered back-off spreads many contending nodes out instead. It only pauses:
        # the operation decides what a passed deadline means (a joining node may still
        # roll back, a redundant node waits on), returning ERROR_TIMEOUT when it is time.
        retry = CONTENTION.start(deadline)
        admission = self._admission
        action = None
        while action != Action.FINISH:
            synced = self._sync(deadline, retry)
            lost_race = synced is _Synced.LOST_RACE
            # The fold retries a lost race at once, on the newer state, but not past the
            # deadline: then the operation decides, as after any other step.
            if (
                admission is not None
                and not (lost_race and deadline.expired())
                and admission.fold(self._state, lost_race, self._step(deadline))
            ):
                self._holder.mark_dirty()  # The aggregator refreshed heartbeats: write them.
                continue

            action = op(self._context(), deadline)
            batched = admission is not None and admission.decided(action, self._state)
            if action == Action.FINISH:
                continue
            if action == Action.ERROR_TIMEOUT and isinstance(op, JoinOp):
                action = self._withdraw_after_timeout()
                if action == Action.FINISH:
                    return  # The round completed with the node after all, as in PyTorch.
            if action == Action.ERROR_CLOSED:
                raise RendezvousClosedError(
                    f"The rendezvous '{self._settings.run_id}' is closed: the node "
                    f"'{self._node}' cannot join a new round of it."
                )
            if action == Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(self._timeout_message(op))
            if action == Action.REMOVE_FROM_REDUNDANCY_LIST and renew is not None:
                # The node may participate in the rendezvous: a deadline of its own.
                deadline = renew()
                retry = CONTENTION.start(deadline)

            if action == Action.SYNC:
                changed = self._idle(deadline)
            elif admission is not None and batched:
                step = self._step(deadline)
                outcome = admission.join(action, self._state, self._holder.token, step)
                changed = self._admitted(outcome, deadline)
            else:
                self._changes.apply(self._state, action)
                changed = True
            if changed:
                # Attempt to sync our changes back to other nodes.
                self._holder.mark_dirty()

    def _withdraw_after_timeout(self) -> Action:
        """A join timed out: with a node key, delete it, then read the state and write
        it, for at most :data:`WITHDRAW_PERIOD` seconds. Returns FINISH if the round
        completed with the node (the join finishes, as PyTorch's does past its
        deadline), ``ERROR_CLOSED`` if the rendezvous was closed meanwhile, else
        ``ERROR_TIMEOUT``.

        The write is PyTorch's roll back if a batch admitted the node (it takes itself
        out of the participants, the wait list or the redundancy list), else the state
        as it is. Our compare-and-swap that succeeds lands after the key's deletion, so
        it fences off the batches made from a listing that still had the key: each read
        the state before it listed the keys, and its compare-and-swap on that older
        state fails; its maker lists the keys again. (A race we lose proves nothing:
        the state we held may have been older than the deletion, the winner too.)
        Without it, a batch landing just after the node gave up would admit it: a
        participant that gave up, which a round could complete with. Best effort
        within the period, as PyTorch's roll back is.
        """
        admission = self._admission
        if admission is None or not admission.announced:
            return Action.ERROR_TIMEOUT
        until = Deadline(WITHDRAW_PERIOD)
        try:
            admission.withdraw(until)
            self._holder.invalidate()
            retry = CONTENTION.start(until)
            fenced = False
            while True:
                fenced = fenced or self._sync(until, retry) is _Synced.WRITTEN
                action = rollback_action(self._state, self._node)
                if action == Action.FINISH:
                    self._announce_again(admission, until)
                    return action
                if action == Action.ERROR_CLOSED:
                    return action  # (A closed rendezvous admits nobody.)
                if until.expired():
                    break
                if action != Action.ERROR_TIMEOUT:
                    self._changes.apply(self._state, action)  # PyTorch's roll back.
                elif fenced:
                    break
                self._holder.mark_dirty()  # Our roll back, or the state as it is.
        except RendezvousError as exc:
            logger.info(
                "The node '%s' could not withdraw from the rendezvous '%s' after its join "
                "timed out (%s); its key expires on its own.",
                self._node,
                self._settings.run_id,
                exc,
            )
        return Action.ERROR_TIMEOUT

    def _announce_again(self, admission: Admission, deadline: Deadline) -> None:
        """Write the node's key again (it joined after it withdrew): a participant of
        ours has a key, lest a node waiting for the next round take it for dead. A
        failure is only logged: the node keeps writing its own heartbeat."""
        try:
            admission.announce(deadline)
        except RendezvousError as exc:
            logger.info("The node '%s' could not write its key again (%s).", self._node, exc)

    def _sync(self, deadline: Deadline, retry: Retry) -> _Synced:
        """Read the latest state shared by all nodes, or write ours back (which fails if
        another node synced its changes first). The backend retries etcd failures (an
        election) until the step's deadline, then raises."""
        holder, admission, step = self._holder, self._admission, self._step(deadline)
        fetches = holder.fetches
        try:
            synced = _Synced(holder.sync(step))
        except RequestTooLargeError as exc:
            # etcd refused our state write for its size: tell the nodes it would have
            # admitted (they follow the progress key), then give up ourselves.
            if admission is not None:
                admission.refused(exc, holder.state, holder.token, step)
            raise
        self._state = holder.state
        if admission is not None:
            # Summarise our write in the progress key, or relay a write it misses.
            fetched = holder.fetches != fetches
            admission.synced(self._state, holder.token, synced.value, fetched, step)
        if synced is _Synced.READ:
            return synced
        if synced is _Synced.WRITTEN:
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
            if admission is None or not admission.folding:
                # The aggregator's fold retries at once: it refreshes every node with a
                # key, and each moment it waits more of them may write their own.
                retry.pause()
        record_node_event(self._events, "run", msg, NodeState.RUNNING, self._node)
        logger.debug(msg)
        return synced

    def _context(self) -> Context:
        """What the operation decides on: the state, and the time of its clock."""
        now = self._holder.clock.now()
        return Context(self._node, self._state, self._settings, self._keep_alive_period(), now)

    def _admitted(self, outcome: Changed | Wait | Refresh, deadline: Deadline) -> bool:
        """After the admission took an action (see :meth:`Admission.join`): whether it
        changed the state (to be written); or else read the state first, or wait."""
        if isinstance(outcome, Refresh):
            self._holder.invalidate()  # Read the state the batch needs.
            return False
        if isinstance(outcome, Wait):
            self._wait(deadline, at_most=outcome.seconds)
            return False
        return True

    def _idle(self, deadline: Deadline) -> bool:
        """Nothing to do until another node changes the state (for an admission: by
        admitting us) or one of our deadlines falls due. With node keys, the first node
        of the wait list first takes out the participants whose keys are gone. Whether
        the state changed (to be written)."""
        at_most = math.inf
        if self._admission is not None:
            outcome = self._admission.reap(self._state, self._step(deadline))
            if isinstance(outcome, Changed):
                return True
            at_most = outcome.seconds
        self._wait(deadline, at_most)
        return False

    def _wait(self, deadline: Deadline, at_most: float = math.inf) -> None:
        """Wait for another node to change the state, or until something is due."""
        timeout = min(self._time_to_next_event(deadline), at_most + _WAKE_UP_MARGIN)
        holder, admission, step = self._holder, self._admission, self._step(deadline)
        if admission is not None and admission.follows_progress:
            # Wait on the small progress key; read the state only if it says so.
            heard = admission.wait(self._state, holder.token, timeout, step)
            if heard is Heard.READ:
                holder.invalidate()
            else:
                holder.keep()
            return
        holder.wait_for_change(timeout, step)

    def _timeout_message(self, op: StateHandler) -> str:
        """The error message of ``op`` past its deadline: the run, what the node could not
        do, and the option that limits it."""
        timeout = self._settings.timeout
        what, option, limit = "complete its operation on", "its deadline", None
        if isinstance(op, (JoinOp, ExitOp)):
            what, option, limit = "join", "join_timeout", timeout.join
        elif isinstance(op, CloseOp):
            what, option, limit = "close", "close_timeout", timeout.close
        elif isinstance(op, KeepAliveOp):
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

    # -- timing -------------------------------------------------------------------------

    def _step(self, deadline: Deadline) -> Deadline:
        """The deadline of the requests of one step: the operation's.

        Except for a node on the redundancy list, which waits for a free place without
        a deadline (as in PyTorch): its steps get a join timeout each, so that it rides
        out an etcd election like any other node.
        """
        if self._node in self._holder.state.redundancy_list:
            join = self._settings.timeout.join.total_seconds()
            if deadline.remaining() < join:
                return Deadline(join)
        return deadline

    def _time_to_next_event(self, deadline: Deadline) -> float:
        """Seconds until something may change the decision without a write by another node.

        That is the operation deadline, the last-call deadline, our own next heartbeat
        (in the state, or of our key), or the expiry of another node's heartbeat. Events
        already past are ignored (they were acted upon), and the wait is capped by the
        keep-alive interval.
        """
        state = self._state
        settings = self._settings
        now = self._holder.clock.now()
        waits = [settings.keep_alive_interval.total_seconds(), deadline.remaining()]
        if state.deadline is not None:
            waits.append((state.deadline - now).total_seconds())
        lifetime = settings.keep_alive_interval * settings.keep_alive_max_attempt
        own = self._keep_alive_period()
        for node, last_heartbeat in state.last_heartbeats.items():
            due = last_heartbeat + (own if node == self._node else lifetime)
            waits.append((due - now).total_seconds())
        tick = None if self._admission is None else self._admission.seconds_to_tick()
        if tick is not None:
            waits.append(tick)
        return min((wait for wait in waits if wait > 0), default=POLL_INTERVAL) + _WAKE_UP_MARGIN

    def heartbeat_due(self) -> float | None:
        """Seconds until the node's next heartbeat is due, if sooner than the
        keep-alive interval: its tick (the key's refresh, the aggregator's fold and lock
        renewal), or the age of its heartbeat in the state held at which it must look at
        it (see :meth:`.Admission.heartbeat_due`). ``None``: at the interval, as in
        PyTorch. A heartbeat that comes sooner reads the state afresh (a state read
        within a second would be served from the cache)."""
        admission = self._admission
        if admission is None:
            return None
        dues = [
            admission.heartbeat_due(self._holder.state, self._holder.clock.now()),
            admission.seconds_to_tick(),
        ]
        interval = self._settings.keep_alive_interval.total_seconds()
        due = min((d for d in dues if d is not None), default=interval)
        if due >= interval:
            return None
        self._holder.invalidate()
        return due + _WAKE_UP_MARGIN

    def _keep_alive_period(self) -> timedelta:
        """How old our heartbeat in the state may get before we write it ourselves."""
        interval = self._settings.keep_alive_interval
        return interval if self._admission is None else self._admission.heartbeat_period(interval)
