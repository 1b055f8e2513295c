"""``torchrun`` whose agent collects rendezvous events, as an agent's event handler does.

Run as ``python tests/support/scripts/event_agent.py <torchrun arguments>`` with
``EVENTS_FILE`` set: the agent installs a handler for PyTorch's ``dynamic_rendezvous``
event destination (``torch.distributed.elastic.events.handlers._log_handlers``) that
appends every event it receives, as one JSON line, to ``EVENTS_FILE``; then it runs
``torchrun``'s ``main()``.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.elastic.events import handlers
from torch.distributed.run import main


class JsonLines(logging.Handler):
    """Appends each event (PyTorch logs its JSON) as a line of a file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def emit(self, record: logging.LogRecord) -> None:
        with open(self._path, "a", encoding="utf-8") as out:
            out.write(record.getMessage() + "\n")


if __name__ == "__main__":
    handlers._log_handlers["dynamic_rendezvous"] = JsonLines(os.environ["EVENTS_FILE"])
    main()
