"""Progress of a waiting ``next_rendezvous()``, logged at INFO at a steady pace.

A rendezvous may wait for minutes (PyTorch's default timeouts are 600 and 900 s) and the
state changes it logs say nothing while nobody comes. While a call waits, a named
daemon thread logs, every :func:`progress_interval` seconds, a line the backend
composes from the state it last read (no etcd request of its own): how many nodes are
in, what it waits for, and how long is left. The thread ends with the call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = [
    "PROGRESS_INTERVAL_BOUNDS",
    "PROGRESS_THREAD_PREFIX",
    "ProgressLog",
    "progress_interval",
    "seconds_left",
]

logger = logging.getLogger(__name__)

#: What the name of a progress thread starts with (the run id follows).
PROGRESS_THREAD_PREFIX = "etcd-rendezvous-progress-"
#: The shortest and longest interval between two progress lines, in seconds.
PROGRESS_INTERVAL_BOUNDS = (5.0, 60.0)
#: A rendezvous timeout is covered by about this many progress lines.
_LINES_PER_TIMEOUT = 20


def progress_interval(timeout: float) -> float:
    """Seconds between progress lines for a rendezvous of ``timeout`` seconds: a
    twentieth of it, within :data:`PROGRESS_INTERVAL_BOUNDS` (30 s for 600 s)."""
    low, high = PROGRESS_INTERVAL_BOUNDS
    return min(high, max(low, timeout / _LINES_PER_TIMEOUT))


def seconds_left(remaining: float) -> str:
    """``"540 s left"``: the remaining time as a progress line ends with it."""
    return f"{max(0.0, remaining):.0f} s left"


class ProgressLog:
    """Log ``describe()`` at INFO every ``interval`` seconds until closed (a context
    manager). ``describe`` returns ``None`` for nothing to say; an exception it raises is
    logged at DEBUG and the next line is tried at the next interval.

    Args:
        describe: composes the line from what the caller last read.
        interval: seconds between lines; the first comes after one interval.
        run_id: the run's id, in the thread's name (after :data:`PROGRESS_THREAD_PREFIX`).
        log: the logger of the lines (the backend's module logger).
    """

    def __init__(
        self,
        describe: Callable[[], str | None],
        interval: float,
        run_id: str,
        log: logging.Logger = logger,
    ) -> None:
        self._describe = describe
        self._log = log
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{PROGRESS_THREAD_PREFIX}{run_id}", daemon=True
        )
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        """Start the thread (once; again is a no-op)."""
        with self._lock:
            if self._started or self._stop.is_set():
                return
            self._started = True
            self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        with self._lock:
            self._stop.set()
            started = self._started
        if started and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> ProgressLog:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                line = self._describe()
            except Exception:  # a racy read of a state being replaced: try again later
                logger.debug("Could not describe the rendezvous progress", exc_info=True)
                continue
            if line and not self._stop.is_set():
                self._log.info(line)
