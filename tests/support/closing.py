"""A fixture's factory whose products are all closed after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

__all__ = ["closing_factory"]

P = ParamSpec("P")
T = TypeVar("T")


@contextmanager
def closing_factory(make: Callable[P, T], close: Callable[[T], object]) -> Iterator[Callable[P, T]]:
    """Yield ``make`` recording what it returns; on exit ``close`` each, in the order made."""
    made: list[T] = []

    def recorded(*args: P.args, **kwargs: P.kwargs) -> T:
        made.append(make(*args, **kwargs))
        return made[-1]

    try:
        yield recorded
    finally:
        for thing in made:
            close(thing)
