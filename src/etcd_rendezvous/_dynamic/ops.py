"""The decisions of the dynamic rendezvous: what a node does next, a plain function of the
state it holds.

An operation (:class:`JoinOp`, :class:`ExitOp`, :class:`CloseOp`, :class:`KeepAliveOp`:
PyTorch's ``_RendezvousJoinOp``, ``_RendezvousExitOp``, ``_RendezvousCloseOp`` and
``_RendezvousKeepAliveOp``) looks at a :class:`Context` and the operation's deadline and
returns an :class:`Action`: it reads no backend and changes nothing. The executor
(:mod:`etcd_rendezvous._dynamic.executor`) carries the actions out. The protocol: see
docs/how-it-works.rst, section "The dynamic rendezvous".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from enum import Enum

from .._transport.retry import Deadline
from ..api import RendezvousGracefulExitError
from .clock import LOCAL_CLOCK
from .settings import LOGGER_NAME, RendezvousSettings
from .state import _NodeDesc, _RendezvousState

__all__ = [
    "ADMISSIONS",
    "Action",
    "CloseOp",
    "Context",
    "ExitOp",
    "JoinOp",
    "KeepAliveOp",
    "StateHandler",
    "admission_action",
    "rollback_action",
]

#: Seconds after its deadline during which a joining node that could not complete may
#: still take itself out of the round (PyTorch's rollback period).
ROLLBACK_PERIOD = 5.0

logger = logging.getLogger(LOGGER_NAME)


class Action(Enum):
    """Specifies the possible actions based on the state of the rendezvous (PyTorch's
    ``_Action``)."""

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


class Context:
    """Holds the context of the rendezvous (PyTorch's ``Context``).

    Attributes:
        node: The node descriptor associated with the current rendezvous handler
            instance.
        state: The current state of the rendezvous.
        settings: The rendezvous settings.
        keep_alive_period: How old the node's heartbeat may get before the node
            refreshes it itself: ``keep_alive_interval``, as in PyTorch, unless another
            node refreshes it (see :mod:`etcd_rendezvous._dynamic.admission`).
        now: The time on the clock of the state's times (see
            :mod:`etcd_rendezvous._dynamic.clock`) when the context was made; the local
            wall clock's if not given.
    """

    node: _NodeDesc
    state: _RendezvousState
    settings: RendezvousSettings
    keep_alive_period: timedelta
    now: datetime

    def __init__(
        self,
        node: _NodeDesc,
        state: _RendezvousState,
        settings: RendezvousSettings,
        keep_alive_period: timedelta | None = None,
        now: datetime | None = None,
    ) -> None:
        self.node = node
        self.state = state
        self.settings = settings
        self.keep_alive_period = keep_alive_period or settings.keep_alive_interval
        self.now = now or LOCAL_CLOCK.now()


#: An operation: the next action, from the context and the operation's deadline.
StateHandler = Callable[[Context, Deadline], Action]


def _should_keep_alive(ctx: Context) -> bool:
    """Determine whether a keep-alive heartbeat should be sent."""
    try:
        last_heartbeat = ctx.state.last_heartbeats[ctx.node]
    except KeyError:
        return False

    return last_heartbeat <= ctx.now - ctx.keep_alive_period


#: The actions that add a node to the state (which a batch admission takes for others).
ADMISSIONS = frozenset(
    {Action.ADD_TO_PARTICIPANTS, Action.ADD_TO_WAIT_LIST, Action.ADD_TO_REDUNDANCY_LIST}
)


def admission_action(
    state: _RendezvousState, node: _NodeDesc, settings: RendezvousSettings
) -> Action | None:
    """The action of :class:`JoinOp` that adds ``node`` to ``state``, if it
    takes one (the decision before its deadline: a node past it does not join).

    Not complete: a node that is not a participant joins the participants (leaving the
    wait list). Complete: a node that is not a participant goes to the wait list if the
    round has room, else to the redundancy list (unless it waits already). A closed
    rendezvous and a node on the redundancy list (which leaves it first) add nobody.
    """
    if state.closed or node in state.redundancy_list:
        return None
    if not state.complete:
        return None if node in state.participants else Action.ADD_TO_PARTICIPANTS
    if node in state.participants or node in state.wait_list:
        return None
    if len(state.participants) < settings.max_nodes:
        return Action.ADD_TO_WAIT_LIST
    return Action.ADD_TO_REDUNDANCY_LIST


class ExitOp:
    """Represent a rendezvous exit operation: leave the round the node is a participant
    of when the operation starts.

    Once the round it leaves is over, the operation is done even if the node is a
    participant of the next one: a batch (see :mod:`etcd_rendezvous._dynamic.admission`)
    may take the node out and admit it to the next round in one write.
    """

    def __init__(self) -> None:
        self._round: int | None = None

    def __call__(self, ctx: Context, deadline: Deadline) -> Action:
        state = ctx.state
        if ctx.node in state.participants and self._round in (None, state.round):
            self._round = state.round
            if deadline.expired():
                return Action.ERROR_TIMEOUT
            return Action.REMOVE_FROM_PARTICIPANTS
        return Action.FINISH


def rollback_action(state: _RendezvousState, node: _NodeDesc) -> Action:
    """The next action of ``node`` whose join timed out and which deleted its node key
    (see :meth:`.OpExecutor.run`), on ``state`` read since: FINISH if the round
    completed with it (as PyTorch's join does past its deadline), else take itself out
    of where a batch put it, wherever that is (the redundancy list too: the join is
    over); ``ERROR_TIMEOUT`` if it is in none, ``ERROR_CLOSED`` if the rendezvous is
    closed."""
    if state.closed:
        return Action.ERROR_CLOSED
    if node in state.participants:
        return Action.FINISH if state.complete else Action.REMOVE_FROM_PARTICIPANTS
    if node in state.wait_list:
        return Action.REMOVE_FROM_WAIT_LIST
    if node in state.redundancy_list:
        return Action.REMOVE_FROM_REDUNDANCY_LIST
    return Action.ERROR_TIMEOUT


class JoinOp:
    """Represent a rendezvous join operation.

    Past its deadline, a node that could not complete the round may still take itself
    out for :data:`ROLLBACK_PERIOD` seconds (a deadline the operation sets when it first
    sees the operation's, on ``clock``, the monotonic clock: replaceable in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # The operation's deadline last seen, and the end of its rollback period.
        self._rollback: tuple[Deadline, Deadline] | None = None

    def __call__(self, ctx: Context, deadline: Deadline) -> Action:
        state = ctx.state

        # A closed rendezvous means that it no longer accepts new nodes.
        if state.closed:
            if ctx.node in state.redundancy_list:
                raise RendezvousGracefulExitError(
                    f"The rendezvous '{ctx.settings.run_id}' is closed, terminating pending "
                    "rendezvous."
                )
            return Action.ERROR_CLOSED

        if ctx.node in state.redundancy_list:
            return self._redundant(ctx)

        is_participant = ctx.node in state.participants

        # If we are part of the rendezvous and it is already complete there is no
        # further action to take.
        if state.complete and is_participant:
            return Action.FINISH

        rollback = self._rollback_until(deadline)
        if deadline.expired():
            return self._late(ctx, rollback, is_participant)

        admission = admission_action(state, ctx.node, ctx.settings)
        if admission is not None:
            return admission
        if not state.complete and is_participant and self._may_complete(ctx):
            return Action.MARK_RENDEZVOUS_COMPLETE

        if _should_keep_alive(ctx):
            return Action.KEEP_ALIVE

        # Either the rendezvous is not complete but we are part of it, so we wait for
        # other participants to join; or it is complete but we are not part of it, so we
        # wait for the next round.
        return Action.SYNC

    @staticmethod
    def _redundant(ctx: Context) -> Action:
        """The next action of a node on the redundancy list."""
        state = ctx.state
        logger.debug("The node %s is in redundancy list", ctx.node)
        # Do not apply the timeout logic here, to allow the node to rejoin.
        if len(state.participants) == ctx.settings.max_nodes:
            if _should_keep_alive(ctx):
                return Action.KEEP_ALIVE
            return Action.SYNC
        # Transition to the waiting state that respects timeouts.
        logger.debug("The node %s is removed from redundancy list", ctx.node)
        return Action.REMOVE_FROM_REDUNDANCY_LIST

    def _rollback_until(self, deadline: Deadline) -> Deadline:
        """The end of the rollback period after ``deadline`` (a renewed deadline, for a
        node that left the redundancy list, gets one of its own)."""
        if self._rollback is None or self._rollback[0] is not deadline:
            until = Deadline(deadline.remaining() + ROLLBACK_PERIOD, clock=self._clock)
            self._rollback = (deadline, until)
        return self._rollback[1]

    @staticmethod
    def _late(ctx: Context, rollback: Deadline, is_participant: bool) -> Action:
        """The next action of a node past the operation's deadline: roll back until
        ``rollback``, then time out."""
        # If we still have time to roll back (a short period on top of the operation
        # deadline), try to remove ourselves from the rendezvous. It is okay if we
        # cannot, as our keep-alive will eventually expire.
        if not rollback.expired():
            # A participant could not find enough participants to complete on time.
            if is_participant:
                return Action.REMOVE_FROM_PARTICIPANTS
            # A waiting node could not wait till the next round.
            if ctx.node in ctx.state.wait_list:
                return Action.REMOVE_FROM_WAIT_LIST
        return Action.ERROR_TIMEOUT

    @staticmethod
    def _may_complete(ctx: Context) -> bool:
        """Whether a participant of an incomplete round marks it complete (and if not,
        log why)."""
        state = ctx.state
        # If the rendezvous has enough participants including us, check whether we
        # have passed the last-call deadline. If yes, complete it.
        if (
            ctx.settings.min_nodes <= len(state.participants) <= ctx.settings.max_nodes
            and state.deadline is not None
        ):
            if state.deadline < ctx.now:
                logger.debug(
                    "The node '%s' marking the rendezvous complete, quorum established "
                    "within deadline",
                    ctx.node,
                )
                return True
            logger.debug("The node '%s' can't complete rendezvous: deadline reached", ctx.node)
        else:
            logger.debug(
                "The node '%s' can't complete rendezvous: not enough participants", ctx.node
            )
        return False


class CloseOp:
    """Represent a rendezvous close operation."""

    def __call__(self, ctx: Context, deadline: Deadline) -> Action:
        if ctx.state.closed:
            return Action.FINISH
        if deadline.expired():
            return Action.ERROR_TIMEOUT
        return Action.MARK_RENDEZVOUS_CLOSED


class KeepAliveOp:
    """Represent a rendezvous keep-alive update operation."""

    def __call__(self, ctx: Context, deadline: Deadline) -> Action:
        if _should_keep_alive(ctx):
            if deadline.expired():
                return Action.ERROR_TIMEOUT
            return Action.KEEP_ALIVE
        return Action.FINISH
