"""What the dashboard's pages and ``/metrics`` show, as plain data made from a
:class:`~etcd_rendezvous.cli._dashboard.follow.Snapshot`: no I/O, no web framework.

Ages are seconds by the dashboard's monotonic clock (see
:mod:`etcd_rendezvous.cli._dashboard.model`); a time shown to the reader is the
dashboard's wall clock at that moment, minus the age.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .follow import Snapshot
from .model import PHASES, Member, RunRecord

__all__ = [
    "DEFAULT_PAGE",
    "MAX_PAGE",
    "Gauge",
    "gauges",
    "run_view",
    "runs_view",
]

#: Members per page of the run page's table, by default and at most.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: Member states that mean trouble (the run page's "problems only" filter).
_TROUBLE = frozenset({"lapsed", "missing"})
#: How many names of a list (who joined a round, the wait list) a page shows.
_NAMES_SHOWN = 20


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 1)


def _wall(now: float, then: float | None) -> str | None:
    """The dashboard's wall-clock time of monotonic time ``then``, ISO 8601."""
    if then is None:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - (now - then)))


def _some(names: Iterable[str]) -> dict[str, Any]:
    """The first :data:`_NAMES_SHOWN` of ``names`` and how many there are."""
    listed = list(names)
    return {"count": len(listed), "names": listed[:_NAMES_SHOWN]}


def _etcd(snapshot: Snapshot, now: float) -> dict[str, Any]:
    return {
        "ok": snapshot.error is None and snapshot.synced is not None,
        "error": snapshot.error,
        "error_for": _age(now, snapshot.error_since),
        "synced_ago": _age(now, snapshot.synced),
        "sources": [{"backend": s.backend, "prefix": s.prefix} for s in snapshot.sources],
    }


def _row(record: RunRecord, now: float) -> dict[str, Any]:
    summary = record.read.summary
    last = record.timeline[-1] if record.timeline else None
    return {
        "backend": record.backend,
        "run_id": record.run_id,
        "prefix": record.prefix,
        "api": summary.api,
        "phase": record.phase,
        "version": record.read.report.get("version"),
        "world_size": record.world_size,
        "participants": record.participants,
        "waiting": record.waiting,
        "live": summary.live,
        "missing": record.missing,
        "oldest_sign_of_life": round(record.oldest_sign_of_life(now), 1),
        "waiting_for": _age(now, record.waiting_since),
        "phase_for": _age(now, record.phase_since),
        "round_formed_ago": None if last is None else _age(now, last.formed),
        "observed_for": _age(now, record.first_seen),
        "changed_ago": _age(now, record.read_at),
        "finished": summary.finished,
    }


def runs_view(snapshot: Snapshot, now: float) -> dict[str, Any]:
    """The run list: etcd's state and one row per run, by backend and run id."""
    records = sorted(snapshot.records.values(), key=lambda r: (r.backend, r.run_id))
    return {"etcd": _etcd(snapshot, now), "runs": [_row(r, now) for r in records]}


def _member(member: Member, now: float) -> dict[str, Any]:
    return {
        "name": member.name,
        "rank": member.rank,
        "state": member.state,
        "ttl": member.ttl,
        "seen_ago": _age(now, member.seen),
        "gone_ago": _age(now, member.gone),
        "heartbeat": member.heartbeat,
    }


def run_view(
    snapshot: Snapshot,
    backend: str,
    run_id: str,
    now: float,
    *,
    offset: int = 0,
    limit: int = DEFAULT_PAGE,
    query: str = "",
    problems: bool = False,
) -> dict[str, Any] | None:
    """One run's page: its summary, timeline and one page of its members (those whose
    name or rank contains ``query``; only the lapsed and missing with ``problems``).
    ``None`` if the dashboard knows no such run."""
    record = snapshot.records.get((backend, run_id))
    if record is None:
        return None
    needle = query.strip().lower()
    chosen = [
        m
        for m in record.members
        if (not problems or m.state in _TROUBLE)
        and (not needle or needle in m.name.lower() or needle == str(m.rank))
    ]
    limit = max(1, min(limit, MAX_PAGE))
    offset = max(0, offset)
    report = record.read.report
    counts: dict[str, int] = {}
    for member in record.members:
        counts[member.state] = counts.get(member.state, 0) + 1
    return {
        "etcd": _etcd(snapshot, now),
        "run": _row(record, now),
        "key": report.get("key"),
        "valid": report.get("valid", True),
        "error": report.get("error"),
        "deadline": report.get("deadline"),
        "closed": report.get("closed", record.phase == "closed"),
        "state_ttl": report.get("state_ttl", report.get("key_ttl")),
        "counts": counts,
        "wait_list": _some(report.get("wait_list") or ()),
        "redundancy_list": _some(report.get("redundancy_list") or ()),
        "timeline": [
            {
                "round": entry.round,
                "formed_ago": _age(now, entry.formed),
                "formed_at": _wall(now, entry.formed),
                "size": entry.size,
                "joined": _some(entry.joined),
                "left": _some(entry.left),
                "before_start": entry.before_start,
            }
            for entry in reversed(record.timeline)
        ],
        "members": {
            "total": len(record.members),
            "matching": len(chosen),
            "offset": offset,
            "limit": limit,
            "rows": [_member(m, now) for m in chosen[offset : offset + limit]],
        },
    }


