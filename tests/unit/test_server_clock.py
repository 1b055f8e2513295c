"""etcd's clock as a connection learns it from the ``Date`` of etcd's answers
(:class:`~etcd_rendezvous._transport.clock.ServerClock`), and the dynamic rendezvous'
warning when this host's clock is off (:class:`~etcd_rendezvous._dynamic.clock.EtcdClock`),
with fake clocks."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from etcd_rendezvous._dynamic.clock import EtcdClock, LocalClock, state_clock
from etcd_rendezvous._transport.clock import MAX_ROUND_TRIP, WINDOW, ServerClock
from etcd_rendezvous.dynamic_rendezvous import RendezvousSettings, RendezvousTimeout

#: etcd's time when the tests start, whole seconds, as the ``Date`` header has it.
ETCD = 1_800_000_000


class Times:
    """A local wall clock and monotonic clock that the test moves."""

    def __init__(self, wall: float, monotonic: float = 1000.0) -> None:
        self.wall = wall
        self.monotonic = monotonic

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic += seconds

    def clock(self) -> ServerClock:
        return ServerClock(wall=lambda: self.wall, monotonic=lambda: self.monotonic)


def date(seconds: float) -> str:
    """The ``Date`` header of an answer etcd wrote at ``seconds`` (truncated, as Go does)."""
    return format_datetime(datetime.fromtimestamp(int(seconds), timezone.utc), usegmt=True)


def answer(clock: ServerClock, times: Times, etcd: float, rtt: float = 0.02) -> None:
    """A request sent now, answered by etcd at its time ``etcd`` half a round trip later,
    received a round trip after it was sent (the local clocks move on by ``rtt``)."""
    sent = times.monotonic
    times.advance(rtt)
    clock.sample(date(etcd), sent, times.monotonic)


def test_before_any_answer_it_is_the_local_wall_clock() -> None:
    times = Times(wall=ETCD + 6.3)
    clock = times.clock()
    assert not clock.synced
    assert clock.bounds is None
    assert clock.offset() is None
    assert clock.time() == ETCD + 6.3
    assert clock.now() == datetime.fromtimestamp(ETCD + 6.3, timezone.utc)


def test_one_answer_bounds_etcds_time_between_the_send_and_the_receipt() -> None:
    times = Times(wall=ETCD - 6.0, monotonic=500.0)  # this host is 6 s behind
    clock = times.clock()
    clock.sample(date(ETCD + 0.7), sent=500.0, received=500.1)
    # etcd's time minus the monotonic clock: [D - t1, D + 1 - t0].
    assert clock.bounds == pytest.approx((ETCD - 500.1, ETCD + 1 - 500.0))
    assert clock.synced
    # The middle of the interval: etcd's time now, within half its width.
    assert clock.time() == pytest.approx(500.0 + ETCD + 0.45 - 500.0)
    assert clock.offset() == pytest.approx(6.45)


def test_answers_narrow_the_interval_down_to_about_a_round_trip() -> None:
    times = Times(wall=ETCD + 0.37 + 30)  # this host is 30 s ahead; etcd at ETCD + 0.37
    clock = times.clock()
    etcd = ETCD + 0.37
    widths = []
    for _ in range(30):
        answer(clock, times, etcd + 0.01)
        etcd += 0.02 + 0.05  # answers at every phase of etcd's second
        times.advance(0.05)
        low, high = clock.bounds or (0.0, 0.0)
        widths.append(high - low)
    assert widths[0] == pytest.approx(1.02)
    assert widths == sorted(widths, reverse=True)
    assert widths[-1] < 0.1  # the round trip and the spacing of the answers
    assert clock.time() == pytest.approx(etcd, abs=0.05)
    assert clock.offset() == pytest.approx(-30, abs=0.05)


def test_a_sample_that_disagrees_restarts_the_estimate_from_it() -> None:
    """etcd's clock stepped, or the connection failed over to a member whose clock
    differs: the estimate follows the newest answer at once."""
    times = Times(wall=ETCD)
    clock = times.clock()
    for step in range(5):
        answer(clock, times, ETCD + 0.3 * step)
        times.advance(0.28)
    assert clock.time() == pytest.approx(times.wall, abs=0.1)
    answer(clock, times, times.wall + 5)  # this member is 5 s ahead
    low, high = clock.bounds or (0.0, 0.0)
    assert high - low == pytest.approx(1.02)
    assert clock.time() == pytest.approx(times.wall + 5 + 0.5, abs=0.6)


def test_old_samples_leave_the_window() -> None:
    """A drift (or a slew) too slow to break the intersection does not pin the estimate:
    samples older than the window no longer count."""
    times = Times(wall=ETCD)
    clock = times.clock()
    answer(clock, times, ETCD + 0.99)  # etcd's time lies in [ETCD + 0.97, ETCD + 1.99]
    times.advance(WINDOW + 1)
    answer(clock, times, times.wall + 0.01)  # only this sample counts now
    low, high = clock.bounds or (0.0, 0.0)
    assert high - low == pytest.approx(1.02)


def test_a_step_of_the_local_wall_clock_does_not_move_etcds_time() -> None:
    times = Times(wall=ETCD + 0.5)
    clock = times.clock()
    answer(clock, times, ETCD + 0.51)
    before = clock.time()
    times.wall -= 3600  # NTP steps this host's clock back an hour
    assert clock.time() == before
    assert clock.offset() == pytest.approx(3600, abs=1)


@pytest.mark.parametrize("header", [None, "", "yesterday", "Sun, 99 Foo 2026 03:48:43 GMT"])
def test_an_answer_without_a_date_teaches_nothing(header: str | None) -> None:
    times = Times(wall=ETCD)
    clock = times.clock()
    clock.sample(header, 1000.0, 1000.1)
    assert not clock.synced


def test_a_receipt_before_the_send_teaches_nothing() -> None:
    clock = Times(wall=ETCD).clock()
    clock.sample(date(ETCD), 1000.1, 1000.0)
    assert not clock.synced


def test_the_date_of_etcds_answers_parses() -> None:
    clock = Times(wall=0, monotonic=0).clock()
    clock.sample("Sun, 29 Nov 2026 03:48:43 GMT", 0.0, 0.0)
    expected = datetime(2026, 11, 29, 3, 48, 43, tzinfo=timezone.utc).timestamp()
    assert clock.bounds == (expected, expected + 1)


# -- the warning ---------------------------------------------------------------------------


def settings() -> RendezvousSettings:
    return RendezvousSettings("run-7", 1, 3, RendezvousTimeout(), timedelta(seconds=5), 3)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_host_whose_clock_is_off_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    times = Times(wall=ETCD - 6.0)
    server = times.clock()
    clock = EtcdClock(server, settings())
    clock.now()  # no answer yet: nothing to compare with
    answer(server, times, ETCD + 0.5)
    assert clock.now() == server.now()
    clock.now()
    (message,) = warnings(caplog)
    # etcd's time is known to half a second: ETCD + 0.51 against ETCD - 5.98 here.
    assert "The wall clock of this host is 6.5 s behind etcd's" in message
    assert "'run-7'" in message
    assert "etcd's time" in message
    assert "PyTorch's own nodes" in message
    assert "(10 s)" in message


def test_the_warning_comes_again_when_the_offset_changes_a_lot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    times = Times(wall=ETCD + 0.5)
    server = times.clock()
    clock = EtcdClock(server, settings())
    answer(server, times, ETCD + 0.5)
    clock.now()
    assert warnings(caplog) == []  # in step with etcd
    times.wall += 4  # this host's clock jumps 4 s ahead
    clock.now()
    times.wall += 1  # a little more: the same news
    clock.now()
    times.wall -= 10  # now 5 s behind
    clock.now()
    messages = warnings(caplog)
    assert len(messages) == 2
    assert "ahead of etcd's" in messages[0]
    assert "behind etcd's" in messages[1]


def test_only_a_backend_on_this_packages_connection_gets_etcds_clock() -> None:
    class Backend:
        name = "memory"

    assert isinstance(state_clock(Backend(), settings()), LocalClock)


def test_a_slow_answer_teaches_nothing() -> None:
    """An answer that took more than a second would widen the interval too much."""
    times = Times(wall=ETCD)
    clock = times.clock()
    answer(clock, times, ETCD + 0.5, rtt=MAX_ROUND_TRIP + 0.1)
    assert not clock.synced
    answer(clock, times, ETCD + 1.7, rtt=MAX_ROUND_TRIP)
    assert clock.synced
