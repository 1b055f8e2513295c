"""Retry and back-off policy shared by the etcd connection and the CAS loops.

A :class:`RetryPolicy` is a value, in the spirit of kazoo's ``KazooRetry``: how long to
wait after the n-th consecutive failure (capped exponential back-off with full jitter)
and what to sleep with. It holds no state, so the few policies the library needs are
module constants (:data:`CONTENTION`, :data:`CONNECTION`, :data:`REWATCH`). Each retry
loop calls :meth:`RetryPolicy.start` with the deadline its caller handed down (the
rendezvous deadline, the store timeout, an explicit ``timeout``) and the error that
names what timed out, and gets a :class:`Retry`, the state of that one loop::

    retry = CONTENTION.start(deadline, lambda: RendezvousTimeoutError(f"... {key!r} ..."))
    while True:
        node = conn.get(key)
        try:
            return conn.compare_and_swap(key, new_value(node), node)
        except CompareFailedError:
            retry.wait()  # sleeps, or raises the error once the deadline has passed

Deadlines are :class:`~etcd_rendezvous.api.Deadline` objects (the public class, which
this module re-exports): a point in monotonic time, computed once and passed down, of
which each wait uses the remaining part.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..api import Deadline, RendezvousTimeoutError

__all__ = ["CONNECTION", "CONTENTION", "REWATCH", "Deadline", "Retry", "RetryPolicy"]

# Past this many failures the window has long reached any sensible cap; stopping the
# exponent here keeps ``multiplier ** failures`` from overflowing a float.
_MAX_EXPONENT = 64


def _window(initial: float, multiplier: float, cap: float, failures: int) -> float:
    """Upper bound of the delay after ``failures + 1`` consecutive failures."""
    return min(cap, initial * multiplier ** min(failures, _MAX_EXPONENT))


@dataclass(frozen=True)
class RetryPolicy:
    """How to back off between attempts: capped exponential back-off with full jitter.

    After the n-th consecutive failure (n = 0, 1, ...) a retry sleeps a uniformly random
    delay in ``[0, min(cap, initial * multiplier**n)]``, so contending writers spread out
    instead of retrying in lock-step, and never past its deadline. The policy is a value:
    :meth:`start` gives each retry loop its own :class:`Retry`.

    Args:
        initial: upper bound of the first delay, in seconds.
        cap: largest upper bound of any delay, in seconds.
        multiplier: growth of the bound per failure.
        sleep: the function that sleeps, replaceable in tests.
        rng: the random generator; the :mod:`random` module's if ``None``.

    Raises:
        ValueError: a parameter is out of range; the message names it.
    """

    initial: float
    cap: float
    multiplier: float = 2.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    rng: random.Random | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise ValueError(f"initial: must be positive, got {self.initial!r}.")
        if not self.cap >= self.initial:
            raise ValueError(f"cap: must be at least initial ({self.initial}), got {self.cap!r}.")
        if not self.multiplier >= 1:
            raise ValueError(f"multiplier: must be at least 1, got {self.multiplier!r}.")

    def window(self, failures: int) -> float:
        """Upper bound of the delay after ``failures + 1`` consecutive failures."""
        return _window(self.initial, self.multiplier, self.cap, failures)

    def delay(self, failures: int) -> float:
        """A random delay in ``[0, window(failures)]`` (full jitter)."""
        uniform = self.rng.uniform if self.rng is not None else random.uniform
        return uniform(0.0, self.window(failures))

    def start(
        self, deadline: Deadline | float, on_timeout: Callable[[], Exception] | None = None
    ) -> Retry:
        """Begin one retry loop that gives up at ``deadline``.

        Args:
            deadline: a :class:`Deadline`, or seconds from now.
            on_timeout: returns the error :meth:`Retry.wait` and :meth:`Retry.check`
                raise once the deadline has passed: the library's error, naming what
                timed out. Loops that handle their deadline themselves (with
                :meth:`Retry.expired` and :meth:`Retry.pause`) may leave it out.
        """
        if not isinstance(deadline, Deadline):
            deadline = Deadline(deadline)
        return Retry(self, deadline, on_timeout)


class Retry:
    """The state of one retry loop: its policy, its deadline and the failures so far.

    Made by :meth:`RetryPolicy.start`; not shared between loops or threads.
    """

    __slots__ = ("_deadline", "_failures", "_on_timeout", "_policy")

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: Deadline,
        on_timeout: Callable[[], Exception] | None = None,
    ) -> None:
        self._policy = policy
        self._deadline = deadline
        self._on_timeout = on_timeout
        self._failures = 0

    @property
    def deadline(self) -> Deadline:
        """When the loop gives up."""
        return self._deadline

    @property
    def failures(self) -> int:
        """Consecutive failures since the start or the last :meth:`reset`."""
        return self._failures

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self._deadline.expired()

    def check(self) -> None:
        """Raise the timeout error if the deadline has passed."""
        if not self._deadline.expired():
            return
        if self._on_timeout is not None:
            raise self._on_timeout()
        raise RendezvousTimeoutError(
            f"Gave up after {self._failures} failed attempts: the deadline of "
            f"{self._deadline.seconds:g} s passed."
        )

    def wait(self) -> None:
        """Back off after a failed attempt, or raise the timeout error if the deadline
        has passed.

        The sleep never goes past the deadline, so the caller makes one last attempt
        at it; if that fails too, this raises.
        """
        self.check()
        self.pause()

    def pause(self) -> None:
        """Back off after a failed attempt without ever raising: for loops in which the
        caller decides what a passed deadline means."""
        delay = min(self._policy.delay(self._failures), self._deadline.remaining())
        self._failures += 1
        if delay > 0:
            self._policy.sleep(delay)

    def reset(self) -> None:
        """Forget past failures (call after a success); the deadline stays."""
        self._failures = 0


#: After losing a compare-and-swap (or create) race on a shared key: retry soon, and
#: spread the contenders out over a window doubling from 5 ms to 250 ms, so that tens of
#: writers mostly succeed instead of colliding again.
CONTENTION = RetryPolicy(initial=0.005, cap=0.25)

#: After a transport failure (etcd unreachable), or before starting a whole attempt
#: over: from 50 ms up to 1 s, to ride out an outage without hammering the endpoints.
CONNECTION = RetryPolicy(initial=0.05, cap=1.0)

#: Before re-reading after a watch that ended without an event (etcd no longer holds the
#: history asked for, or the watch ended early): from 10 ms up to 0.5 s, so that such an
#: anomaly cannot turn into a busy loop.
REWATCH = RetryPolicy(initial=0.01, cap=0.5)
