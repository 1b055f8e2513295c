"""The invariants, checked over a scenario's records: a pure function, no I/O.

:func:`check` takes the scenario (as :meth:`Scenario.as_dict` gives it), the runner's
records and every node's (:mod:`chaos.records`) and returns the violations. The
invariants (``docs/testing.rst``, section "The fault harness"):

``one-world``
    Within a round (``etcd-v2``) or version (``etcd``): the ranks of the nodes that
    returned are 0..W-1 and unique, all got the same world size W, and all read the
    same fingerprint (the node at each rank) from the round's store; no rank was
    claimed twice in the round's store; no barrier counted more than W ranks.
``rounds-increase``
    Each node's successive rendezvous give strictly increasing rounds, so no round
    number is used for two worlds.
``no-live-run-deleted``
    An operator command without ``--force`` deleted nothing of a run while one of its
    nodes was reliably in it (running, inside the run for 3 s at least, and
    undisturbed by any fault for the keys' lifetime before).
``liveness``
    Once the faults are over (``T_f``) and at least ``min_nodes`` healthy nodes, and no
    more than ``max_nodes``, keep trying, within the bound B
    (:meth:`Scenario.liveness_bound`): a round whose world is exactly the healthy
    nodes (``max_nodes`` of them where there are more) passes two barriers, or every
    healthy node fails with a named error. Under etcd's request limit (the ``limit``
    family, a fault that lasts), a round of some healthy nodes may pass its barriers
    while every other healthy node fails with a named ``RequestTooLargeError``: the
    state of all of them is larger than etcd takes. A node blocked in one call for the
    whole window is the silent hang this rules out.
``named-errors``
    Every failure of our nodes is a ``RendezvousError`` (or the store's
    ``LookupError``), within the caller's timeout + 2 s (longer by the time the node
    was paused during the call); a node asked to stop ends within its bounds.
``store-kept``
    A value written through a round's store still reads in that round.
``no-leaks``
    After ``shutdown()`` and ``close()``: no thread of the library, no socket to etcd,
    and (v3) no lease attached to the node's keys, nor long leases holding no key
    beyond one for each node that was killed. Two exceptions, both bounded by a TTL:
    with ``etcd``, the member key of a version the node left earlier, whose lease the
    node stopped refreshing then (its lapse, within the keep-alive TTL, is how the
    others learn that it left, in PyTorch's protocol too); with ``etcd-v2``, one lease
    per node that shut down, which held the state key when the node closed and was
    emptied by a later writer of the state (it lapses with the state's TTL; the node
    cannot revoke a lease that holds the run's state, nor can the later writer revoke
    another connection's lease).
``healthy-kept``
    (``etcd-v2``) None of our nodes is taken out of a complete round while it runs the round
    undisturbed, unless some node's clock runs ahead of its own by more than
    PyTorch tolerates (``keep_alive_interval x (keep_alive_max_attempt - 1) - 1 s``):
    PyTorch drops a node only on its own heartbeats.
``operator-commands``
    Every command ends with status 0 or 1 (a clear one-line error), never a traceback.
``node-crashed``
    No node process ends by itself with an error (a crash of the library or harness);
    a torchrun agent that fails with a named rendezvous error, or that was asked to
    leave (SIGTERM), ends as torchrun does (status 1).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Violation", "check", "healthy_nodes", "liveness"]

Record = dict[str, Any]

#: Seconds the checker allows beyond a caller's timeout (the library's promise).
DEADLINE_SLACK = 2.0
#: A node inside the run this long before a command may have written its keys.
SETTLED_IN_RUN = 3.0
#: A lease with more left than this that holds no key was left behind (the short
#: ones, of keys just deleted, lapse on their own within seconds).
_ORPHAN_TTL = 60
#: The ``etcd`` backend's member keys' TTL (PyTorch's ``CONST_WORKER_KEEPALIVE_TTL``).
_MEMBER_TTL = 10
#: Stalls of the machine adding up to this long within a window disturb every node.
_STALL_DISTURBS = 1.0
#: Barriers a round must pass to count as progress.
PROGRESS_STEPS = 2
#: How long a node may take to stop: its call's timeout, shutdown's close timeout,
#: the leak checks' grace, and a margin for the load.
STOP_MARGIN = 10.0


@dataclass
class Violation:
    invariant: str
    detail: str
    nodes: list[str] = field(default_factory=list)
    t: float | None = None  # seconds after the scenario's start
    #: What broke, within the invariant (for the summary): "threads", "sockets", ...
    what: str = ""

    @property
    def key(self) -> str:
        return f"{self.invariant}/{self.what}" if self.what else self.invariant

    def as_dict(self) -> dict[str, Any]:
        return {
            "invariant": self.invariant,
            "what": self.what,
            "detail": self.detail,
            "nodes": self.nodes,
            "t": self.t,
        }


# -- what happened to each node ---------------------------------------------------------


@dataclass
class Timeline:
    """The faults, as intervals, and the processes, from the runner's records."""

    t0: float
    faults: list[Record]  # "fault" records, with "end" (None: lasting) and "recovered"
    procs: dict[str, Record]  # node -> its "proc" record
    ended: dict[str, float]  # node -> when the runner killed it or it exited
    t_f: float  # absolute
    bound: float
    closed_at: float | None  # a close command ran
    #: (start, end) of each moment the machine was too busy to keep time (the
    #: runner's "stall" records).
    stalls: list[tuple[float, float]] = field(default_factory=list)
    #: The longest delay a response may take without disturbing a node's keep-alive:
    #: a second for the ``etcd`` backend (keys of 10 s refreshed every 5 s), a quarter
    #: of ``keep_alive_interval`` for ``etcd-v2`` (a heartbeat takes a few requests one
    #: after the other, every interval).
    slow_ok: float = 1.0

    def stalled(self, start: float, end: float) -> float:
        """Seconds the machine stalled within ``[start, end]``."""
        return sum(max(0.0, min(end, e) - max(start, s)) for s, e in self.stalls)

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 2)

    def faults_of(self, node: str, kinds: Iterable[str]) -> list[Record]:
        kinds = set(kinds)
        return [f for f in self.faults if f["kind"] in kinds and f.get("target") == node]

    def interval(self, fault: Record) -> tuple[float, float]:
        end = fault.get("end")
        return fault["t"], float("inf") if end is None else end

    def disturbed(self, node: str, start: float, end: float) -> bool:
        """Whether a fault that can make ``node``'s keys lapse or its requests fail
        overlapped ``[start, end]``: its own pause, freeze or network fault (but a
        delay of a second or less), any etcd member fault, garbage in a worker's key
        or the state."""
        # A machine that lost a second in all, within the window, starves every
        # keep-alive.
        if self.stalled(start, end) >= _STALL_DISTURBS:
            return True
        for fault in self.faults:
            kind = fault["kind"]
            params = fault.get("params") or {}
            # A slow network delays a refresh, it does not stop it (dropped, refused or
            # reset connections do), while the delay is short against the keys' refresh
            # period (see Timeline.slow_ok).
            slow_only = (
                kind == "net" and params.get("mode") == "delay" and params["delay"] <= self.slow_ok
            )
            own = (
                fault.get("target") == node
                and kind in ("pause", "freeze", "net", "kill")
                and not slow_only
            )
            shared = kind in ("etcd_kill", "etcd_freeze", "etcd_pause") or (
                kind == "garbage" and params.get("class") in ("worker", "state")
            )
            if not (own or shared):
                continue
            f_start, f_end = self.interval(fault)
            if f_start <= end and f_end >= start:
                return True
        return False

    def paused_during(self, node: str, start: float, end: float) -> float:
        """Seconds ``node`` was stopped (SIGSTOP) within ``[start, end]``."""
        total = 0.0
        for fault in self.faults_of(node, ("pause", "freeze")):
            f_start, f_end = self.interval(fault)
            total += max(0.0, min(end, f_end) - max(start, f_start))
        return total

    def clock_offset(self, node: str, at: float) -> float:
        offset = 0.0
        for fault in self.faults_of(node, ("clock",)):
            if fault["t"] <= at:
                offset = float(fault["params"]["offset"])
        return offset


