"""The retry policy: jitter bounds, cap, deadline, injected sleep and clock."""

from __future__ import annotations

import dataclasses
import random

import pytest

from etcd_rendezvous._transport.retry import (
    CONNECTION,
    CONTENTION,
    REWATCH,
    Deadline,
    Retry,
    RetryPolicy,
)
from etcd_rendezvous.api import RendezvousTimeoutError


def wait_until_it_raises(retry: Retry) -> None:
    """A retry loop whose every attempt fails."""
    while True:
        retry.wait()


class FakeTime:
    """A monotonic clock that only moves when something sleeps on it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


def policy(fake: FakeTime, **kwargs: float) -> RetryPolicy:
    kwargs.setdefault("initial", 0.01)
    kwargs.setdefault("cap", 0.5)
    return RetryPolicy(**kwargs, sleep=fake.sleep, rng=random.Random(42))  # type: ignore[arg-type]


class GoneError(Exception):
    """The error a test's retry loop raises at its deadline."""


def test_the_window_doubles_from_initial_up_to_the_cap() -> None:
    p = RetryPolicy(initial=0.01, cap=0.5)
    assert [p.window(n) for n in range(8)] == pytest.approx(
        [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]
    )
    assert RetryPolicy(initial=0.01, cap=0.5, multiplier=3).window(2) == pytest.approx(0.09)
    # Thousands of failures neither overflow nor leave the cap.
    assert p.window(100_000) == 0.5


def test_delays_are_full_jitter_within_the_window() -> None:
    p = RetryPolicy(initial=0.01, cap=0.5, rng=random.Random(7))
    for failures in (0, 3, 6, 50):
        delays = [p.delay(failures) for _ in range(500)]
        window = p.window(failures)
        assert all(0.0 <= d <= window for d in delays)
        # Full jitter: the whole window is used, not just its top.
        assert min(delays) < 0.1 * window
        assert max(delays) > 0.9 * window


def test_a_policy_is_a_value_and_each_start_has_its_own_state(fake: FakeTime) -> None:
    p = policy(fake)
    assert p == dataclasses.replace(p)
    first, second = p.start(Deadline(60, clock=fake.clock)), p.start(60)
    first.pause()
    first.pause()
    assert (first.failures, second.failures) == (2, 0)
    first.reset()
    assert first.failures == 0


def test_sleep_is_injected_and_each_delay_within_its_window(fake: FakeTime) -> None:
    p = policy(fake)
    retry = p.start(Deadline(60, clock=fake.clock), GoneError)
    for _ in range(10):
        retry.wait()
    assert len(fake.sleeps) == 10  # time.sleep was never called: the clock moved instead
    assert all(0 < d <= p.window(n) for n, d in enumerate(fake.sleeps))


def test_wait_gives_up_at_the_deadline_with_the_callers_error(fake: FakeTime) -> None:
    p = policy(fake, initial=0.05, cap=1.0)
    retry = p.start(Deadline(3.0, clock=fake.clock), lambda: GoneError("what timed out"))
    start = fake.now
    with pytest.raises(GoneError, match="what timed out"):
        wait_until_it_raises(retry)
    # Never slept past the deadline; gave up at it, not before.
    assert fake.now - start == pytest.approx(3.0)
    assert sum(fake.sleeps) == pytest.approx(3.0)


def test_wait_raises_at_once_once_expired_without_sleeping(fake: FakeTime) -> None:
    retry = policy(fake).start(Deadline(0.0, clock=fake.clock), GoneError)
    assert retry.expired()
    with pytest.raises(GoneError):
        retry.wait()
    with pytest.raises(GoneError):
        retry.check()
    assert fake.sleeps == []


def test_pause_never_raises_and_never_sleeps_past_the_deadline(fake: FakeTime) -> None:
    retry = policy(fake, initial=0.4, cap=0.4).start(Deadline(1.0, clock=fake.clock))
    for _ in range(20):
        retry.pause()
    assert sum(fake.sleeps) == pytest.approx(1.0)
    assert retry.expired()


def test_without_on_timeout_the_error_is_a_rendezvous_timeout(fake: FakeTime) -> None:
    retry = policy(fake).start(Deadline(0.5, clock=fake.clock))
    with pytest.raises(RendezvousTimeoutError, match=r"deadline of 0.5 s"):
        wait_until_it_raises(retry)


def test_start_takes_seconds_or_a_deadline() -> None:
    retry = CONTENTION.start(30)
    assert isinstance(retry, Retry)
    assert retry.deadline.seconds == 30
    assert 29 < retry.deadline.remaining() <= 30


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"initial": 0, "cap": 1}, "initial"),
        ({"initial": -1, "cap": 1}, "initial"),
        ({"initial": 0.5, "cap": 0.1}, "cap"),
        ({"initial": 0.1, "cap": 1, "multiplier": 0.5}, "multiplier"),
    ],
)
def test_bad_policies_are_refused_naming_the_parameter(kwargs: dict, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        RetryPolicy(**kwargs)


def test_the_named_policies() -> None:
    for named in (CONTENTION, CONNECTION, REWATCH):
        assert isinstance(named, RetryPolicy)
    # Lost races retry sooner than connection failures.
    assert CONTENTION.initial < CONNECTION.initial
    assert CONTENTION.cap <= CONNECTION.cap


def test_deadline_on_an_injected_clock(fake: FakeTime) -> None:
    deadline = Deadline(2.0, clock=fake.clock)
    assert (deadline.seconds, deadline.remaining(), deadline.expired()) == (2.0, 2.0, False)
    assert deadline.earliest(1.0).remaining() == 1.0
    assert deadline.earliest(5.0) is deadline
    fake.now += 2.5
    assert (deadline.remaining(), deadline.expired()) == (0.0, True)


def test_deadline_at_a_monotonic_time(fake: FakeTime) -> None:
    deadline = Deadline.at(fake.now + 4.0, clock=fake.clock)
    assert deadline.remaining() == pytest.approx(4.0)
    assert deadline.seconds == pytest.approx(4.0)
    assert Deadline.never().remaining() > 365 * 24 * 3600
