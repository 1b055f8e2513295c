"""Retry and back-off policy shared by the etcd connection and the CAS loops."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Backoff", "Deadline"]


@dataclass
class Backoff:
    """Capped exponential back-off with full jitter.

    ``next_delay()`` returns a random delay in ``[0, min(cap, initial * multiplier**n)]``
    for the n-th consecutive failure, so contending writers spread out instead of
    retrying in lock-step. ``sleep`` is injectable so tests can observe or skip waits.
    """

    initial: float = 0.002
    cap: float = 0.1
    multiplier: float = 2.0
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    _failures: int = 0

    def next_delay(self) -> float:
        """Return the delay to wait after one more consecutive failure."""
        ceiling = min(self.cap, self.initial * self.multiplier**self._failures)
        self._failures += 1
        return self.rng.uniform(0.0, ceiling)

    def wait(self, deadline: Deadline | None = None) -> None:
        """Sleep for the next delay, never past ``deadline``."""
        delay = self.next_delay()
        if deadline is not None:
            delay = min(delay, deadline.remaining())
        if delay > 0:
            self.sleep(delay)

    def reset(self) -> None:
        """Forget past failures (call after a success)."""
        self._failures = 0


class Deadline:
    """A point in monotonic time, computed once and passed down as remaining time."""

    __slots__ = ("_at",)

    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds

    @classmethod
    def never(cls) -> Deadline:
        """A deadline far enough in the future to mean 'no deadline'."""
        return cls(10.0 * 365 * 24 * 3600)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self._at

    def earlier(self, other: Deadline) -> Deadline:
        """The earlier of this deadline and ``other``."""
        return self if self._at <= other._at else other

    def earliest(self, seconds: float) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now."""
        other = Deadline(seconds)
        return self if self._at <= other._at else other