def _timeline(scenario: dict[str, Any], runner: list[Record]) -> Timeline:
    begin = next(r for r in runner if r["ev"] == "begin")
    t0 = begin["t"]
    faults: list[Record] = []
    for r in runner:
        if r["ev"] == "fault":
            faults.append(dict(r))
    for r in runner:
        if r["ev"] == "recovered":
            for f in faults:
                if f["id"] == r["id"]:
                    f["end"] = r["t"]
    procs = {r["node"]: r for r in runner if r["ev"] == "proc"}
    ended = {r["node"]: r["t"] for r in runner if r["ev"] == "proc_end"}
    over = next((r["t"] for r in runner if r["ev"] == "faults_over"), None)
    t_f = over if over is not None else t0 + _faults_over(scenario)
    closed_at = next(
        (r["t0"] for r in runner if r["ev"] == "command" and r["kind"] == "close" and r["rc"] == 0),
        None,
    )
    stalls = [(r["start"], r["start"] + r["late"]) for r in runner if r["ev"] == "stall"]
    slow_ok = 1.0
    if scenario["backend"] == "etcd-v2":
        slow_ok = scenario["settings"]["keep_alive_interval"] / 4
    return Timeline(
        t0, faults, procs, ended, t_f, float(begin["bound"]), closed_at, stalls, slow_ok
    )


