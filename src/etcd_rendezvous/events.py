"""Rendezvous events, as PyTorch Elastic's rendezvous handlers record them.

The handlers report what they do as :class:`RdzvEvent` records with PyTorch's names,
node states and messages, named ``<file>:<class>.<method>`` by an :class:`EventSource`.
Each event goes to the callbacks of :func:`add_event_handler`, to the logger
``etcd_rendezvous.events`` at ``DEBUG``, and to PyTorch's
``torch.distributed.elastic.events`` when the process has already loaded it (PyTorch is
never imported for an event). Recording never breaks a rendezvous: a handler that
raises is logged and ignored. The events and where they go: :ref:`rendezvous-events`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, cast

from ._torch_errors import as_torch_error

__all__ = [
    "EventHandler",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "add_event_handler",
    "record_rdzv_event",
    "remove_event_handler",
]

logger = logging.getLogger(__name__)

#: The module PyTorch records rendezvous events through; used only once loaded.
_TORCH_EVENTS = "torch.distributed.elastic.events"

#: The PyTorch event destination of rendezvous events.
_TORCH_DESTINATION = "dynamic_rendezvous"


class NodeState(str, enum.Enum):
    """The state of the node that records an event (PyTorch's ``NodeState`` values)."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclasses.dataclass(frozen=True)
class RdzvEvent:
    """One rendezvous event, with the fields of PyTorch's ``RdzvEvent``."""

    name: str
    """``<file>:<Class>.<method>`` of the code that recorded the event."""
    run_id: str
    """The run id of the rendezvous."""
    message: str
    """What happened, in words (PyTorch's text for the same event)."""
    hostname: str
    """The node's address (the host's FQDN if the recorder had none)."""
    pid: int
    """The process id of the node."""
    node_state: NodeState
    """The state of the node: running, succeeded or failed."""
    master_endpoint: str = ""
    """The master endpoint of the rendezvous store, if known."""
    rank: int | None = None
    """The rank of the node, if known."""
    local_id: int | None = None
    """The node's local id within its process, if known."""
    error_trace: str = ""
    """The traceback being handled, for a ``FAILED`` event."""

    def __str__(self) -> str:
        return self.serialize()

    def serialize(self) -> str:
        """The event as JSON, as PyTorch's ``RdzvEvent.serialize`` writes it."""
        return json.dumps(dataclasses.asdict(self))


#: A callback that receives every rendezvous event of this process.
EventHandler = Callable[[RdzvEvent], None]


class _Handlers:
    """The registered callbacks: a tuple replaced under a lock, read without it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: tuple[EventHandler, ...] = ()

    def add(self, handler: EventHandler) -> None:
        with self._lock:
            self.current = (*self.current, handler)

    def remove(self, handler: EventHandler) -> None:
        with self._lock:
            if handler not in self.current:
                raise ValueError(f"handler: {handler!r} is not a registered event handler.")
            index = self.current.index(handler)
            self.current = self.current[:index] + self.current[index + 1 :]


_handlers = _Handlers()


def add_event_handler(handler: EventHandler) -> None:
    """Call ``handler`` with every rendezvous event recorded in this process.

    ``handler`` runs in the thread that records the event (a caller of the rendezvous
    handler, or its keep-alive thread), so it should return quickly. An exception it
    raises is logged and otherwise ignored. Adding a handler twice calls it twice.
    """
    _handlers.add(handler)


def remove_event_handler(handler: EventHandler) -> None:
    """Stop calling ``handler`` (one registration of it).

    Raises:
        ValueError: ``handler`` is not registered.
    """
    _handlers.remove(handler)


def record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
    *,
    file_name: str = "",
) -> None:
    """Record a rendezvous event, with the arguments of PyTorch's
    ``construct_and_record_rdzv_event`` and PyTorch's defaults for them.

    As in PyTorch, the event is named ``<caller's file name>:<name>`` and ``name``
    defaults to the calling function's name; ``file_name`` (not in PyTorch) replaces
    the caller's file name. This package's handlers name their events explicitly,
    through an :class:`EventSource`.
    """
    caller = sys._getframe(1).f_code
    _emit(
        f"{file_name or os.path.basename(caller.co_filename)}:{name or caller.co_name}",
        run_id=run_id,
        message=message,
        node_state=node_state,
        hostname=hostname,
        pid=pid,
        master_endpoint=master_endpoint,
        local_id=local_id,
        rank=rank,
    )


@dataclasses.dataclass(frozen=True)
class EventSource:
    """The recorder of one handler's events, under the names PyTorch gives them.

    An event recorded through ``source.record("next_rendezvous", ...)`` is named
    ``<file_name>:<class_name>.next_rendezvous``, e.g.
    ``dynamic_rendezvous.py:DynamicRendezvousHandler.next_rendezvous``, or
    ``<file_name>:<method>`` for a module-level function (``class_name`` empty), e.g.
    ``dynamic_rendezvous.py:create_handler``. The names are given, never taken from the
    code (a private class of ours may be renamed; its events keep PyTorch's names).
    """

    file_name: str
    """The file PyTorch records these events from, e.g. ``dynamic_rendezvous.py``."""
    class_name: str
    """The class PyTorch records them from, e.g. ``DynamicRendezvousHandler``; empty
    for a module-level function."""
    run_id: str
    """The run id of the rendezvous."""

    def record(
        self,
        method: str,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        *,
        rank: int | None = None,
        hostname: str = "",
        pid: int | None = None,
        local_id: int | None = None,
    ) -> None:
        """Record an event of ``method``; see :func:`record_rdzv_event` for the rest."""
        owner = f"{self.class_name}." if self.class_name else ""
        _emit(
            f"{self.file_name}:{owner}{method}",
            run_id=self.run_id,
            message=message,
            node_state=node_state,
            hostname=hostname,
            pid=pid,
            local_id=local_id,
            rank=rank,
        )


def _emit(
    name: str,
    *,
    run_id: str,
    message: str,
    node_state: NodeState,
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
) -> None:
    """Build the event and deliver it to PyTorch (if loaded), the callbacks and the log."""
    torch_events = _torch_destination()
    handlers = _handlers.current
    if torch_events is None and not handlers and not logger.isEnabledFor(logging.DEBUG):
        return
    event = RdzvEvent(
        name=name,
        run_id=run_id,
        message=message,
        hostname=hostname or _fqdn(),
        pid=pid or os.getpid(),
        node_state=node_state,
        master_endpoint=master_endpoint,
        rank=rank,
        local_id=local_id,
        error_trace=traceback.format_exc() if node_state == NodeState.FAILED else "",
    )
    if torch_events is not None:
        _deliver(_to_torch, torch_events, event)
    for handler in handlers:
        _deliver(handler, event)
    logger.debug("Rendezvous event: %s", event.serialize())


@functools.lru_cache(maxsize=1)
def _fqdn() -> str:
    """The host's FQDN (looked up once: it may take a DNS query)."""
    return socket.getfqdn()


def _torch_destination() -> ModuleType | None:
    """PyTorch's events module, if loaded and configured to deliver rendezvous events."""
    module = sys.modules.get(_TORCH_EVENTS)
    if module is None:
        return None
    try:
        handler = module.get_logging_handler(_TORCH_DESTINATION)
    except Exception:  # a partly imported or foreign module: nothing to deliver to
        return None
    return None if isinstance(handler, logging.NullHandler) else module


def _to_torch(torch_events: ModuleType, event: RdzvEvent) -> None:
    """Hand ``event`` to PyTorch's event system, as PyTorch's own handler would."""
    fields = {field.name: getattr(event, field.name) for field in dataclasses.fields(event)}
    fields["node_state"] = torch_events.NodeState(event.node_state.value)
    torch_events.record_rdzv_event(torch_events.RdzvEvent(**fields))


def _deliver(handler: Callable[..., Any], *args: Any) -> None:
    """Call ``handler``; log, but never raise, what it raises."""
    try:
        handler(*args)
    except Exception:
        logger.warning(
            "The rendezvous event handler %r raised; ignoring it", handler, exc_info=True
        )


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _records_failure(method: _Method) -> _Method:
    """Make ``method`` record a ``FAILED`` event for any exception it raises, as
    PyTorch's handler does (``"<ExceptionType>: <message>"``), then re-raise it: where
    torch's rendezvous is loaded, this package's rendezvous errors as torch's too (see
    :func:`etcd_rendezvous._torch_errors.as_torch_error`), so torch's agent catches them.

    For methods of classes with a ``_record(message, node_state, *, method)`` method.
    """

    @functools.wraps(method)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            self._record(
                message=f"{type(e).__name__}: {e}",
                node_state=NodeState.FAILED,
                method=method.__name__,
            )
            as_torch_error(e)
            raise

    return cast(_Method, recorded)
