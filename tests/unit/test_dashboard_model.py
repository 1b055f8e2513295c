"""The dashboard's decisions, as plain functions: what it observes from successive reads
of a run (by its own clock), what its pages and metrics show, and ``--listen``."""

from __future__ import annotations

from typing import Any

import pytest

from etcd_rendezvous.cli._common import UsageError
from etcd_rendezvous.cli._dashboard.follow import Snapshot, Source
from etcd_rendezvous.cli._dashboard.model import RunRead, RunRecord, observe
from etcd_rendezvous.cli._dashboard.views import gauges, run_view
from etcd_rendezvous.cli._runs import RunSummary, Verdict
from etcd_rendezvous.cli.dashboard import parse_listen


def _v2(status: str, round_: int, participants: list[str], **extra: Any) -> RunRead:
    beats = extra.pop("beats", dict.fromkeys(participants, "2030-01-01T00:00:00"))
    report = {
        "backend": "etcd-v2",
        "status": status,
        "version": round_,
        "closed": status == "closed",
        "complete": status == "complete",
        "participants": {name: rank for rank, name in enumerate(participants)},
        "wait_list": extra.pop("wait_list", []),
        "redundancy_list": [],
        "last_heartbeats": {name: {"time": t, "age": 0.0} for name, t in beats.items()},
        "node_keys": [{"node": n} for n in extra.pop("keys", participants)],
    }
    lifetime = extra.pop("lifetime", 60.0)
    if lifetime is not None:
        report["heartbeat_lifetime"] = {"seconds": lifetime, "source": "published by its nodes"}
    summary = RunSummary(
        "etcd-v2",
        "job",
        "v3",
        status,
        len(participants),
        str(round_),
        0,
        Verdict(over=status == "closed", quiet=False, reason="a node key", idle_seconds=0.0),
        prefix="/torch/elastic/rendezvous",
    )
    return RunRead(summary, report)


def _legacy(status: str, version: str, ranks: list[int], live: list[int]) -> RunRead:
    report = {
        "backend": "etcd",
        "status": status,
        "version": version,
        "participants": ranks,
        "keep_alives": [{"key": f"k{r}", "rank": r, "live": r in live, "ttl": 9} for r in ranks],
        "members": [
            {"key": f"m{r}", "rank": r, "ttl": 9, "host": "h", "pid": r} for r in ranks if r in live
        ],
        "num_workers_waiting": 0,
    }
    verdict = Verdict(over=status == "closed", quiet=not live, reason="", idle_seconds=None)
    summary = RunSummary("etcd", "job", "v2", status, len(ranks), version, len(live), verdict)
    return RunRead(summary, report)


def _states(record: RunRecord) -> dict[str, str]:
    return {m.name: m.state for m in record.members}


def test_a_round_forming_is_timed_and_who_joined_and_left_is_told() -> None:
    first = observe(None, _v2("joining", 1, ["a", "b"]), now=100.0)
    assert (first.phase, first.waiting, first.waiting_since, first.timeline) == (
        "joining",
        2,
        100.0,
        (),
    )
    formed = observe(first, _v2("complete", 1, ["a", "b"]), now=130.0)
    assert (formed.phase_since, formed.waiting_since, formed.world_size) == (130.0, None, 2)
    (round_1,) = formed.timeline
    assert (round_1.formed, round_1.joined, round_1.left, round_1.before_start) == (
        130.0,
        (),
        (),
        False,
    )
    again = observe(formed, _v2("complete", 2, ["b", "c"]), now=200.0)
    assert [(r.round, r.joined, r.left) for r in again.timeline] == [
        ("1", (), ()),
        ("2", ("c",), ("a",)),
    ]
    assert again.first_seen == 100.0


def test_a_round_formed_before_the_dashboard_started_is_marked_so() -> None:
    record = observe(None, _v2("complete", 4, ["a", "b", "c"]), now=5.0)
    (seen,) = record.timeline
    assert (seen.round, seen.size, seen.before_start) == ("4", 3, True)


def test_heartbeats_are_aged_by_when_the_dashboard_saw_them_change() -> None:
    # The workers' clocks say 2030: never compared with ours.
    start = observe(None, _v2("complete", 1, ["a", "b"]), now=0.0)
    beats = {"a": "2030-01-01T00:00:05", "b": "2030-01-01T00:00:00"}
    later = observe(start, _v2("complete", 1, ["a", "b"], beats=beats), now=50.0)
    seen = {m.name: m.seen for m in later.members}
    assert seen == {"a": 50.0, "b": 0.0}
    assert later.oldest_sign_of_life(55.0) == 55.0
    # b's heartbeat unchanged for more than the run's lifetime (60 s here): missing.
    silent = observe(later, _v2("complete", 1, ["a", "b"], beats=beats), now=61.0)
    assert _states(silent) == {"a": "live", "b": "missing"}
    assert silent.missing == 1


