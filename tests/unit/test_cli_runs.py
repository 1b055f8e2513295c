"""The operator commands' decisions, without etcd: ``gc``'s durations and which runs it
collects, and ``list``'s idle column."""

from __future__ import annotations

import argparse

import pytest

from etcd_rendezvous.cli._runs import RunSummary
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


def _run(*, finished: bool, idle: float | None, live: int = 0) -> RunSummary:
    return RunSummary(
        backend="etcd-v2" if idle is not None else "etcd",
        run_id="r",
        api="v3",
        status="closed" if finished else "final",
        world_size=2,
        version="1",
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


def test_the_idle_column() -> None:
    assert format_idle(_run(finished=True, idle=90.0)) == "1.5m"
    assert format_idle(_run(finished=True, idle=3.2)) == "3s"
    assert format_idle(_run(finished=True, idle=2 * 86400.0)) == "2.0d"
    assert format_idle(_run(finished=False, idle=None, live=2)) == "-"
    assert format_idle(_run(finished=True, idle=None)) == "?"