def _faults_over(scenario: dict[str, Any]) -> float:
    ends = [f["at"] + (f["duration"] or 0.0) for f in scenario["faults"]]
    ends += [n["start"] for n in scenario["nodes"]]
    return max(ends, default=0.0)


def healthy_nodes(
    scenario: dict[str, Any], runner: list[Record], nodes: dict[str, list[Record]]
) -> list[str]:
    """The nodes that keep trying after ``T_f``: started, not killed, frozen or gone,
    not ended by themselves, and still with an etcd member to talk to."""
    tl = _timeline(scenario, runner)
    gone = {
        f["target"]
        for f in tl.faults
        if f["kind"] in ("kill", "freeze", "leave") and f["t"] <= tl.t_f
    }
    # Members lost for good (frozen, or killed and never restarted).
    lost = {
        f["params"]["member"]
        for f in tl.faults
        if f["kind"] in ("etcd_freeze", "etcd_kill") and f.get("end") is None and f["t"] <= tl.t_f
    }
    healthy = []
    for name, proc in tl.procs.items():
        if name in gone or proc["t"] > tl.t_f:
            continue
        members = proc.get("members")
        if members and all(m in lost for m in members):
            continue  # a PyTorch node talks to one member: it is cut off
        ended = tl.ended.get(name)
        stops = [r for r in nodes.get(name, []) if r["ev"] == "stop"]
        if ended is not None and ended <= tl.t_f and not stops:
            continue
        healthy.append(name)
    return sorted(healthy)


# -- the invariants ---------------------------------------------------------------------


def check(
    scenario: dict[str, Any], runner: list[Record], nodes: dict[str, list[Record]]
) -> list[Violation]:
    """Every violation of the invariants in one scenario's records."""
    tl = _timeline(scenario, runner)
    impl = {n["name"]: n["impl"] for n in scenario["nodes"]}
    found: list[Violation] = []
    found += _one_world(tl, nodes)
    found += _rounds_increase(tl, nodes)
    found += _no_live_run_deleted(scenario, tl, runner, nodes)
    found += liveness(scenario, runner, nodes).violations
    found += _named_errors(scenario, tl, runner, nodes, impl)
    found += _store_kept(tl, nodes)
    found += _no_leaks(scenario, tl, runner, nodes, impl)
    found += _healthy_kept(scenario, tl, runner, nodes)
    found += _operator_commands(tl, runner)
    found += _node_crashed(tl, runner)
    return found