@pytest.mark.parametrize(
    ("lifetime", "silent_for", "state"),
    [
        (20.0, 19.0, "live"),
        (20.0, 21.0, "missing"),
        (150.0, 140.0, "live"),  # a long keep-alive interval: not missing between beats
        (None, 14.0, "live"),  # nothing published: PyTorch's default lifetime, 15 s
        (None, 16.0, "missing"),
    ],
)
def test_a_heartbeat_is_missing_after_the_lifetime_the_run_is_judged_by(
    lifetime: float | None, silent_for: float, state: str
) -> None:
    start = observe(None, _v2("complete", 1, ["a"], lifetime=lifetime), now=0.0)
    later = observe(start, _v2("complete", 1, ["a"], lifetime=lifetime), now=silent_for)
    assert _states(later) == {"a": state}


def test_a_node_key_that_goes_away_marks_its_node_missing_and_left_once_closed() -> None:
    start = observe(None, _v2("complete", 1, ["a", "b"]), now=0.0)
    gone = observe(start, _v2("complete", 1, ["a", "b"], keys=["a"]), now=10.0)
    assert _states(gone) == {"a": "live", "b": "missing"}
    assert {m.name: m.gone for m in gone.members} == {"a": None, "b": 10.0}
    still = observe(gone, _v2("complete", 1, ["a", "b"], keys=["a"]), now=20.0)
    assert [m.gone for m in still.members] == [None, 10.0]
    closed = observe(still, _v2("closed", 1, ["a", "b"], keys=[]), now=30.0)
    assert _states(closed) == {"a": "left", "b": "left"}
    assert closed.missing == 0


def test_a_lapsed_keep_alive_keeps_its_members_name_and_when_it_lapsed() -> None:
    start = observe(None, _legacy("final", "3", [0, 1, 2], live=[0, 1, 2]), now=0.0)
    lapsed = observe(start, _legacy("final", "3", [0, 1, 2], live=[0, 2]), now=12.0)
    by_rank = {m.rank: (m.name, m.state, m.gone) for m in lapsed.members}
    assert by_rank == {
        0: ("h pid 0", "live", None),
        1: ("h pid 1", "lapsed", 12.0),
        2: ("h pid 2", "live", None),
    }
    assert lapsed.oldest_sign_of_life(20.0) == 8.0
    # A new version: rank 1 is another worker's now, whatever was known of the old.
    fresh = observe(lapsed, _legacy("joinable", "4", [0, 1], live=[]), now=30.0)
    assert [m.name for m in fresh.members] == ["rank 0", "rank 1"]


def test_the_member_page_is_paged_and_filtered() -> None:
    names = [f"node{i}" for i in range(250)]
    record = observe(None, _v2("complete", 1, names, keys=names[:200]), now=0.0)
    record = observe(record, _v2("complete", 1, names, keys=names[:199]), now=1.0)
    snapshot = Snapshot({("etcd-v2", "job"): record}, None, None, 0.0, (Source.default("etcd-v2"),))
    page = run_view(snapshot, "etcd-v2", "job", 2.0, offset=200, limit=40)
    assert page is not None
    members = page["members"]
    assert (members["total"], members["matching"], len(members["rows"])) == (250, 250, 40)
    assert members["rows"][0]["name"] == "node200"
    problems = run_view(snapshot, "etcd-v2", "job", 2.0, problems=True)
    assert problems is not None
    assert [row["name"] for row in problems["members"]["rows"]] == ["node199"]
    found = run_view(snapshot, "etcd-v2", "job", 2.0, query="NODE24")
    assert found is not None
    assert found["members"]["matching"] == 11  # node24, node240..node249
    assert run_view(snapshot, "etcd", "job", 2.0) is None


def test_the_gauges_of_a_waiting_run() -> None:
    record = observe(None, _v2("joining", 0, ["a"]), now=10.0)
    snapshot = Snapshot({("etcd-v2", "job"): record}, None, None, 0.0, (Source.default("etcd-v2"),))
    values = {g.name: g.samples[0][1] for g in gauges(snapshot, now=25.0)}
    assert values["etcd_rendezvous_run_waiting_seconds"] == 15.0
    assert values["etcd_rendezvous_run_participants"] == 1.0
    assert values["etcd_rendezvous_run_world_size"] == 0.0
    labels = next(iter(gauges(snapshot, now=25.0))).samples[0][0]
    assert labels == ("etcd-v2", "/torch/elastic/rendezvous", "job")


@pytest.mark.parametrize(
    ("key", "backend", "run_id"),
    [
        ("/torchelastic/p2p/run_job1/rdzv/v_1/rank_0", "etcd", "job1"),
        ("/torchelastic/p2p/run_", "etcd", None),
        ("/torchelastic/p2p/other", "etcd", None),
        ("/torch/elastic/rendezvous/job2", "etcd-v2", "job2"),
        ("/torch/elastic/rendezvous_nodes/job2/host_1_0", "etcd-v2", "job2"),
        ("/torch/elastic/rendezvous_nodes/a~2fb/aggregator", "etcd-v2", "a/b"),
        ("/torch/elastic/store/abc", "etcd-v2", None),
    ],
)
def test_a_changed_key_names_its_run(key: str, backend: str, run_id: str | None) -> None:
    assert Source.default(backend).run_of(key) == run_id


def test_listen_addresses() -> None:
    assert parse_listen("127.0.0.1:8379") == ("127.0.0.1", 8379)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("0.0.0.0:80") == ("0.0.0.0", 80)
    for bad in ("8379", ":8379", "host:port", "host:70000"):
        with pytest.raises(UsageError, match="--listen"):
            parse_listen(bad)
