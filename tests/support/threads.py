"""Running the same call in several threads at once."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["in_threads"]

_T = TypeVar("_T")


def in_threads(call: Callable[[int], _T], count: int) -> list[_T]:
    """Run ``call(i)`` for ``i < count`` in threads at once; their results in order (the
    first exception raised in any of them is raised here)."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(call, range(count)))