@dataclass(frozen=True)
class Gauge:
    """One gauge of ``/metrics``: a name, its help, and a value per run."""

    name: str
    help: str
    #: ((backend, prefix, run_id), value) per run.
    samples: tuple[tuple[tuple[str, str, str], float], ...]


#: The labels of every per-run gauge, in order.
RUN_LABELS = ("backend", "prefix", "run_id")


def gauges(snapshot: Snapshot, now: float) -> Iterator[Gauge]:
    """The per-run gauges of ``/metrics`` (the phase is :func:`phases`)."""
    records = sorted(snapshot.records.values(), key=lambda r: (r.backend, r.run_id))

    def per_run(name: str, help_: str, value: Any) -> Gauge:
        samples = tuple(((r.backend, r.prefix, r.run_id), float(value(r))) for r in records)
        return Gauge(name, help_, samples)

    yield per_run(
        "etcd_rendezvous_run_world_size",
        "Members of the round (etcd: version) the run last formed; 0 before one formed.",
        lambda r: r.world_size,
    )
    yield per_run(
        "etcd_rendezvous_run_participants",
        "Participants in the run's state now, those of a round still forming included.",
        lambda r: r.participants,
    )
    yield per_run(
        "etcd_rendezvous_run_nodes_waiting",
        "Nodes waiting for a round: the participants of a round still forming, or "
        "those waiting for the next one (etcd: num_workers_waiting; etcd-v2: wait list).",
        lambda r: r.waiting,
    )
    yield per_run(
        "etcd_rendezvous_run_members_missing",
        "Members of the round without a sign of life: a lapsed keep-alive key (etcd), a "
        "node key gone or no heartbeat change seen for 60 s (etcd-v2).",
        lambda r: r.missing,
    )
    yield per_run(
        "etcd_rendezvous_run_oldest_heartbeat_age_seconds",
        "Seconds since the member heard from longest ago last showed life, by the "
        "dashboard's clock: etcd-v2, since it saw that heartbeat change; etcd, 0 while "
        "the keep-alive key exists (etcd's TTL), else since it saw the key go.",
        lambda r: r.oldest_sign_of_life(now),
    )
    yield per_run(
        "etcd_rendezvous_run_waiting_seconds",
        "Seconds since the dashboard saw nodes start waiting for a round (0: none waits).",
        lambda r: 0.0 if r.waiting_since is None else now - r.waiting_since,
    )
    yield per_run(
        "etcd_rendezvous_run_round_age_seconds",
        "Seconds since the dashboard saw the run's last round form (or first saw it "
        "formed); absent rounds count from when it first saw the run.",
        lambda r: now - (r.timeline[-1].formed if r.timeline else r.first_seen),
    )
    yield per_run(
        "etcd_rendezvous_run_observed_seconds",
        "Seconds since the dashboard first saw the run: the ages above are at most this.",
        lambda r: now - r.first_seen,
    )
    yield per_run(
        "etcd_rendezvous_run_finished",
        "1 if no worker is left in the run (as `etcd-rendezvous list` says), else 0.",
        lambda r: r.read.summary.finished,
    )


def phases(snapshot: Snapshot) -> Iterator[tuple[tuple[str, str, str], str, tuple[str, ...]]]:
    """Per run: its labels, its phase and every phase of its backend."""
    for record in sorted(snapshot.records.values(), key=lambda r: (r.backend, r.run_id)):
        labels = (record.backend, record.prefix, record.run_id)
        yield labels, record.phase, PHASES[record.backend]
