"""Collecting rendezvous events on PyTorch's side, as an agent's event handler does.

PyTorch delivers rendezvous events to the handler of its ``dynamic_rendezvous``
destination, ``torch.distributed.elastic.events.handlers._log_handlers["dynamic_rendezvous"]``
(a ``NullHandler`` by default, which drops them). :func:`torch_event_destination`
installs a collecting handler there for the duration of a test.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DESTINATION = "dynamic_rendezvous"


class EventLog(logging.Handler):
    """A logging handler keeping the events PyTorch hands it, as decoded JSON."""

    def __init__(self) -> None:
        super().__init__()
        self._events_lock = threading.Lock()
        self._events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self._events_lock:
            self._events.append(json.loads(record.getMessage()))

    def events(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """The events received so far, of ``run_id`` if given."""
        with self._events_lock:
            return [e for e in self._events if run_id is None or e["run_id"] == run_id]


@contextmanager
def torch_event_destination(handler: logging.Handler) -> Iterator[None]:
    """Make ``handler`` PyTorch's rendezvous event destination, then restore the old one."""
    import torch.distributed.elastic.events as torch_events
    from torch.distributed.elastic.events import handlers

    previous = handlers._log_handlers[DESTINATION]
    # PyTorch caches one logger per destination, with the handler it had when created.
    torch_events._events_loggers.pop(DESTINATION, None)
    handlers._log_handlers[DESTINATION] = handler
    try:
        yield
    finally:
        handlers._log_handlers[DESTINATION] = previous
        logger = torch_events._events_loggers.pop(DESTINATION, None)
        if logger is not None:
            logger.removeHandler(handler)
