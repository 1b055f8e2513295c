"""Running calls in threads: several at once, or one in the background."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar, cast

__all__ = ["InThread", "in_threads"]

_T = TypeVar("_T")


def in_threads(call: Callable[[int], _T], count: int) -> list[_T]:
    """Run ``call(i)`` for ``i < count`` in threads at once; their results in order (the
    first exception raised in any of them is raised here)."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(call, range(count)))


class InThread(Generic[_T]):
    """``call()`` started in a daemon thread; :meth:`result` joins it and returns what
    the call returned, or raises what it raised."""

    def __init__(self, call: Callable[[], _T], name: str = "test-call") -> None:
        self._call = call
        self._value: _T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._call()
        except BaseException as exc:
            self._error = exc

    @property
    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return not self._thread.is_alive()

    def result(self, timeout: float) -> _T:
        """Wait up to ``timeout`` seconds for the call; fail the test if it is still
        running, else return its value or raise its exception."""
        self._thread.join(timeout)
        assert self.done, f"{self._thread.name} did not finish within {timeout} s"
        if self._error is not None:
            raise self._error
        return cast(_T, self._value)
