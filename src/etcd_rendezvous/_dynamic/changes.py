"""The changes a node makes to the state of a dynamic rendezvous: PyTorch's actions
(:class:`~etcd_rendezvous._dynamic.ops.Action`) carried out on a state in memory.

:class:`Changes` makes them for one node: on itself (what PyTorch's executor does), or,
in a batch (:mod:`etcd_rendezvous._dynamic.admission`), on other nodes. No I/O: the
caller writes the state. Each change is logged, and recorded as PyTorch's event when
the node makes it on itself (a node admitted by another records its own).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..events import NodeState
from .clock import Clock
from .ops import Action
from .settings import (
    EXECUTOR_EVENTS,
    LOGGER_NAME,
    RendezvousSettings,
    event_source,
    record_node_event,
)
from .state import _NodeDesc, _RendezvousState

__all__ = ["Changes", "remove_participant_epilogue"]

logger = logging.getLogger(LOGGER_NAME)


def remove_participant_epilogue(state: _RendezvousState, settings: RendezvousSettings) -> None:
    """Fix up the round after participants left (a node left, or was dropped)."""
    if state.complete:
        # If we do not have any participants left, move to the next round.
        if not state.participants:
            logger.debug("No participants left in the rendezvous, marking rendezvous as incomplete")
            state.complete = False
            state.round += 1
    elif len(state.participants) < settings.min_nodes:
        logger.debug(
            "Number of participants %d less than min_nodes %d, clearing deadline in state",
            len(state.participants),
            settings.min_nodes,
        )
        state.deadline = None


class Changes:
    """The changes node ``node`` makes to a state, with the times of ``clock`` (the
    clock of the state's times, see :mod:`etcd_rendezvous._dynamic.clock`)."""

    def __init__(self, node: _NodeDesc, settings: RendezvousSettings, clock: Clock) -> None:
        self._node = node
        self._settings = settings
        self._clock = clock
        # PyTorch records these events from its executor: they keep its class's name.
        self._events = event_source(EXECUTOR_EVENTS, settings.run_id)

    def apply(self, state: _RendezvousState, action: Action) -> None:
        """Carry out the node's own ``action`` on ``state``."""
        node = self._node
        if action == Action.KEEP_ALIVE:
            self.keep_alive(state, node)
        elif action in (
            Action.ADD_TO_PARTICIPANTS,
            Action.ADD_TO_WAIT_LIST,
            Action.ADD_TO_REDUNDANCY_LIST,
        ):
            self.admit(state, node, action)
        elif action == Action.REMOVE_FROM_PARTICIPANTS:
            self.remove_from_participants(state, node)
        elif action == Action.REMOVE_FROM_WAIT_LIST:
            self._remove_itself(state, "_remove_from_wait_list", "wait list", state.wait_list)
        elif action == Action.REMOVE_FROM_REDUNDANCY_LIST:
            # "redundant list": PyTorch's wording of this one message.
            self._remove_itself(
                state, "_remove_from_redundancy_list", "redundant list", state.redundancy_list
            )
        elif action == Action.MARK_RENDEZVOUS_COMPLETE:
            self.mark_complete(state)
        elif action == Action.MARK_RENDEZVOUS_CLOSED:
            self._mark_closed(state)

    def admit(self, state: _RendezvousState, node: _NodeDesc, action: Action) -> None:
        """Carry out the admission ``action`` (an ``ADD_TO_*``) for ``node``."""
        if action == Action.ADD_TO_PARTICIPANTS:
            self._add_to_participants(state, node)
        elif action == Action.ADD_TO_WAIT_LIST:
            state.redundancy_list.discard(node)
            self._add_to_list(state, node, "_add_to_wait_list", "wait list", state.wait_list)
        elif action == Action.ADD_TO_REDUNDANCY_LIST:
            lists = state.redundancy_list
            self._add_to_list(state, node, "_add_to_redundancy_list", "redundancy list", lists)

    def keep_alive(self, state: _RendezvousState, node: _NodeDesc) -> None:
        """Set the heartbeat of ``node`` to now; another node's never moves back: whoever
        wrote it last may have had a later clock, and moving it back could drop it."""
        whose = "its" if node == self._node else "the"
        of = "" if node == self._node else f" of the node '{node}'"
        msg = (
            f"The node '{self._node}' updated {whose} keep-alive heartbeat time{of} for the "
            f"rendezvous '{self._settings.run_id}'. Pending sync."
        )
        self._tell("_keep_alive", node, msg)
        now, heartbeats = self._clock.now(), state.last_heartbeats
        heartbeats[node] = now if node == self._node else max(heartbeats.get(node, now), now)

    def refresh(self, state: _RendezvousState, nodes: Iterable[_NodeDesc]) -> None:
        """Set the heartbeats ``state`` holds of ``nodes`` (their keys are alive) to now,
        never back (see :meth:`keep_alive`): the aggregator's fold, and a batch's."""
        now, heartbeats = self._clock.now(), state.last_heartbeats
        for node in nodes:
            if node in heartbeats:
                heartbeats[node] = max(heartbeats[node], now)

    def remove_from_participants(self, state: _RendezvousState, node: _NodeDesc) -> None:
        """Take ``node`` out of the round (it leaves, or its key is gone)."""
        change = f"removed {self._whom(node)} from the participants"
        self._tell("_remove_from_participants", node, self._pending(change, state.round))
        del state.participants[node]
        state.last_heartbeats.pop(node, None)
        remove_participant_epilogue(state, self._settings)

    def mark_complete(self, state: _RendezvousState) -> None:
        """Complete the round: rank the participants in node order."""
        msg = (
            f"The node '{self._node}' marked round {state.round} of the rendezvous "
            f"'{self._settings.run_id}' as complete. Pending sync."
        )
        self._record("_mark_rendezvous_complete", msg, NodeState.SUCCEEDED)
        logger.debug(msg)
        state.complete = True
        state.deadline = None
        for rank, node in enumerate(sorted(state.participants)):
            state.participants[node] = rank

    # -- the changes --------------------------------------------------------------------

    def _add_to_participants(self, state: _RendezvousState, node: _NodeDesc) -> None:
        change = f"added {self._whom(node)} to the participants"
        self._tell("_add_to_participants", node, self._pending(change, state.round))
        state.wait_list.discard(node)
        # The ranks of the participants will be set once the rendezvous is complete.
        state.participants[node] = 0
        self.keep_alive(state, node)
        if len(state.participants) == self._settings.min_nodes:
            state.deadline = self._clock.now() + self._settings.timeout.last_call
        if len(state.participants) == self._settings.max_nodes:
            self.mark_complete(state)

    def _add_to_list(
        self,
        state: _RendezvousState,
        node: _NodeDesc,
        method: str,
        name: str,
        nodes: set[_NodeDesc],
    ) -> None:
        """Put ``node`` on the wait or redundancy list ``nodes`` (called ``name``)."""
        change = f"added {self._whom(node)} to the {name}"
        self._tell(method, node, self._pending(change, state.round + 1))
        nodes.add(node)
        self.keep_alive(state, node)

    def _remove_itself(
        self, state: _RendezvousState, method: str, name: str, nodes: set[_NodeDesc]
    ) -> None:
        """Take this node off the wait or redundancy list ``nodes`` (called ``name``)."""
        change = f"removed itself from the {name}"
        self._tell(method, self._node, self._pending(change, state.round + 1))
        nodes.remove(self._node)
        del state.last_heartbeats[self._node]

    def _mark_closed(self, state: _RendezvousState) -> None:
        msg = (
            f"The node '{self._node}' marked the rendezvous '{self._settings.run_id}' as "
            "closed. Pending sync."
        )
        self._record("_mark_rendezvous_closed", msg, NodeState.SUCCEEDED)
        logger.debug(msg)
        state.closed = True

    # -- the messages --------------------------------------------------------------------

    def _record(self, method: str, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        record_node_event(self._events, method, message, node_state, self._node)

    def _tell(self, method: str, node: _NodeDesc, msg: str) -> None:
        """Record the event of ``method``, a change for ``node``; for a change of another
        node (in a batch), only log it: that node records its own."""
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
