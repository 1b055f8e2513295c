"""The settings of a dynamic rendezvous, and what all the parts of its handler share.

Re-exported by :mod:`etcd_rendezvous.dynamic_rendezvous` (users import
:class:`RendezvousTimeout` and :class:`RendezvousSettings` from there). The parts of the
handler log and name their events as that public module, as PyTorch's do
(:data:`LOGGER_NAME`, :func:`event_source`); they read the time from one clock, the
state holder's (:mod:`etcd_rendezvous._dynamic.clock`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from ..events import EventSource, NodeState
from .state import _NodeDesc

__all__ = [
    "EVENT_FILE",
    "EXECUTOR_EVENTS",
    "LOGGER_NAME",
    "STATE_HOLDER_EVENTS",
    "RendezvousSettings",
    "RendezvousTimeout",
    "event_source",
    "record_node_event",
]

#: The logger of the dynamic rendezvous, whichever of its modules logs: the public
#: module's, whose debug log users turn on (and which one event depends on).
LOGGER_NAME = "etcd_rendezvous.dynamic_rendezvous"

#: The file the events of the dynamic rendezvous are named after, whichever of its
#: modules records them: ``dynamic_rendezvous.py:<Class>.<method>``, PyTorch's names.
EVENT_FILE = LOGGER_NAME.rpartition(".")[2] + ".py"


#: PyTorch's names of the private classes whose events ours record: constants, so that
#: renaming one of ours cannot rename its events. (The public handler's events carry
#: the name of its class, or of a subclass, as PyTorch's do.)
EXECUTOR_EVENTS = "_DistributedRendezvousOpExecutor"
STATE_HOLDER_EVENTS = "_BackendRendezvousStateHolder"


def event_source(class_name: str, run_id: str) -> EventSource:
    """The recorder of the events PyTorch records from its class ``class_name`` (``""``:
    from a module-level function): ``dynamic_rendezvous.py:<class_name>.<method>``."""
    return EventSource(EVENT_FILE, class_name, run_id)


def record_node_event(
    events: EventSource,
    method: str,
    message: str,
    node_state: NodeState,
    node: _NodeDesc,
    *,
    rank: int | None = None,
) -> None:
    """Record an event of ``method`` for ``node`` (its address, process and local id)."""
    events.record(
        method,
        message,
        node_state,
        rank=rank,
        hostname=node.addr,
        pid=node.pid,
        local_id=node.local_id,
    )


class RendezvousTimeout:
    """Hold the timeout configuration of a rendezvous.

    Args:
        join: The time within which the rendezvous is expected to complete.
        last_call: An additional wait amount before completing the rendezvous once the
            rendezvous has the minimum number of required participants.
        close: The time within which the rendezvous is expected to close after a call
            to :meth:`RendezvousHandler.set_closed` or
            :meth:`RendezvousHandler.shutdown`.
        heartbeat: The time within which a keep-alive heartbeat is expected to
            complete.

    Raises:
        ValueError: A timeout is not positive; the message names it.
    """

    _ZERO = timedelta(0)

    _DEFAULT_TIMEOUTS: ClassVar[dict[str, timedelta]] = {
        "join": timedelta(seconds=600),
        "last_call": timedelta(seconds=30),
        "close": timedelta(seconds=30),
        "heartbeat": timedelta(seconds=5),
    }

    _join: timedelta
    _last_call: timedelta
    _close: timedelta
    _heartbeat: timedelta

    def __init__(
        self,
        join: timedelta | None = None,
        last_call: timedelta | None = None,
        close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> None:
        self._set_timeouts(join=join, last_call=last_call, close=close, heartbeat=heartbeat)

    @property
    def join(self) -> timedelta:
        """Get the join timeout."""
        return self._join

    @property
    def last_call(self) -> timedelta:
        """Get the last call timeout."""
        return self._last_call

    @property
    def close(self) -> timedelta:
        """Get the close timeout."""
        return self._close

    @property
    def heartbeat(self) -> timedelta:
        """Get the keep-alive heartbeat timeout."""
        return self._heartbeat

    def _set_timeouts(self, **timeouts: timedelta | None) -> None:
        for name, timeout in timeouts.items():
            value = self._DEFAULT_TIMEOUTS[name] if timeout is None else timeout
            if value <= self._ZERO:
                raise ValueError(f"The {name} timeout ({value}) must be positive.")
            setattr(self, "_" + name, value)


@dataclass(repr=False, eq=False, frozen=True)
class RendezvousSettings:
    """Hold the settings of the rendezvous.

    Attributes:
        run_id: The run id of the rendezvous.
        min_nodes: The minimum number of nodes to admit to the rendezvous.
        max_nodes: The maximum number of nodes to admit to the rendezvous.
        timeout (RendezvousTimeout): The timeout configuration of the rendezvous.
        keep_alive_interval: The amount of time a node waits before sending a
            heartbeat to keep it alive in the rendezvous.
        keep_alive_max_attempt: The maximum number of failed heartbeat attempts after
            which a node is considered dead.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int
