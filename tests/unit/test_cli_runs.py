"""The operator commands' decisions, without etcd: when a run is finished (closed, and
quiet by etcd's clock and keys with lifetimes), the heartbeat lifetime a run is judged
by, ``gc``'s durations and which runs it collects, and ``list``'s idle column."""

from __future__ import annotations

import argparse

import pytest

from etcd_rendezvous.cli._common import positive_seconds
from etcd_rendezvous.cli._runs import (
    PYTORCH_HEARTBEAT_LIFETIME,
    HeartbeatLifetime,
    RunSummary,
    Verdict,
    heartbeat_lifetime,
    judge_etcd,
    judge_etcd_v2,
    state_write_age,
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


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "x"])
def test_a_heartbeat_lifetime_must_be_a_finite_positive_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        positive_seconds(text)


@pytest.mark.parametrize(
    ("status", "worker_keys", "joining", "over", "quiet"),
    [
        ("closed", 0, False, True, True),  # closed, no worker key anywhere: finished
        ("closed", 2, False, True, False),  # closed with workers in their exit barrier
        ("final", 0, False, False, True),  # PyTorch's workers waiting write no key
        ("joinable", 0, False, False, True),  # PyTorch's workers below min_workers
        ("none", 0, False, False, True),  # a re-rendezvous between two versions
        ("invalid", 0, False, False, True),
        ("final", 2, False, False, False),
        ("closed", 0, True, True, False),  # a state with a TTL of its own: a worker's
        ("setup", 0, True, False, False),
    ],
)
def test_when_an_etcd_run_is_finished(
    status: str, worker_keys: int, joining: bool, over: bool, quiet: bool
) -> None:
    """Finished needs the run closed (positive evidence that the job is over), never the
    mere absence of worker keys."""
    verdict = judge_etcd(status=status, worker_keys=worker_keys, joining=joining)
    assert (verdict.over, verdict.quiet, verdict.finished) == (over, quiet, over and quiet)
    assert verdict.idle_seconds == (0.0 if worker_keys or joining else None)
    assert verdict.reason


_DEFAULT = HeartbeatLifetime(PYTORCH_HEARTBEAT_LIFETIME, "PyTorch's default")
_LONG = HeartbeatLifetime(450.0, "published by its nodes")


@pytest.mark.parametrize(
    ("status", "node_keys", "api", "ttl", "lifetime", "over", "quiet", "idle"),
    [
        # Over etcd's v2 API the state's TTL dates its last write.
        ("closed", 0, "v2", 7200 - 15, _DEFAULT, True, True, 15.0),
        ("closed", 0, "v2", 7200 - 14, _DEFAULT, True, False, 14.0),
        # A fleet with a long keep-alive interval: silent between heartbeats, not gone.
        ("closed", 0, "v2", 7200 - 300, _LONG, True, False, 300.0),
        ("closed", 0, "v2", 7200 - 450, _LONG, True, True, 450.0),
        ("closed", 2, "v2", 7200 - 3600, _DEFAULT, True, False, 0.0),  # node keys
        ("closed", 0, "v2", None, _DEFAULT, True, True, None),  # closed in advance
        ("closed", 0, "v2", 7201, _DEFAULT, True, False, None),  # a TTL of unknown age
        ("complete", 0, "v2", 7200 - 3600, _DEFAULT, False, True, 3600.0),  # never closed
        ("joining", 0, "v2", 7200, _DEFAULT, False, False, 0.0),
        # Over the v3 API the lease's age is not the key's: node keys alone tell.
        ("closed", 0, "v3", 7200, _DEFAULT, True, True, None),
        ("closed", 1, "v3", 100, _DEFAULT, True, False, 0.0),
        ("complete", 0, "v3", 100, _DEFAULT, False, True, None),
        # No state: it lapsed (two hours without a write) or was never written.
        ("none", 0, "v2", None, _DEFAULT, True, True, None),
        ("none", 1, "v3", None, _DEFAULT, True, False, 0.0),
        ("invalid", 0, "v2", 7200 - 3600, _DEFAULT, False, False, None),
    ],
)
def test_when_an_etcd_v2_run_is_finished(
    status: str,
    node_keys: int,
    api: str,
    ttl: int | None,
    lifetime: HeartbeatLifetime,
    over: bool,
    quiet: bool,
    idle: float | None,
) -> None:
    verdict = judge_etcd_v2(
        status=status,
        node_keys=node_keys,
        api=api,
        state_ttl=ttl,
        granted_ttl=7200,
        lifetime=lifetime,
    )
    assert (verdict.over, verdict.quiet, verdict.finished) == (over, quiet, over and quiet)
    assert verdict.idle_seconds == idle
    assert verdict.reason


@pytest.mark.parametrize(
    ("api", "ttl", "age"),
    [("v2", 7200, 0.0), ("v2", 7000, 200.0), ("v2", None, None), ("v2", 9000, None)],
)
def test_the_state_write_age_comes_from_its_ttl_over_v2_only(
    api: str, ttl: int | None, age: float | None
) -> None:
    assert state_write_age(api, ttl, 7200) == age
    assert state_write_age("v3", ttl, 7200) is None


@pytest.mark.parametrize(
    ("published", "stated", "expected"),
    [
        (None, None, _DEFAULT),
        (0, None, _DEFAULT),  # an older writer publishes none
        (450, None, _LONG),
        (None, 600.0, HeartbeatLifetime(600.0, "--heartbeat-lifetime")),
        (450, 600.0, HeartbeatLifetime(600.0, "--heartbeat-lifetime")),
        # The operator never shortens what the run's nodes publish.
        (450, 5.0, _LONG),
    ],
)
def test_the_heartbeat_lifetime_a_run_is_judged_by(
    published: float | None, stated: float | None, expected: HeartbeatLifetime
) -> None:
    assert heartbeat_lifetime(published, stated) == expected


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
        verdict=Verdict(over=finished, quiet=finished, reason="test", idle_seconds=idle),
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


def test_gc_never_collects_a_run_that_was_never_closed() -> None:
    never_closed = RunSummary(
        backend="etcd",
        run_id="r",
        api="v2",
        status="joinable",
        world_size=2,
        version="1",
        live=0,
        verdict=judge_etcd(status="joinable", worker_keys=0, joining=False),
    )
    assert not _collectable(never_closed, 0.0, undated=True, force=True)


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
    assert format_idle(_run(finished=False, idle=0.0, live=2)) == "0s"
    # Where etcd keeps no time of the run.
    assert format_idle(_run(finished=False, idle=None, live=2)) == "-"
    assert format_idle(_run(finished=True, idle=None)) == "-"