def _one_world(tl: Timeline, nodes: dict[str, list[Record]]) -> list[Violation]:
    found = []
    joined: dict[Any, list[tuple[str, Record]]] = defaultdict(list)
    worlds: dict[Any, list[tuple[str, Record]]] = defaultdict(list)
    for name, records in nodes.items():
        for r in records:
            if r["ev"] == "joined" and r.get("round") is not None:
                joined[r["round"]].append((name, r))
            elif r["ev"] == "world" and r.get("round") is not None:
                worlds[r["round"]].append((name, r))
            elif r["ev"] == "overflow":
                found.append(
                    Violation(
                        "one-world",
                        f"round {r['round']}: barrier {r['k']} counted {r['count']} ranks, "
                        "more than the world size (a rank added twice, or two worlds "
                        "share the round's store)",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
    for round_, entries in sorted(joined.items(), key=lambda e: str(e[0])):
        sizes = {r["world_size"] for _, r in entries}
        ranks = sorted(r["rank"] for _, r in entries)
        who = sorted({n for n, _ in entries})
        first = tl.rel(min(r["t"] for _, r in entries))
        if len(sizes) > 1:
            found.append(
                Violation(
                    "one-world",
                    f"round {round_}: nodes got different world sizes: "
                    + ", ".join(f"{n}={r['world_size']}" for n, r in entries),
                    who,
                    first,
                )
            )
        size = max(sizes)
        bad = [r for r in ranks if not 0 <= r < size]
        if bad or len(set(ranks)) != len(ranks) or len(ranks) > size:
            found.append(
                Violation(
                    "one-world",
                    f"round {round_}: ranks {ranks} in a world of {size} "
                    + ", ".join(f"{n}=rank {r['rank']}" for n, r in entries),
                    who,
                    first,
                )
            )
    for round_, entries in sorted(worlds.items(), key=lambda e: str(e[0])):
        views = {tuple(r["members"]) for _, r in entries if None not in r["members"]}
        if len(views) > 1:
            found.append(
                Violation(
                    "one-world",
                    f"round {round_}: nodes read different worlds from the round's store: "
                    + "; ".join(f"{n}: {r['members']}" for n, r in entries),
                    sorted({n for n, _ in entries}),
                    tl.rel(min(r["t"] for _, r in entries)),
                )
            )
        for name, r in entries:
            if r.get("conflict"):
                found.append(
                    Violation(
                        "one-world",
                        f"round {round_}: {name}'s rank was already claimed by another node "
                        f"in the round's store (it read {r['members']})",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
            ranks = [rec for n, rec in joined.get(round_, []) if n == name]
            if ranks:
                rank = ranks[-1]["rank"]
                members = r["members"]
                if rank < len(members) and members[rank] not in (None, name):
                    found.append(
                        Violation(
                            "one-world",
                            f"round {round_}: {name} has rank {rank} but the round's store "
                            f"names {members[rank]} at that rank",
                            [name, members[rank]],
                            tl.rel(r["t"]),
                        )
                    )
    return found


def _rounds_increase(tl: Timeline, nodes: dict[str, list[Record]]) -> list[Violation]:
    found = []
    for name, records in nodes.items():
        last = None
        for r in records:
            # A torchrun worker's round is its process group's token: not ordered.
            if r["ev"] != "joined" or not isinstance(r.get("round"), int):
                continue
            if last is not None and r["round"] <= last["round"]:
                found.append(
                    Violation(
                        "rounds-increase",
                        f"{name} joined round {r['round']} (call {r['call']}) after round "
                        f"{last['round']} (call {last['call']}): a round number used twice",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
            last = r
    return found


def _in_run(records: list[Record], start: float, end: float) -> bool:
    """Whether the node was inside the run throughout ``[start, end]``: its first call
    began before ``start - SETTLED_IN_RUN`` and it did not stop, leave or end before
    ``end``."""
    first = next((r["t"] for r in records if r["ev"] == "join_start"), None)
    if first is None or first > start - SETTLED_IN_RUN:
        return False
    for r in records:
        if r["ev"] in ("stop", "shutdown", "exit") and r["t"] <= end:
            return False
        if r["ev"] == "join_error" and r.get("closed") and r["t"] <= end:
            return False
    return True


def _no_live_run_deleted(
    scenario: dict[str, Any], tl: Timeline, runner: list[Record], nodes: dict[str, list[Record]]
) -> list[Violation]:
    found = []
    settings = scenario["settings"]
    if scenario["backend"] == "etcd":
        horizon = 10.0 + settings["request_timeout"]
    else:
        horizon = settings["keep_alive_interval"] * settings["keep_alive_max_attempt"]
        horizon += settings["request_timeout"]
    for cmd in runner:
        if cmd["ev"] != "command" or cmd["kind"] not in ("delete", "gc"):
            continue
        if "--force" in cmd["args"]:
            continue
        deleted = [k for k in (cmd.get("report") or {}).get("deleted", []) if _of_run(scenario, k)]
        if not deleted:
            continue
        live = []
        for name, records in nodes.items():
            if name not in tl.procs or (name in tl.ended and tl.ended[name] < cmd["t"]):
                continue
            if tl.paused_during(name, cmd["t0"], cmd["t"]) > 0:
                continue
            if not _in_run(records, cmd["t0"], cmd["t"]):
                continue
            if tl.disturbed(name, cmd["t0"] - horizon, cmd["t"]):
                continue
            live.append(name)
        if live:
            found.append(
                Violation(
                    "no-live-run-deleted",
                    f"`{cmd['kind']} {' '.join(cmd['args'])}` deleted {deleted} while "
                    f"{', '.join(live)} ran in the run undisturbed",
                    live,
                    tl.rel(cmd["t0"]),
                )
            )
    return found


def _of_run(scenario: dict[str, Any], key: str) -> bool:
    run_id = scenario["run_id"]
    return f"/run_{run_id}" in key or key.rstrip("/").endswith(f"/{run_id}") or f"/{run_id}/" in key


# -- liveness ---------------------------------------------------------------------------


@dataclass
class Liveness:
    applies: bool
    why: str
    held_at: float | None  # absolute time at which progress (or failure) was shown
    how: str  # "progress", "failed", ""
    violations: list[Violation]


def liveness(
    scenario: dict[str, Any],
    runner: list[Record],
    nodes: dict[str, list[Record]],
    now: float | None = None,
) -> Liveness:
    """Whether the healthy nodes made progress within the bound after ``T_f`` (as far
    as the records go: the runner asks while the scenario runs, with ``now``)."""
    tl = _timeline(scenario, runner)
    if tl.closed_at is not None:
        return Liveness(False, "the run was closed by an operator", None, "", [])
    healthy = healthy_nodes(scenario, runner, nodes)
    if len(healthy) < scenario["min_nodes"]:
        return Liveness(False, f"{len(healthy)} healthy nodes < min_nodes", None, "", [])
    if len(healthy) > scenario["max_nodes"]:
        # PyTorch's protocol itself: after each re-rendezvous a node beyond max_nodes
        # waits in the wait list (etcd: as a waiting worker), which makes the members
        # re-rendezvous again; a round may or may not settle.
        return Liveness(False, "more healthy nodes than max_nodes", None, "", [])
    target = min(len(healthy), scenario["max_nodes"])
    # Time the machine could not keep is given back (it stalled for everyone).
    deadline = tl.t_f + tl.bound
    deadline += tl.stalled(tl.t_f, deadline)
    held = _progress_at(healthy, target, nodes, tl.t_f, deadline)
    if held is not None:
        return Liveness(True, "", held, "progress", [])
    failed = _failed_at(healthy, _with_agent_exits(nodes, runner), tl.t_f, deadline)
    if failed is not None:
        return Liveness(True, "", failed, "failed", [])
    if scenario.get("max_request_bytes"):
        split = _split_by_limit_at(healthy, nodes, tl.t_f, deadline)
        if split is not None:
            return Liveness(True, "", split, "progress", [])
    if now is not None and now < deadline:
        return Liveness(True, "", None, "", [])  # not yet
    return Liveness(
        True,
        "",
        None,
        "",
        [
            Violation(
                "liveness",
                f"no round of the {len(healthy)} healthy nodes {healthy} passed "
                f"{PROGRESS_STEPS} barriers within {tl.bound:.1f} s after the faults "
                f"ended (T_f = {tl.rel(tl.t_f)} s), nor did they all fail: "
                + "; ".join(f"{n}: {_doing(nodes.get(n, []), deadline, tl)}" for n in healthy),
                healthy,
                tl.rel(deadline),
            )
        ],
    )


def _progress_at(
    healthy: list[str], target: int, nodes: dict[str, list[Record]], t_f: float, deadline: float
) -> float | None:
    """The earliest time by ``deadline`` at which ``target`` healthy nodes, whose round's
    world is exactly them, each passed PROGRESS_STEPS barriers after ``t_f``."""
    by_round: dict[Any, dict[str, list[float]]] = defaultdict(dict)
    members_of: dict[Any, set[tuple[str, ...]]] = defaultdict(set)
    for name in healthy:
        for r in nodes.get(name, []):
            if r["ev"] == "world":
                members_of[r["round"]].add(tuple(r["members"]))
            elif r["ev"] == "step" and t_f <= r["t"] <= deadline:
                by_round[r["round"]].setdefault(name, []).append(r["t"])
    best = None
    for round_, steps in by_round.items():
        views = members_of.get(round_, set())
        if len(views) != 1:
            continue
        members = set(next(iter(views)))
        if len(members) != target or not members <= set(healthy) or None in members:
            continue
        times = []
        for name in members:
            mine = sorted(steps.get(name, []))
            if len(mine) < PROGRESS_STEPS:
                break
            times.append(mine[PROGRESS_STEPS - 1])
        else:
            at = max(times)
            best = at if best is None else min(best, at)
    return best


def _with_agent_exits(
    nodes: dict[str, list[Record]], runner: list[Record]
) -> dict[str, list[Record]]:
    """``nodes``, with a ``join_error`` for each torchrun agent that ended with a named
    rendezvous error (its workers record nothing of it: torchrun exits with it)."""
    found = {name: list(records) for name, records in nodes.items()}
    for r in runner:
        ended = r["ev"] == "proc_end" and r.get("rc") not in (0, None) and not r.get("killed")
        if ended and _NAMED_EXIT.search(r.get("stderr", "")):
            error = {"t": r["t"], "ev": "join_error", "named": True, "error": "exit"}
            found.setdefault(r["node"], []).append(error)
    return found


def _failed_at(
    healthy: list[str],
    nodes: dict[str, list[Record]],
    t_f: float,
    deadline: float,
    error: str | None = None,
) -> float | None:
    """When every healthy node had failed with a named error (``error``, if given) in
    ``[t_f, deadline]``."""
    times = []
    for name in healthy:
        errors = [
            r["t"]
            for r in nodes.get(name, [])
            if r["ev"] == "join_error"
            and r.get("named")
            and t_f <= r["t"] <= deadline
            and (error is None or r.get("error") == error)
        ]
        if not errors:
            return None
        times.append(min(errors))
    return max(times) if times else None


def _split_by_limit_at(
    healthy: list[str], nodes: dict[str, list[Record]], t_f: float, deadline: float
) -> float | None:
    """When a round whose world is some of the healthy nodes had passed its barriers
    (as :func:`_progress_at` has it) and every other healthy node had failed with a
    named ``RequestTooLargeError``, in ``[t_f, deadline]``; ``None`` if that never held.
    """
    worlds = {
        tuple(r["members"])
        for name in healthy
        for r in nodes.get(name, [])
        if r["ev"] == "world" and None not in r["members"]
    }
    best = None
    for world in worlds:
        members = set(world)
        if not members < set(healthy):
            continue
        progressed = _progress_at(sorted(members), len(members), nodes, t_f, deadline)
        others = [name for name in healthy if name not in members]
        refused = _failed_at(others, nodes, t_f, deadline, "RequestTooLargeError")
        if progressed is not None and refused is not None:
            at = max(progressed, refused)
            best = at if best is None else min(best, at)
    return best


def _doing(records: list[Record], at: float, tl: Timeline) -> str:
    """What a node was doing at ``at``, for a liveness report."""
    before = [r for r in records if r["t"] <= at]
    if not before:
        return "no record"
    last = before[-1]
    calls = sum(1 for r in before if r["ev"] == "join_start" and r["t"] >= tl.t_f)
    rounds = sorted({r["round"] for r in before if r["ev"] == "joined" and r["t"] >= tl.t_f})
    text = f"last {last['ev']} at {tl.rel(last['t'])} s"
    if last["ev"] == "join_start":
        text = f"blocked in next_rendezvous() since {tl.rel(last['t'])} s"
    elif last["ev"] in ("join_error", "op_error"):
        text += f" ({last.get('error')}: {str(last.get('message'))[:120]})"
    return f"{text}, {calls} calls and rounds {rounds} after T_f"


# -- errors and deadlines ---------------------------------------------------------------


def _named_errors(
    scenario: dict[str, Any],
    tl: Timeline,
    runner: list[Record],
    nodes: dict[str, list[Record]],
    impl: dict[str, str],
) -> list[Violation]:
    found = []
    timeout = scenario["settings"]["timeout"]
    for name, records in nodes.items():
        if impl.get(name) != "ours":
            continue
        for r in records:
            if r["ev"] not in ("join_error", "op_error", "create_error"):
                continue
            what = "next_rendezvous()" if r["ev"] == "join_error" else r.get("op", "handler")
            if not r.get("named"):
                found.append(
                    Violation(
                        "named-errors",
                        f"{name}: {what} raised {r['error']}, not a RendezvousError: "
                        f"{str(r.get('message'))[:200]}",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
            limit = r.get("timeout") or timeout
            if r["ev"] == "join_error":
                limit = timeout
            allowed = limit + DEADLINE_SLACK
            allowed += tl.paused_during(name, r["t"] - r["elapsed"], r["t"])
            allowed += tl.stalled(r["t"] - r["elapsed"], r["t"])
            if r["elapsed"] > allowed:
                found.append(
                    Violation(
                        "named-errors",
                        f"{name}: {what} failed after {r['elapsed']:.1f} s, past its "
                        f"timeout {limit:g} s + {DEADLINE_SLACK:g} s ({r['error']})",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
    for r in runner:
        if r["ev"] != "hung":
            continue
        name = r["node"]
        if impl.get(name) != "ours":
            continue
        found.append(
            Violation(
                "named-errors",
                f"{name} did not end within {r['waited']:.0f} s of being asked to stop "
                f"(its calls' timeout {timeout:g} s + shutdown); its last record: "
                f"{r.get('last')}",
                [name],
                tl.rel(r["t"]),
            )
        )
    return found


def _store_kept(tl: Timeline, nodes: dict[str, list[Record]]) -> list[Violation]:
    found = []
    for name, records in nodes.items():
        for r in records:
            if r["ev"] == "lost":
                found.append(
                    Violation(
                        "store-kept",
                        f"{name}: {r['key']}, stored in round {r['round']}, reads as missing "
                        "in that round",
                        [name],
                        tl.rel(r["t"]),
                    )
                )
    return found


def _no_leaks(
    scenario: dict[str, Any],
    tl: Timeline,
    runner: list[Record],
    nodes: dict[str, list[Record]],
    impl: dict[str, str],
) -> list[Violation]:
    found = []
    clean_pids: dict[int, str] = {}
    for name, records in nodes.items():
        start = next((r for r in records if r["ev"] == "start"), None)
        for r in records:
            if r["ev"] != "leaks":
                continue
            if start is not None and impl.get(name) == "ours":
                clean_pids[start["pid"]] = name
            if r["threads"]:
                found.append(
                    Violation(
                        "no-leaks",
                        f"{name}: threads still alive 3 s after shutdown(): {r['threads']}"
                        + ("" if r.get("threads_after_close") else " (close() ends them)"),
                        [name],
                        tl.rel(r["t"]),
                        "threads after shutdown",
                    )
                )
            elif r.get("threads_after_close"):
                found.append(
                    Violation(
                        "no-leaks",
                        f"{name}: threads still alive 3 s after close(): "
                        f"{r['threads_after_close']}",
                        [name],
                        tl.rel(r["t"]),
                        "threads after close",
                    )
                )
            if r["sockets"] or r.get("sockets_after_gc"):
                freed = "" if r.get("sockets_after_gc") else " (the garbage collector closes them)"
                found.append(
                    Violation(
                        "no-leaks",
                        f"{name}: connections to etcd still open after shutdown() and "
                        f"close(): {r['sockets'] or r['sockets_after_gc']}{freed}",
                        [name],
                        tl.rel(r["t"]),
                        "sockets" if r.get("sockets_after_gc") else "sockets until gc",
                    )
                )
    gone = sum(1 for f in tl.faults if f["kind"] in ("kill", "freeze"))
    if scenario["backend"] == "etcd-v2":
        gone += len(clean_pids)  # (see the docstring: one emptied by the state's writers)
    for r in runner:
        if r["ev"] != "leases":
            continue
        # A long lease (the two-hour one a connection shares between the keys it
        # writes) holding no key: what a node left that neither revoked nor uses it.
        # A killed node cannot revoke its own.
        orphans = [x for x in r["leases"] if not x["keys"] and x["ttl"] > _ORPHAN_TTL]
        if orphans and len(orphans) > gone and clean_pids:
            found.append(
                Violation(
                    "no-leaks",
                    f"{len(orphans)} v3 lease(s) holding no key, with {orphans[0]['ttl']} s "
                    f"left, remain after the nodes shut down ({gone} node(s) were killed)",
                    sorted(clean_pids.values()),
                    tl.rel(r["t"]),
                    "leases holding nothing",
                )
            )
        for lease in r["leases"]:
            owners = {clean_pids[p] for p in lease.get("pids", []) if p in clean_pids}
            if scenario["backend"] == "etcd" and lease["ttl"] <= _MEMBER_TTL:
                continue  # a member key of a version left earlier, lapsing (see above)
            if owners:
                found.append(
                    Violation(
                        "no-leaks",
                        f"v3 lease {lease['id']} (TTL {lease['ttl']} s left) still holds "
                        f"{lease['keys']} of {sorted(owners)}, which shut down",
                        sorted(owners),
                        tl.rel(r["t"]),
                        "lease of a node's key",
                    )
                )
    return found


# -- healthy nodes kept -----------------------------------------------------------------


def _healthy_kept(
    scenario: dict[str, Any], tl: Timeline, runner: list[Record], nodes: dict[str, list[Record]]
) -> list[Violation]:
    if scenario["backend"] != "etcd-v2":
        return []
    settings = scenario["settings"]
    interval = settings["keep_alive_interval"]
    lifetime = interval * settings["keep_alive_max_attempt"]
    tolerated = interval * (settings["keep_alive_max_attempt"] - 1) - 1.0
    pid_name = {}
    for name, records in nodes.items():
        for r in records:
            # Our nodes only: PyTorch's drop one another by their own heartbeats.
            if r["ev"] == "start" and r.get("impl") == "ours":
                pid_name[r["pid"]] = name
    found = []
    previous = None
    for state in (r for r in runner if r["ev"] == "state"):
        if previous is not None and previous.get("complete") and previous.get("participants"):
            gone = set(previous["participants"]) - set(state.get("participants") or {})
            for desc in sorted(gone):
                name = pid_name.get(_pid_of(desc))
                if name is None:
                    continue
                why = _dropped_unfairly(
                    name,
                    nodes,
                    (previous["t"], state["t"]),
                    previous["round"],
                    tl,
                    lifetime + interval,
                    tolerated,
                )
                if why:
                    found.append(
                        Violation(
                            "healthy-kept",
                            f"{name} was taken out of complete round {previous['round']} "
                            f"while it ran the round undisturbed ({why})",
                            [name],
                            tl.rel(state["t"]),
                        )
                    )
        previous = state
    return found


def _pid_of(desc: str) -> int | None:
    try:
        return int(desc.rsplit("_", 2)[1])
    except (IndexError, ValueError):
        return None


def _dropped_unfairly(
    name: str,
    nodes: dict[str, list[Record]],
    between: tuple[float, float],
    round_: int,
    tl: Timeline,
    horizon: float,
    tolerated: float,
) -> str | None:
    """Why taking ``name`` out was unfair, or ``None`` if it may have left on its own,
    was disturbed, or a clock ahead of its own may have judged it. ``between``: the
    runner's last look at the state with ``name`` in it, and its first without; the
    node was taken out at some moment in between (the runner may have been unable to
    look for a while: during an etcd fault, for instance), so a disturbance within
    ``horizon`` before any of it counts."""
    last_in, seen = between
    records = nodes.get(name, [])
    joined = [r for r in records if r["ev"] == "joined" and r["round"] == round_ and r["t"] < seen]
    if not joined:
        return None
    since = joined[-1]["t"]
    if any(r["ev"] in ("join_start", "stop", "exit") and since < r["t"] <= seen for r in records):
        return None  # it asked to leave (re-rendezvous or shutdown)
    if tl.disturbed(name, last_in - horizon, seen):
        return None
    mine = tl.clock_offset(name, seen)
    ahead = max((tl.clock_offset(other, seen) for other in nodes), default=0.0) - mine
    if ahead > tolerated:
        return None
    return (
        f"joined at {tl.rel(since)} s, no fault on it or etcd for {horizon:g} s, its clock "
        f"offset {mine:+g} s, the fastest clock {ahead:+g} s ahead of it (PyTorch tolerates "
        f"{tolerated:g} s)"
    )


# -- the operator's commands and the processes ------------------------------------------


def _operator_commands(tl: Timeline, runner: list[Record]) -> list[Violation]:
    found = []
    for cmd in runner:
        if cmd["ev"] != "command":
            continue
        if cmd["rc"] not in (0, 1) or "Traceback" in (cmd.get("stderr") or ""):
            found.append(
                Violation(
                    "operator-commands",
                    f"`{cmd['kind']} {' '.join(cmd['args'])}` ended with status {cmd['rc']}: "
                    f"{(cmd.get('stderr') or '').strip()[-400:]}",
                    [],
                    tl.rel(cmd["t0"]),
                )
            )
    return found


#: The last line of a traceback that names a rendezvous error: a torchrun agent fails
#: with it (its exit status is 1), as ``named-errors`` asks of a failure.
_NAMED_EXIT = re.compile(r"(?:^|\.)Rendezvous\w*Error: [^\n]*\s*$")
#: torchrun's exit when it is asked to leave (SIGTERM).
_TERMINATED = re.compile(r"SignalException: Process \d+ got signal: 15\s*$")


def _node_crashed(tl: Timeline, runner: list[Record]) -> list[Violation]:
    """A node that exited with an error of its own: not one killed, not a torchrun agent
    that failed with a named rendezvous error, nor one asked to leave (SIGTERM)."""
    left = {f["target"] for f in tl.faults if f["kind"] == "leave"}
    found = []
    for r in runner:
        if r["ev"] != "proc_end" or r.get("killed") or r.get("rc") in (0, None):
            continue
        stderr = r.get("stderr", "")
        terminated = r.get("rc") == -15 or _TERMINATED.search(stderr)
        if _NAMED_EXIT.search(stderr) or (r["node"] in left and terminated):
            continue
        found.append(
            Violation(
                "node-crashed",
                f"{r['node']} exited with status {r['rc']}: {stderr[-600:]}",
                [r["node"]],
                tl.rel(r["t"]),
            )
        )
    return found
