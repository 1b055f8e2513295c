"""A function run every interval on a background thread: the keep-alive timer of
:class:`~etcd_rendezvous.dynamic_rendezvous.DynamicRendezvousHandler`.

PyTorch's ``_PeriodicTimer`` (``torch.distributed.elastic.rendezvous.utils``), with the
differences its docstring lists.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["_PeriodicTimer"]

logger = logging.getLogger(__name__)


class _PeriodicTimer:
    """Run a function every ``interval`` on a named daemon thread until cancelled.

    As in PyTorch, the thread shares only a context object with the timer, so the timer
    can be garbage collected (which stops the thread through ``weakref.finalize``). Unlike
    PyTorch's, an exception raised by the function is logged and the timer keeps going,
    and the runs start every ``interval`` (not ``interval`` after the previous one
    ended), right away after a run that took longer; a run that returns a number of
    seconds asks for the next run within that many seconds, if that is sooner.

    Args:
        interval: The interval between runs.
        function: The function to run; it returns ``None``, or the seconds within which
            it must run again (sooner than the interval).
        *args: Positional arguments for ``function``.
        **kwargs: Keyword arguments for ``function``.
    """

    class _Context:
        interval: float
        first: float
        function: Callable[..., float | None]
        args: tuple[Any, ...]
        kwargs: dict[str, Any]
        stop_event: threading.Event

    _name: str | None
    _thread: threading.Thread | None
    _finalizer: weakref.finalize[Any, Any] | None
    _ctx: _Context

    def __init__(
        self,
        interval: timedelta,
        function: Callable[..., float | None],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._name = None
        self._ctx = self._Context()
        self._ctx.interval = interval.total_seconds()
        self._ctx.function = function
        self._ctx.args = args
        self._ctx.kwargs = kwargs
        self._ctx.stop_event = threading.Event()
        self._thread = None
        self._finalizer = None

    @property
    def name(self) -> str | None:
        """Get the name of the timer (and of its thread)."""
        return self._name

    @property
    def thread(self) -> threading.Thread | None:
        """The background thread, once started."""
        return self._thread

    def set_name(self, name: str) -> None:
        """Set the name of the timer; must be called before :meth:`start`.

        Raises:
            RuntimeError: The timer has already started.
        """
        if self._thread:
            raise RuntimeError("The timer has already started.")
        self._name = name

    def start(self, *, first: float | None = None) -> None:
        """Start the timer: the first run comes after an interval, or after ``first``
        seconds if that is sooner.

        Raises:
            RuntimeError: The timer has already started.
        """
        if self._thread:
            raise RuntimeError("The timer has already started.")
        self._ctx.first = self._ctx.interval if first is None else min(first, self._ctx.interval)

        self._thread = threading.Thread(
            target=self._run, name=self._name or "PeriodicTimer", args=(self._ctx,), daemon=True
        )
        # weakref.finalize rather than __del__: joining a daemon thread during interpreter
        # shutdown can deadlock, and finalize behaves the same under any GC.
        self._finalizer = weakref.finalize(
            self, self._stop_thread, self._thread, self._ctx.stop_event
        )
        # Do not try to stop the thread at interpreter shutdown; it may be gone.
        self._finalizer.atexit = False
        self._thread.start()

    def cancel(self, timeout: float | None = None) -> bool:
        """Stop the timer and wait for a run in progress to end, for at most ``timeout``
        seconds (``None``: as long as it takes). Returns whether no run is in progress
        any more (a run of the timer's own thread counts as ended). Idempotent: a second
        call waits again."""
        if self._finalizer is not None:
            self._finalizer.detach()
        thread = self._thread
        self._ctx.stop_event.set()
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(None if timeout is None else max(timeout, 0.0))
        return not thread.is_alive()

    @staticmethod
    def _run(ctx: _PeriodicTimer._Context) -> None:
        # Every interval from the start of the previous run (PyTorch waits an interval
        # after each run, so that heartbeats drift by the time they take).
        wait = max(ctx.first, 0.0)
        while not ctx.stop_event.wait(wait):
            started = time.monotonic()
            sooner = None
            try:
                sooner = ctx.function(*ctx.args, **ctx.kwargs)
            except Exception:
                logger.exception("The periodic function %r failed; will run it again", ctx.function)
            wait = max(ctx.interval - (time.monotonic() - started), 0.0)
            if sooner is not None:
                wait = min(wait, max(sooner, 0.0))

    @staticmethod
    def _stop_thread(thread: threading.Thread, stop_event: threading.Event) -> None:
        stop_event.set()
        if thread is not threading.current_thread():
            thread.join()
