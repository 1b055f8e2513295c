"""What the dashboard knows of a run: the last read of its keys, and what the dashboard
itself observed over time, by its own clock.

A :class:`RunRecord` is made by :func:`observe` from the previous record and a new
:class:`RunRead`, a plain function (tested as such): when the phase changed, when a
round formed and who joined and left it, when each ``etcd-v2`` heartbeat last changed,
when each keep-alive or node key went away. Every time here is the dashboard's own
``time.monotonic()``: a worker's clock is shown, never compared with ours. Before the
dashboard saw a change it counts from when it first saw the run (:attr:`RunRecord.first_seen`),
so an age is a lower bound until then.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._runs import PYTORCH_HEARTBEAT_LIFETIME, RunSummary

__all__ = [
    "FORMED",
    "JOINING",
    "PHASES",
    "TIMELINE_ROUNDS",
    "Member",
    "Round",
    "RunRead",
    "RunRecord",
    "observe",
]

#: Every phase of each backend: the ``etcd`` backend's status (``none``: no state), and
#: ``etcd-v2``'s (``empty``: no participant; ``joining``; ``complete``; ``closed``);
#: ``invalid``: the state does not decode.
PHASES: Mapping[str, tuple[str, ...]] = {
    "etcd": ("none", "setup", "joinable", "frozen", "final", "closed", "invalid"),
    "etcd-v2": ("empty", "joining", "complete", "closed", "invalid"),
}
#: The phases in which a round is formed (its members have their ranks).
FORMED = frozenset({"final", "complete"})
#: The phases in which nodes wait for a round to form.
JOINING = frozenset({"setup", "joinable", "frozen", "joining"})
#: How many rounds a record's timeline keeps (the newest).
TIMELINE_ROUNDS = 50


@dataclass(frozen=True)
class RunRead:
    """One read of a run's keys: its line in ``etcd-rendezvous list`` and its
    ``etcd-rendezvous status --json`` report."""

    summary: RunSummary
    report: dict[str, Any]


@dataclass(frozen=True)
class Member:
    """One member of a run, as the run page lists it."""

    #: ``host pid N`` of one of our ``etcd`` workers (``rank N`` for PyTorch's, which
    #: announce no member key); the node (``addr_pid_localid``) for ``etcd-v2``.
    name: str
    rank: int | None
    #: ``live``, ``lapsed`` (``etcd``: its keep-alive key is gone), ``left`` (the same
    #: in a closed run, whose members leave as they finish), ``missing``
    #: (``etcd-v2``: its node key went away, or no heartbeat change seen for the run's
    #: heartbeat lifetime, as ``status`` judges it), ``waiting`` (announced or on the
    #: wait list, not in the round), ``redundant`` (``etcd-v2``'s redundancy list) or ``confirming``
    #: (``etcd``: a frozen round, before the keep-alives are written).
    state: str
    #: Seconds left of its key's TTL at the last read, where etcd reports it.
    ttl: int | None = None
    #: When the dashboard last saw it show life (``etcd-v2``: its heartbeat change).
    seen: float | None = None
    #: When the dashboard saw its key go away (or first found it gone).
    gone: float | None = None
    #: The worker's own heartbeat time (``etcd-v2``; its clock, shown, never compared).
    heartbeat: str | None = None


@dataclass(frozen=True)
class Round:
    """A round (``etcd``: a version) the dashboard saw formed."""

    round: str
    formed: float
    size: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    #: Its members (by name), to tell who joins and leaves the next one.
    names: frozenset[str] = frozenset()
    #: Formed before the dashboard first saw the run: ``formed`` is that first sight,
    #: and who joined or left is unknown.
    before_start: bool = False


@dataclass(frozen=True)
class RunRecord:
    """What the dashboard knows of one run."""

    backend: str
    run_id: str
    read: RunRead
    first_seen: float
    #: The time of the read this record holds (a run is read again at each change).
    read_at: float
    phase: str
    phase_since: float
    #: When the nodes started waiting for a round (``None``: no one waits).
    waiting_since: float | None
    members: tuple[Member, ...]
    #: ``etcd-v2``: each node's heartbeat (the worker's time, as text) and when the
    #: dashboard saw it change.
    beats: Mapping[str, tuple[str, float]]
    #: Keys (keep-alive keys; node names) seen going away, and when.
    gone: Mapping[str, float]
    timeline: tuple[Round, ...]
    #: ``etcd-v2``: the nodes with a node key at this read (only our nodes write one).
    keys: frozenset[str] = frozenset()

    @property
    def prefix(self) -> str:
        return self.read.summary.prefix

    @property
    def world_size(self) -> int:
        """The size of the round last formed (0 before one forms)."""
        return self.timeline[-1].size if self.timeline else 0

    @property
    def participants(self) -> int:
        """The participants in the state now (joining ones included)."""
        return len(self.read.report.get("participants") or ())

    @property
    def waiting(self) -> int:
        """Nodes waiting for a round: ``etcd``, the workers a final version counts as
        waiting, or the participants of a version still forming; ``etcd-v2``, the wait
        list, or the participants of a round still forming."""
        report = self.read.report
        if self.phase in JOINING:
            return self.participants + len(report.get("wait_list") or ())
        if self.backend == "etcd":
            return int(report.get("num_workers_waiting") or 0)
        return len(report.get("wait_list") or ())

    @property
    def missing(self) -> int:
        """Members of the round that show no life (``lapsed`` or ``missing``)."""
        return sum(1 for member in self.members if member.state in ("lapsed", "missing"))

    def oldest_sign_of_life(self, now: float) -> float:
        """Seconds since the member of the round heard from longest ago last showed life:
        ``etcd-v2``, its heartbeat seen changing; ``etcd``, 0 while its keep-alive key
        exists (etcd deletes it when its TTL passes unrenewed), else since the key went."""
        ages = [
            now - _last_sign(member, now)
            for member in self.members
            if member.state in ("live", "lapsed", "missing", "confirming")
        ]
        return max(ages, default=0.0)


def _last_sign(member: Member, now: float) -> float:
    """When ``member`` last showed life: when its key went, else when its heartbeat was
    seen changing, else ``now`` (its key exists: etcd vouches for it)."""
    if member.gone is not None:
        return member.gone
    return now if member.seen is None else member.seen


def _phase(read: RunRead) -> str:
    status = read.summary.status
    return status if status in PHASES[read.summary.backend] else "invalid"


def _formed(phase: str, report: dict[str, Any]) -> bool:
    """Whether the state holds a formed round: final or complete, or closed after one
    formed (closing keeps the rest of the state)."""
    if report.get("version") is None:
        return False
    return phase in FORMED or (
        phase == "closed" and bool(report.get("complete") or report.get("keep_alives"))
    )


def _etcd_members(
    report: dict[str, Any], previous: RunRecord | None, now: float
) -> tuple[list[Member], dict[str, float]]:
    """The members of an ``etcd`` run: one per rank of its state (named after the member
    key with that rank, or the name it had before its key lapsed), then the member keys
    not admitted (waiting)."""
    gone = dict(previous.gone) if previous is not None else {}
    same_version = previous is not None and previous.read.report.get("version") == report.get(
        "version"
    )
    known = {m.rank: m.name for m in previous.members} if previous and same_version else {}
    by_rank = {
        entry["rank"]: entry for entry in report.get("members", ()) if entry["rank"] is not None
    }
    alive = {entry["rank"]: entry for entry in report.get("keep_alives", ())}
    members, still_gone = [], {}
    frozen, closed = report.get("status") == "frozen", report.get("status") == "closed"
    for rank in report.get("participants", ()):
        member = by_rank.get(rank)
        if member is None:
            name = known.get(rank, f"rank {rank}")
        else:
            name = f"{member['host']} pid {member['pid']}"
        keep_alive = alive.get(rank)
        if keep_alive is None:
            state = "confirming" if frozen else "live"
            members.append(Member(name, rank, state, ttl=None if member is None else member["ttl"]))
        elif keep_alive["live"]:
            members.append(Member(name, rank, "live", ttl=keep_alive["ttl"]))
        else:
            when = still_gone[keep_alive["key"]] = gone.get(keep_alive["key"], now)
            members.append(Member(name, rank, "left" if closed else "lapsed", gone=when))
    for entry in report.get("members", ()):
        if entry["rank"] is None:
            name = f"{entry['host']} pid {entry['pid']}"
            members.append(Member(name, None, "waiting", ttl=entry["ttl"]))
    return members, still_gone


def _etcd_v2_members(
    report: dict[str, Any], previous: RunRecord | None, now: float
) -> tuple[list[Member], dict[str, tuple[str, float]], dict[str, float], frozenset[str]]:
    """The members of an ``etcd-v2`` run: participants by rank, then the wait and
    redundancy lists; with when each heartbeat was seen changing and each node key
    seen going. Also the nodes that have a node key now."""
    # The run's heartbeat lifetime (what its nodes publish, else PyTorch's default).
    judged_by = report.get("heartbeat_lifetime") or {}
    lifetime = float(judged_by.get("seconds") or PYTORCH_HEARTBEAT_LIFETIME)
    old_beats = previous.beats if previous is not None else {}
    old_gone = previous.gone if previous is not None else {}
    old_keys = previous.keys if previous is not None else frozenset()
    beats: dict[str, tuple[str, float]] = {}
    for name, beat in (report.get("last_heartbeats") or {}).items():
        old = old_beats.get(name)
        beats[name] = old if old is not None and old[0] == beat["time"] else (beat["time"], now)
    keys = frozenset(entry["node"] for entry in report.get("node_keys", ()))
    gone: dict[str, float] = {}
    members = []
    roles = [(name, rank, "live") for name, rank in (report.get("participants") or {}).items()]
    roles += [(name, None, "waiting") for name in report.get("wait_list", ())]
    roles += [(name, None, "redundant") for name in report.get("redundancy_list", ())]
    for name, rank, role in roles:
        beat = beats.get(name)
        seen = None if beat is None else beat[1]
        # Our nodes keep a node key while they run (PyTorch's keep none): a key seen
        # going away is a node gone; so is a heartbeat not seen changing for long.
        key_went = name not in keys and (name in old_keys or name in old_gone)
        silent = seen is not None and now - seen > lifetime
        state = role
        if role == "live" and (key_went or silent):
            # A closed run's nodes leave as they finish.
            state = "left" if report.get("closed") else "missing"
            gone[name] = old_gone.get(name, now)
        members.append(
            Member(
                name,
                rank,
                state,
                seen=seen,
                gone=gone.get(name),
                heartbeat=None if beat is None else beat[0],
            )
        )
    return members, beats, gone, keys


def observe(previous: RunRecord | None, read: RunRead, now: float) -> RunRecord:
    """The record of a run after a new ``read`` at ``now`` (the dashboard's
    monotonic clock), given the ``previous`` record (``None``: first sight)."""
    summary = read.summary
    phase = _phase(read)
    beats: Mapping[str, tuple[str, float]] = {}
    keys: frozenset[str] = frozenset()
    if summary.backend == "etcd":
        members, gone = _etcd_members(read.report, previous, now)
    else:
        members, beats, gone, keys = _etcd_v2_members(read.report, previous, now)
    timeline = () if previous is None else previous.timeline
    version = read.report.get("version")
    last = timeline[-1] if timeline else None
    if _formed(phase, read.report) and (last is None or last.round != str(version)):
        names = frozenset(m.name for m in members if m.rank is not None)
        if last is None:
            # Formed before the dashboard saw it form: who joined or left is unknown.
            entry = Round(str(version), now, len(names), (), (), names, previous is None)
        else:
            joined, left = sorted(names - last.names), sorted(last.names - names)
            entry = Round(str(version), now, len(names), tuple(joined), tuple(left), names)
        timeline = (*timeline, entry)[-TIMELINE_ROUNDS:]
    record = RunRecord(
        backend=summary.backend,
        run_id=summary.run_id,
        read=read,
        first_seen=now if previous is None else previous.first_seen,
        read_at=now,
        phase=phase,
        phase_since=now if previous is None or previous.phase != phase else previous.phase_since,
        waiting_since=None,
        members=tuple(members),
        beats=beats,
        gone=gone,
        timeline=timeline,
        keys=keys,
    )
    waiting_since = None
    if record.waiting:
        waiting_since = (
            now if previous is None or previous.waiting_since is None else previous.waiting_since
        )
    return dataclasses.replace(record, waiting_since=waiting_since)
