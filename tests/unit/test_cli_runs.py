"""The operator commands' decisions, without etcd: when a run is finished, when a
heartbeat is recent, ``gc``'s durations and which runs it collects, and ``list``'s idle
column."""

from __future__ import annotations

import argparse

import pytest

from etcd_rendezvous.cli._runs import (
    CLOCK_SKEW_MARGIN_SECONDS,
    HEARTBEAT_LIVE_SECONDS,
    RunSummary,
    heartbeat_is_live,
    run_finished,
)
from etcd_rendezvous.cli.gc import _collectable, duration
from etcd_rendezvous.cli.list_runs import format_idle


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("0", 0), ("30s", 30), ("30m", 1800), ("1.5h", 5400), ("7d", 604800)],
)
def test_durations(text: str, seconds: float) -> None:
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "-5", "5w", "1h30m", "h"])
def test_bad_durations_name_the_value(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
        duration(text)


@pytest.mark.parametrize(
    ("live", "joining", "waiting", "finished"),
    [
        (0, False, 0, True),  # nobody left, whatever the status (closed or not)
        (2, False, 0, False),  # closed with live workers: still in their exit barrier
        (1, False, 0, False),  # one worker (or one recent heartbeat) left
        (0, True, 0, False),  # a joining state (with its TTL): someone is joining
        (0, False, 3, False),  # PyTorch workers waiting on a final state write no key
        (2, True, 1, False),
    ],
)
def test_when_a_run_is_finished(live: int, joining: bool, waiting: int, finished: bool) -> None:
    assert run_finished(live=live, joining=joining, waiting=waiting) is finished


@pytest.mark.parametrize(
    ("age", "live"),
    [
        (0.0, True),
        (-30.0, True),  # the operator's clock behind the workers'
        (HEARTBEAT_LIVE_SECONDS, True),  # within the clock margin
        (HEARTBEAT_LIVE_SECONDS + CLOCK_SKEW_MARGIN_SECONDS - 0.1, True),
        (HEARTBEAT_LIVE_SECONDS + CLOCK_SKEW_MARGIN_SECONDS, False),
        (3600.0, False),
    ],
)
def test_when_a_heartbeat_is_recent(age: float, live: bool) -> None:
    assert heartbeat_is_live(age) is live


def _run(
    *,
    finished: bool,
    idle: float | None,
    live: int = 0,
    world_size: int = 2,
    version: str | None = "1",
) -> RunSummary:
    return RunSummary(
        backend="etcd-v2" if idle is not None else "etcd",
        run_id="r",
        api="v3",
        status="closed" if finished else "final",
        world_size=world_size,
        version=version,
        live=live,
        idle_seconds=idle,
        finished=finished,
    )


@pytest.mark.parametrize(
    ("finished", "idle", "undated", "collected"),
    [
        (False, 1e9, True, False),  # never a run that is not finished, however idle
        (True, 3600.0, False, True),  # idle for exactly --older-than
        (True, 3599.0, True, False),  # not idle long enough
        (True, None, False, False),  # no age: only with --undated
        (True, None, True, True),
    ],
)
def test_which_runs_gc_collects(
    finished: bool, idle: float | None, undated: bool, collected: bool
) -> None:
    assert _collectable(_run(finished=finished, idle=idle), 3600.0, undated) is collected


@pytest.mark.parametrize("version", [None, "0"])  # etcd (no version), etcd-v2 (round 0)
def test_gc_keeps_a_run_closed_before_it_started_unless_forced(version: str | None) -> None:
    planned = _run(finished=True, idle=None, world_size=0, version=version)
    assert planned.never_started
    assert not _collectable(planned, 0.0, True)
    assert _collectable(planned, 0.0, True, force=True)
    # A run closed after its workers took part in it is an ordinary finished run.
    assert not _run(finished=True, idle=None).never_started


def test_the_idle_column() -> None:
    assert format_idle(_run(finished=True, idle=90.0)) == "1.5m"
    assert format_idle(_run(finished=True, idle=3.2)) == "3s"
    assert format_idle(_run(finished=True, idle=2 * 86400.0)) == "2.0d"
    assert format_idle(_run(finished=False, idle=None, live=2)) == "-"
    assert format_idle(_run(finished=True, idle=None)) == "?"
