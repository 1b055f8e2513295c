"""Simulate one first rendezvous of N nodes: requests and bytes per node, and through etcd.

Usage::

    python benchmarks/sim_scale.py [--nodes 256 512 1024 4096 10000]
        [--protocol now progress] [--backends etcd etcd-v2] [--apis v2 v3]
        [--window-per-node 0.003] [--rtt 0.001] [--server-rate 1e9]
        [--slow 0.0] [--slow-delay 5] [--seed 1] [--json FILE] [--check FILE]

A deterministic, single-threaded discrete-event model: no threads, no etcd. Nodes arrive
spread over a window (``--window-per-node`` seconds times N, or ``--window``); each
request takes a round trip (``--rtt``) and its answer, like every watch event, leaves
etcd through one link of ``--server-rate`` bytes per second, in order (etcd sends every
byte of a rendezvous: a watch event to N watchers is N answers). An in-memory etcd keeps
created and modified indexes, compares-and-swaps, lists and fans out watch events; every
answer is built as etcd's JSON (v2: node objects with ``prevNode`` on a compare-and-swap
event; v3: the gateway's base64 keys and values), so its size is exact. The state values
are built with the library's own codecs: the legacy JSON by ``plan_admission`` (which
also freezes and completes a full state), the dynamic state by ``_encode_state`` and
base64, as the backends write them.

Two protocols:

``now``
    Every node reads the state, announces its key, lists the member keys, and watches
    the state: it receives every state write while it waits (on v2 a compare-and-swap
    event carries the new value and the previous one). Head of line: the oldest key not
    yet admitted lists again and admits every listed key in one compare-and-swap; a node
    whose older key did not act within the grace period admits without it.

``progress``
    Followers watch a small hint key written with every state write and read the state a
    constant number of times (at the start, and when the hint says final). Only the few
    oldest undecided nodes act, the p-th after ``gather + p * stagger`` seconds without
    progress (:class:`Rules`, per backend): it reads the
    state, lists (v3: only the keys created after the last decided one), admits every listed
    undecided key (a slow older one included) and writes the hint. One node relays
    (watches the state for writes not described by the hint).

Per (backend, API, protocol, N) it reports requests, kB sent and received per node,
full-state reads, listings, state and hint watch events per node, the number of state
writes W, the final state's size S, the largest request against etcd's
``--max-request-bytes`` (1.5 MiB), and the bytes of state history etcd keeps (MVCC
revisions until compaction; the v2 store's last 1000 events). ``--json FILE`` writes the
rows; ``--check FILE`` compares the ``now`` rows with measured ``bench_scale.py --json``
rows of the same N (benchmarks/results/diagnosis-bytes.json by default).
``benchmarks/plot_scale.py --sim FILE`` draws them; docs/scale.rst, "Ten thousand
nodes", discusses them.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import heapq
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from etcd_rendezvous._dynamic.etcd_backend import _node_value
from etcd_rendezvous._dynamic.progress import PROGRESS_SILENCE
from etcd_rendezvous._dynamic.state import NodeDesc, RendezvousState, _encode_state
from etcd_rendezvous._legacy import admission as legacy_admission
from etcd_rendezvous._legacy import feed as legacy_feed
from etcd_rendezvous._legacy.admission import Announced, plan_admission
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    etcd_v2_state_key,
    new_member_name,
)

HERE = Path(__file__).resolve().parent
DIAGNOSIS = HERE / "results" / "diagnosis-bytes.json"

#: etcd's default ``--max-request-bytes``.
MAX_REQUEST_BYTES = 1_572_864
#: Events the v2 store keeps for watches from an older index.
V2_HISTORY_EVENTS = 1000
#: Answers up to this size are not held up behind the large ones etcd is sending.
SMALL_MESSAGE = 16 * 1024
#: Seconds of an unchanged state before a node of the ``now`` protocol admits without
#: the older key it waits for (the backends' ``ADMISSION_GRACE``).
NOW_GRACE = 2.0

# -- the progress protocol's parameters, per backend ---------------------------------------


@dataclass(frozen=True)
class Rules:
    """The few numbers of the progress protocol (the backends' own constants)."""

    #: How many of the oldest undecided nodes may list and write a batch; the
    #: nodes behind them act only when nobody did for a while (not modelled).
    candidates: int
    #: Seconds the oldest undecided node waits for more keys before it lists...
    gather: float
    #: ... and each further candidate waits this many more without progress.
    stagger: float
    #: Full-state reads of a follower after the one at its start: when the hint says its
    #: key was decided, and when it says final (one read if the same write did both).
    reads_when_decided: int
    reads_when_final: int
    #: Whether a follower reads the hint once besides watching it.
    reads_hint: bool
    #: Seconds without a hint after which a waiting node reads the state itself; each
    #: further silent spell is ``silence_backoff`` times longer, up to ``silence_max``.
    silence: float
    silence_backoff: float
    silence_max: float


#: ``etcd``: the legacy backend's own constants; a decided worker reads the state once
#: ``min_workers`` joined, here at the final write.
LEGACY_RULES = Rules(
    candidates=legacy_admission.ADMIT_CANDIDATES,
    gather=legacy_admission.ADMIT_GATHER,
    stagger=legacy_admission.ADMIT_STAGGER,
    reads_when_decided=0,
    reads_when_final=1,
    reads_hint=False,
    silence=legacy_feed.SILENCE,
    silence_backoff=2.0,
    silence_max=legacy_feed.SILENCE_MAX,
)
#: ``etcd-v2``: 8 candidates (``_dynamic/admission.py``'s ``_STAGGER_CAP``) and its
#: ``PROGRESS_SILENCE``, without its random part; the gather and stagger are the model's
#: own, shorter than the backend's ``ADMIT_GATHER`` and ``ADMIT_STAGGER``. A decided node
#: reads the state once the round completes.
DYNAMIC_RULES = Rules(
    candidates=8,
    gather=0.0,
    stagger=0.1,
    reads_when_decided=0,
    reads_when_final=1,
    reads_hint=True,
    silence=PROGRESS_SILENCE,
    silence_backoff=1.0,
    silence_max=PROGRESS_SILENCE,
)
#: How many nodes watch the full state all along (the relay for writes of PyTorch's
#: workers, which write no hint).
RELAYS = 1

# -- etcd's answers, as bytes ------------------------------------------------------------

_EXPIRATION = "2026-11-25T23:35:00.123456789Z"
_HEADER = {"cluster_id": "14841639068965178418", "member_id": "10276657743932975437"}
_LEASE_ID = "7587899153430067219"


def _dumps(value: Any) -> str:
    """JSON as etcd (Go) writes it: no spaces."""
    return json.dumps(value, separators=(",", ":"))


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@dataclass
class Entry:
    """A key in the fake etcd."""

    key: str
    value: str
    created: int
    modified: int
    version: int
    ttl: int | None

    @cached_property
    def v2_value(self) -> _Quoted:
        """The value as a JSON string (v2), by its length."""
        return _Quoted(len(json.dumps(self.value)))

    @cached_property
    def v3_value(self) -> _Quoted:
        """The value in base64 as a JSON string (v3), by its length."""
        return _Quoted(4 * ((len(self.value.encode()) + 2) // 3) + 2)


@dataclass(frozen=True)
class _Quoted:
    """A JSON string of ``length`` characters (quotes included), counted without
    encoding it again: a state of a megabyte is read by thousands of nodes."""

    length: int


def _size(answer: Any) -> int:
    """The length of ``answer`` in JSON as etcd writes it (no spaces)."""
    extra = 0

    def quoted(value: Any) -> str:
        nonlocal extra
        if not isinstance(value, _Quoted):
            raise TypeError(f"cannot encode {value!r}")
        extra += value.length - 2
        return ""

    return len(json.dumps(answer, separators=(",", ":"), default=quoted)) + extra


def v2_node(entry: Entry) -> dict[str, Any]:
    """The v2 node object of ``entry``."""
    node: dict[str, Any] = {"key": entry.key, "value": entry.v2_value}
    if entry.ttl:
        node["expiration"] = _EXPIRATION
        node["ttl"] = entry.ttl
    node["modifiedIndex"] = entry.modified
    node["createdIndex"] = entry.created
    return node


def v3_kv(entry: Entry, lease: bool) -> dict[str, Any]:
    """The v3 gateway's kv object of ``entry``."""
    kv: dict[str, Any] = {
        "key": _b64(entry.key),
        "create_revision": str(entry.created),
        "mod_revision": str(entry.modified),
        "version": str(entry.version),
        "value": entry.v3_value,
    }
    if lease:
        kv["lease"] = _LEASE_ID
    return kv


def v3_header(revision: int) -> dict[str, Any]:
    return {**_HEADER, "revision": str(revision), "raft_term": "2"}


class Api:
    """The sizes of requests and answers of one etcd API."""

    def __init__(self, name: str) -> None:
        self.name = name

    # Each returns (bytes sent, bytes received).

    def get(self, entry: Entry | None, key: str, index: int) -> tuple[int, int]:
        if self.name == "v2":
            if entry is None:
                body = {"errorCode": 100, "message": "Key not found", "cause": key, "index": index}
                return 0, _size(body)
            return 0, _size({"action": "get", "node": v2_node(entry)})
        request = _size({"key": _b64(key)})
        if entry is None:
            return request, _size({"header": v3_header(index)})
        answer = {"header": v3_header(index), "kvs": [v3_kv(entry, False)], "count": "1"}
        return request, _size(answer)

    def put(
        self, entry: Entry, prev: Entry | None, action: str, index: int, lease: bool
    ) -> tuple[int, int]:
        """A plain write (create, set)."""
        if self.name == "v2":
            fields: dict[str, Any] = {"value": entry.value}
            if entry.ttl:
                fields["ttl"] = entry.ttl
            if action == "create":
                fields["prevExist"] = "false"
            answer: dict[str, Any] = {"action": action, "node": v2_node(entry)}
            if prev is not None:
                answer["prevNode"] = v2_node(prev)
            return len(urlencode(fields)), _size(answer)
        put: dict[str, Any] = {"key": _b64(entry.key), "value": _b64(entry.value)}
        if lease:
            put["lease"] = _LEASE_ID
        return _size(put), _size({"header": v3_header(index)})

    def cas(
        self, entry: Entry, prev: Entry, index: int, also: Entry | None = None
    ) -> tuple[int, int]:
        """A compare-and-swap of ``prev`` into ``entry`` (v3: one Txn; ``also``: a
        second put in it)."""
        if self.name == "v2":
            fields: dict[str, Any] = {"value": entry.value, "prevIndex": prev.modified}
            if entry.ttl:
                fields["ttl"] = entry.ttl
            answer = {"action": "compareAndSwap", "node": v2_node(entry), "prevNode": v2_node(prev)}
            return len(urlencode(fields)), _size(answer)
        success = [{"request_put": {"key": _b64(entry.key), "value": _b64(entry.value)}}]
        if also is not None:
            success.append({"request_put": {"key": _b64(also.key), "value": _b64(also.value)}})
        request = {
            "compare": [
                {
                    "target": "MOD",
                    "result": "EQUAL",
                    "key": _b64(entry.key),
                    "mod_revision": str(prev.modified),
                }
            ],
            "success": success,
            "failure": [{"request_range": {"key": _b64(entry.key)}}],
        }
        responses = [{"response_put": {"header": {"revision": str(index)}}}] * len(success)
        answer = {"header": v3_header(index), "succeeded": True, "responses": responses}
        return _size(request), _size(answer)

    def lease_grant(self, index: int) -> tuple[int, int]:
        answer = {"header": v3_header(index), "ID": _LEASE_ID, "TTL": "10"}
        return _size({"TTL": 10}), _size(answer)

    def count(self, prefix: str, index: int) -> tuple[int, int]:
        """A v3 ``count_only`` range over ``prefix`` with a create-revision window."""
        request = {
            "key": _b64(prefix),
            "range_end": _b64(prefix[:-1] + chr(ord(prefix[-1]) + 1)),
            "count_only": True,
            "min_create_revision": str(index),
            "max_create_revision": str(index),
        }
        return _size(request), _size({"header": v3_header(index), "count": "3"})

    def list_envelope(self, directory: str, index: int) -> tuple[int, int]:
        """A listing's bytes besides its entries."""
        if self.name == "v2":
            empty = {
                "action": "get",
                "node": {
                    "key": directory,
                    "dir": True,
                    "nodes": [],
                    "modifiedIndex": 5,
                    "createdIndex": 5,
                },
            }
            return 0, _size(empty)
        request = {"key": _b64(directory + "/"), "range_end": _b64(directory + "0")}
        answer = {"header": v3_header(index), "kvs": [], "count": "1000"}
        return _size(request), _size(answer)

    def list_entry(self, entry: Entry) -> int:
        """The bytes of one key in a listing (with its comma)."""
        if self.name == "v2":
            return _size(v2_node(entry)) + 1
        return _size(v3_kv(entry, True)) + 1

    def watch_open(self, key: str, index: int) -> tuple[int, int]:
        if self.name == "v2":
            return 0, 0
        request = {"create_request": {"key": _b64(key), "start_revision": str(index)}}
        created = {"result": {"header": v3_header(index), "created": True}}
        return _size(request), _size(created) + 1

    def event(self, entry: Entry, prev: Entry | None, action: str, index: int) -> int:
        """The bytes of the watch event of a write, to one watcher."""
        if self.name == "v2":
            answer: dict[str, Any] = {"action": action, "node": v2_node(entry)}
            if prev is not None:
                answer["prevNode"] = v2_node(prev)
            return _size(answer) + 1
        message = {"result": {"header": v3_header(index), "events": [{"kv": v3_kv(entry, False)}]}}
        return _size(message) + 1


# -- the two backends' keys and values ----------------------------------------------------


@dataclass(frozen=True)
class Names:
    """How long the names are: the run id and each node's host name (``{i}``: the
    node's number, for a host of its own; else all nodes share one, as in the
    benchmark), ``procs`` processes per host."""

    run_id: str = "scale-0123abcd"
    host: str = "127.0.0.1"
    procs: int = 4
    first_pid: int = 123456

    def host_of(self, node: int) -> str:
        return self.host.format(i=node, rack=node // 32)

    def local(self, node: int) -> tuple[int, int]:
        """(pid, local id) of the ``node``-th node."""
        if "{i}" in self.host:  # one agent per host
            return self.first_pid, 0
        return self.first_pid + node % self.procs, node // self.procs


#: Above this many nodes the states written before the last one are not all encoded:
#: their sizes are interpolated between exact encodings (see :class:`_Sizes`); the
#: final state is always encoded, with the backend's codec.
EXACT_UPTO = 2048
#: How many exact encodings the interpolation is made from.
_GRID = 32


class _Sizes:
    """The state values of one format and N, by how many nodes they admit."""

    def __init__(self) -> None:
        self._grid: list[tuple[int, int]] = []
        self._template = ""

    def state(
        self, admitted: Sequence[int], created: Sequence[int]
    ) -> tuple[str, int | None, bool]:
        """The value admitting ``admitted`` (node numbers in admission order, their keys'
        created indexes in ``created``): (value, TTL, final). Exact up to
        :data:`EXACT_UPTO` nodes and for the final state; else as long as the exact
        value would be (interpolated), cut from an exact value of the same kind."""
        nodes = self.nodes  # type: ignore[attr-defined]
        if nodes <= EXACT_UPTO or len(admitted) == nodes:
            return self._exact(admitted, created)  # type: ignore[attr-defined]
        if not self._grid:
            order = list(range(nodes))
            points = sorted({1 + (nodes - 2) * i // _GRID for i in range(_GRID + 1)})
            for k in points:
                self._grid.append((k, len(self._exact(order[:k], range(nodes))[0])))  # type: ignore[attr-defined]
            self._template, self._ttl, _ = self._exact(order[: nodes - 1], range(nodes))  # type: ignore[attr-defined]
        k = len(admitted)
        for (k0, n0), (k1, n1) in zip(self._grid, self._grid[1:], strict=False):
            if k0 <= k <= k1:
                length = n0 + (n1 - n0) * (k - k0) // max(1, k1 - k0)
                return self._template[:length], self._ttl, False
        raise ValueError(f"no state of {k} nodes")  # pragma: no cover


class LegacyFormat(_Sizes):
    """The legacy ``etcd`` backend: a JSON state, member keys ``v_1/node_<hex>``."""

    name = "etcd"

    def __init__(self, names: Names, nodes: int) -> None:
        super().__init__()
        self.layout = LegacyLayout(DEFAULT_PREFIX, names.run_id)
        self.state_key = self.layout.state_key
        self.directory = self.layout.version_dir("1")
        self.hint_key = self.directory + "/progress"
        self.nodes = nodes
        rng = random.Random(nodes)
        self.member_keys = [
            self.layout.member_key("1", new_member_name(rng.getrandbits(64))) for _ in range(nodes)
        ]
        who = [_dumps({"host": names.host_of(i), "pid": names.local(i)[0]}) for i in range(nodes)]
        self.member_values = [json.dumps(json.loads(w)) for w in who]  # as the worker spells it
        self.ttl = 10

    def _exact(
        self, admitted: Sequence[int], created: Sequence[int]
    ) -> tuple[str, int | None, bool]:
        """The state value admitting ``admitted``, from ``plan_admission``."""
        entries = [
            Announced(created[i], self.member_keys[i].rsplit("/", 1)[1], self.member_keys[i])
            for i in admitted
        ]
        opening: dict[str, Any] = {"status": "joinable", "version": "1", "participants": []}
        write = plan_admission(opening, entries, min_workers=self.nodes, max_workers=self.nodes)
        if write is None:  # pragma: no cover (an empty state has room)
            raise RuntimeError("nothing to admit")
        return json.dumps(write.state), write.ttl, write.state["status"] == "final"


class DynamicFormat(_Sizes):
    """The ``etcd-v2`` backend: a base64 pickle state, node keys ``<addr>_<pid>_<id>``."""

    name = "etcd-v2"

    def __init__(self, names: Names, nodes: int) -> None:
        super().__init__()
        layout = EtcdV2NodesLayout(names.run_id)
        self.state_key = etcd_v2_state_key(names.run_id)
        self.directory = layout.nodes_dir
        self.hint_key = self.directory + "/progress"
        self.nodes = nodes
        self.descs = [NodeDesc(names.host_of(i), *names.local(i)) for i in range(nodes)]
        self.member_keys = [layout.node_key(d.addr, d.pid, d.local_id) for d in self.descs]
        self.member_values = [_node_value(d) for d in self.descs]
        self.ttl = 30
        self._now = datetime(2026, 11, 25, 23, 35, 0, 123456, tzinfo=timezone.utc)

    def _exact(
        self, admitted: Sequence[int], created: Sequence[int]
    ) -> tuple[str, int | None, bool]:
        """The participants with one heartbeat time of the batch (as a batch write
        refreshes them), ranked once all are in; pickled by ``_encode_state``, in
        base64 as the backend stores it."""
        state = RendezvousState()
        beat = self._now
        for i in admitted:
            state.participants[self.descs[i]] = 0
            state.last_heartbeats[self.descs[i]] = beat
        complete = len(admitted) == self.nodes
        if complete:
            state.complete = True
            for rank, node in enumerate(sorted(state.participants)):
                state.participants[node] = rank
        return base64.b64encode(_encode_state(state)).decode(), 7200, complete


Format = LegacyFormat | DynamicFormat


def hint_value(index: int, decided_upto: int, final: bool, count: int) -> str:
    """The progress hint: which state write it describes and what it decided."""
    status = "final" if final else "joinable"
    return json.dumps(
        {
            "index": index,
            "status": status,
            "decided_upto": decided_upto,
            "skipped": [],
            "count": count,
            "waiting": 0,
        }
    )


# -- the simulation ------------------------------------------------------------------------


@dataclass
class Stats:
    """One node's counts."""

    requests: int = 0
    sent: int = 0
    received: dict[str, int] = field(default_factory=dict)
    state_reads: int = 0
    listings: int = 0
    state_events: int = 0
    hint_events: int = 0
    done: float = -1.0

    def add(self, op: str, sent: int, received: int, request: bool = True) -> None:
        self.requests += request
        self.sent += sent
        self.received[op] = self.received.get(op, 0) + received


@dataclass
class Settings:
    """The model's knobs (see the command line)."""

    window: float
    rtt: float
    server_rate: float
    slow: float
    slow_delay: float
    seed: int
    #: CPUs the nodes share (0: one each) and the bytes per second a node's CPU decodes,
    #: plus a fixed cost per message (a request's answer or a watch event).
    client_cpus: int = 0
    client_rate: float = 35e6
    client_overhead: float = 0.0007


class Sim:
    """One first rendezvous of ``nodes`` nodes."""

    def __init__(
        self, fmt: Format, api: str, protocol: str, nodes: int, settings: Settings
    ) -> None:
        self.fmt, self.api, self.protocol, self.n = fmt, Api(api), protocol, nodes
        self.rules = LEGACY_RULES if isinstance(fmt, LegacyFormat) else DYNAMIC_RULES
        self.settings = settings
        rng = random.Random(settings.seed * 7919 + nodes)
        self.arrival = sorted(rng.uniform(0.0, settings.window) for _ in range(nodes))
        self.slow = [rng.random() < settings.slow for _ in range(nodes)]
        order = list(range(nodes))
        rng.shuffle(order)
        self.fanout_order = {node: position for position, node in enumerate(order)}
        self.stats = [Stats() for _ in range(nodes)]
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = 0
        self.now = 0.0
        self.link_free = 0.0
        self.server_bytes = 0
        self.cpu_free = [0.0] * (settings.client_cpus or nodes)
        # etcd
        self.index = 10
        self.keys: dict[str, Entry] = {}
        self.watchers: dict[str, set[int]] = {}
        self.history_bytes = 0
        self.ring: deque[int] = deque(maxlen=V2_HISTORY_EVENTS)
        self.max_request_wire = 0
        self.max_request_raw = 0
        # the members, in created order
        self.created = [0] * nodes
        self.members: list[int] = []
        self.entry_bytes: list[int] = [0]  # prefix sums of listing entry sizes
        self.admitted: list[int] = []
        self.admitted_set: set[int] = set()
        self.next_pending = 0  # position in self.members of the oldest un-admitted key
        self.writes = 0
        self.state_version = 0  # bumped by every state write
        self.final = False
        self.creator: int | None = None
        self.decided_upto = 0
        self.state_bytes = 0
        self.max_state = 0
        # per node
        self.listed: list[int] = [0] * nodes  # members listed (count)
        self.listed_version: list[int] = [0] * nodes  # the state version when listed
        self.seen: list[int] = [0] * nodes  # state version seen
        self.announced = [False] * nodes
        self.generation = [0] * nodes
        self.decided_read = [False] * nodes
        self.fallbacks = [0] * nodes
        self.final_read = [False] * nodes
        self.admitted_at = [-1.0] * nodes
        self.just_admitted: list[int] = []
        self.heard = [0.0] * nodes  # when a node last received a watch event
        self.waiting = [0] * nodes  # requests sent and not yet answered
        self.last_heard = [0.0] * nodes

    # -- the event loop ----------------------------------------------------------------

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, action))

    def run(self) -> None:
        for node in range(self.n):
            self.at(self.arrival[node], lambda node=node: self.arrive(node))
        self.run_pending()

    def run_pending(self) -> None:
        """Run the scheduled events until none is left."""
        while self.heap:
            self.now, _, action = heapq.heappop(self.heap)
            action()

    def delay(self, node: int) -> float:
        """How late a slow node handles what reaches it, once its key is announced (a
        node slow to act while others wait for it)."""
        return self.settings.slow_delay if self.slow[node] and self.announced[node] else 0.0

    def transmit(self, nbytes: int) -> float:
        """Send ``nbytes`` on etcd's link; when they reach the client. Large answers
        queue behind each other; a small one goes between them (each answer has a
        connection of its own, and the link is shared among them)."""
        self.server_bytes += nbytes
        duration = nbytes / self.settings.server_rate
        if nbytes <= SMALL_MESSAGE:
            self.link_free += duration
            return self.now + duration + self.settings.rtt / 2
        start = max(self.now, self.link_free)
        self.link_free = start + duration
        return self.link_free + self.settings.rtt / 2

    def decoded(self, node: int, arrives: float, nbytes: int) -> float:
        """When ``node`` has processed ``nbytes`` that reached it at ``arrives``."""
        settings = self.settings
        cpu = node % len(self.cpu_free)
        start = max(arrives + self.delay(node), self.cpu_free[cpu])
        self.cpu_free[cpu] = start + settings.client_overhead + nbytes / settings.client_rate
        return self.cpu_free[cpu]

    def request(
        self,
        node: int,
        op: str,
        execute: Callable[[], tuple[int, int]],
        then: Callable[[], None] | None,
    ) -> None:
        """Send a request now: ``execute`` runs at etcd half a round trip later and
        returns (bytes sent, bytes received); ``then`` runs when the answer arrives."""

        def at_server() -> None:
            sent, received = execute()
            self.stats[node].add(op, sent, received)
            self.max_request_wire = max(self.max_request_wire, sent)
            arrives = self.decoded(node, self.transmit(received), received)
            self.at(arrives, answered)

        def answered() -> None:
            self.waiting[node] -= 1
            if then is not None:
                then()

        self.waiting[node] += 1
        self.at(self.now + self.settings.rtt / 2, at_server)

    # -- etcd --------------------------------------------------------------------------

    def write(
        self, key: str, value: str, ttl: int | None, action: str, also_put: bool = False
    ) -> tuple[Entry, Entry | None]:
        """Apply a write; fan its event out to the key's watchers; return (new, old)."""
        prev = self.keys.get(key)
        self.index += 0 if also_put else 1
        created = prev.created if prev is not None else self.index
        version = prev.version + 1 if prev is not None else 1
        entry = Entry(key, value, created, self.index, version, ttl)
        self.keys[key] = entry
        self.history_bytes += len(key) + len(value)
        self.max_request_raw = max(self.max_request_raw, len(key) + len(value) + 64)
        event = self.api.event(
            entry, prev if action == "compareAndSwap" else None, action, self.index
        )
        if self.api.name == "v2":
            self.ring.append(event)
        watchers = self.watchers.get(key, ())
        kind = "hint" if key == self.fmt.hint_key else "state"
        acting = self.acting(kind)
        # transmit() and decoded() for each watcher, written out: at N = 10,000 today's
        # protocol fans out ten million events.
        settings, stats, heard, cpu_free = self.settings, self.stats, self.heard, self.cpu_free
        cpus, rtt = len(cpu_free), settings.rtt / 2
        slow, announced = self.slow, self.announced
        duration = event / settings.server_rate
        work = settings.client_overhead + event / settings.client_rate
        small = event <= SMALL_MESSAGE
        self.server_bytes += event * len(watchers)
        for watcher in sorted(watchers, key=self.fanout_order.__getitem__):
            node_stats = stats[watcher]
            node_stats.received["watch"] = node_stats.received.get("watch", 0) + event
            if kind == "state":
                node_stats.state_events += 1
            else:
                node_stats.hint_events += 1
            if small:
                self.link_free += duration
                reaches = self.now + duration + rtt
            else:
                self.link_free = max(self.now, self.link_free) + duration
                reaches = self.link_free + rtt
            cpu = watcher % cpus
            if slow[watcher] and announced[watcher]:
                reaches += settings.slow_delay
            cpu_free[cpu] = arrives = max(reaches, cpu_free[cpu]) + work
            heard[watcher] = arrives
            if acting is None or watcher in acting or watcher == self.creator:
                self.at(arrives, lambda w=watcher, k=kind: self.on_event(w, k))
        return entry, prev

    def acting(self, kind: str) -> set[int] | None:
        """The watchers that may act on this event (``None``: all of them). The others
        only receive it: a node that is neither decided nor among the first undecided
        keeps waiting, and is told again when that changes."""
        if self.final:
            return None
        first = set()
        for position in range(self.next_pending, len(self.members)):
            member = self.members[position]
            if member not in self.admitted_set:
                first.add(member)
                if len(first) >= self.rules.candidates:
                    break
        return (
            first | set(self.just_admitted) if kind == "hint" or self.protocol == "now" else first
        )

    def watch(self, node: int, key: str) -> None:
        def execute() -> tuple[int, int]:
            self.watchers.setdefault(key, set()).add(node)
            return self.api.watch_open(key, self.index)

        self.request(node, "watch", execute, None)

    def unwatch(self, node: int) -> None:
        for watchers in self.watchers.values():
            watchers.discard(node)

    def get_state(self, node: int, then: Callable[[], None]) -> None:
        def execute() -> tuple[int, int]:
            self.stats[node].state_reads += 1
            self.seen[node] = max(self.seen[node], self.state_version)
            return self.api.get(self.keys.get(self.fmt.state_key), self.fmt.state_key, self.index)

        self.request(node, "read", execute, then)

    def listing(self, node: int, after: int, then: Callable[[], None]) -> None:
        """List the member keys (on v3 with ``after``: only those created later)."""

        def execute() -> tuple[int, int]:
            stats = self.stats[node]
            stats.listings += 1
            sent, envelope = self.api.list_envelope(self.fmt.directory, self.index)
            count = len(self.members)
            self.listed[node] = count
            self.listed_version[node] = self.state_version
            first = after if self.api.name == "v3" else 0
            return sent, envelope + self.entry_bytes[count] - self.entry_bytes[first]

        self.request(node, "list", execute, then)

    def announce(self, node: int, then: Callable[[], None] | None) -> None:
        """Write the node's member key (v3: a lease first)."""
        if self.api.name == "v3":
            self.request(node, "lease_grant", lambda: self.api.lease_grant(self.index), None)
        key, value = self.fmt.member_keys[node], self.fmt.member_values[node]

        def execute() -> tuple[int, int]:
            entry, _ = self.write(key, value, 10, "create")
            self.created[node] = entry.created
            self.members.append(node)
            self.entry_bytes.append(self.entry_bytes[-1] + self.api.list_entry(entry))
            self.announced[node] = True
            return self.api.put(entry, None, "create", self.index, self.api.name == "v3")

        self.request(node, "create", execute, then)

    def write_state(self, node: int, admit: list[int], decided_upto: int) -> tuple[int, int]:
        """Compare-and-swap a state admitting ``admit`` too (at etcd)."""
        admitted = self.admitted + [i for i in admit if i not in self.admitted_set]
        value, ttl, final = self.fmt.state(admitted, self.created)
        key = self.fmt.state_key
        prev = self.keys.get(key)
        self.writes += 1
        self.state_version += 1
        self.just_admitted = [i for i in admit if i not in self.admitted_set]
        for i in self.just_admitted:
            self.admitted_at[i] = self.now
        self.admitted = admitted
        self.admitted_set.update(admit)
        self.final = final
        self.state_bytes = len(value)
        self.max_state = max(self.max_state, len(value))
        while self.next_pending < len(self.members) and (
            self.members[self.next_pending] in self.admitted_set
        ):
            self.next_pending += 1
        entry, _ = self.write(key, value, ttl, "compareAndSwap" if prev else "create")
        self.seen[node] = self.state_version
        hint = None
        if self.protocol == "progress":
            self.decided_upto = decided_upto
            text = hint_value(entry.modified, decided_upto, final, len(admitted))
            if self.api.name == "v3":  # a second put in the same transaction
                hint, _ = self.write(self.fmt.hint_key, text, None, "set", also_put=True)
            else:  # v2: a write of its own once the compare-and-swap succeeded
                self.request(node, "write", lambda: self.put_hint(text), None)
        if prev is None:
            return self.api.put(entry, None, "create", self.index, False)
        return self.api.cas(entry, prev, self.index, also=hint)

    def put_hint(self, text: str) -> tuple[int, int]:
        entry, prev = self.write(self.fmt.hint_key, text, None, "set")
        return self.api.put(entry, prev, "set", self.index, False)

    # -- the nodes ---------------------------------------------------------------------

    def arrive(self, node: int) -> None:
        self.get_state(node, lambda: self.after_first_read(node))

    def after_first_read(self, node: int) -> None:
        if self.creator is None and self.fmt.state_key not in self.keys:
            self.creator = node  # creates the version, admitted in its opening state
            self.announce(node, lambda: self.create(node))
            return
        if self.protocol == "now":
            self.watch(node, self.fmt.state_key)
            self.announce(node, lambda: self.listing(node, 0, lambda: self.decide_now(node)))
        else:
            self.announce(node, lambda: self.start_following(node))

    def start_following(self, node: int) -> None:
        """Watch the hint, read it once, and decide."""
        self.watch(node, self.fmt.hint_key)
        key = self.fmt.hint_key
        if self.rules.reads_hint:
            self.request(
                node, "read", lambda: self.api.get(self.keys.get(key), key, self.index), None
            )
        self.follow(node)

    def create(self, node: int) -> None:
        def execute() -> tuple[int, int]:
            return self.write_state(node, [node], self.created[node])

        def created() -> None:
            if self.protocol == "now":
                self.watch(node, self.fmt.state_key)
            else:  # the relay
                for _ in range(RELAYS):
                    self.watch(node, self.fmt.state_key)
                self.watch(node, self.fmt.hint_key)
            self.check_done(node)

        self.request(node, "compare_and_swap", execute, created)

    def finish(self, node: int) -> None:
        """The node has its rank and world: the store exchange, then it stops watching."""
        stats = self.stats[node]
        if stats.done >= 0:
            return
        stats.done = self.now
        if self.protocol == "now" or node != self.creator:
            self.unwatch(node)
        # Rank 0 publishes its address in the store; the others read it.
        store = self.store_entry()
        if node == self.admitted[0]:
            self.request(
                node, "write", lambda: self.api.put(store, None, "set", self.index, False), None
            )
        else:
            self.request(node, "read", lambda: self.api.get(store, store.key, self.index), None)

    def store_entry(self) -> Entry:
        return Entry(self.fmt.directory + "/kv/MASTER_ADDR", "MTI3LjAuMC4x", 1, 1, 1, None)

    def check_done(self, node: int) -> bool:
        if self.final and self.seen[node] == self.state_version and node in self.admitted_set:
            self.finish(node)
            return True
        return False

    # now: head of line

    def on_event(self, node: int, kind: str) -> None:
        if self.stats[node].done >= 0 and node != self.creator:
            return
        self.last_heard[node] = self.now
        if kind == "state":
            self.seen[node] = self.state_version
            if self.protocol == "now":
                self.decide_now(node)
            return
        self.follow(node)

    def decide_now(self, node: int) -> None:
        if self.stats[node].done >= 0 or not self.announced[node]:
            return
        if (
            self.check_done(node)
            or node in self.admitted_set
            or not self.keys.get(self.fmt.state_key)
        ):
            return
        oldest = self.members[self.next_pending]
        if oldest != node:
            # an older key waits: after the grace, the next one admits without it
            if self.slow[oldest] and self.next_after(oldest) == node:
                version = self.state_version
                self.at(self.now + NOW_GRACE, lambda: self.grace_over(node, version))
            return
        if self.listed_version[node] < self.seen[node]:  # the state changed since
            self.listing(node, 0, lambda: self.admit_now(node))
        else:
            self.admit_now(node)

    def next_after(self, oldest: int) -> int | None:
        for position in range(self.next_pending + 1, len(self.members)):
            if self.members[position] not in self.admitted_set:
                return self.members[position]
        return None

    def grace_over(self, node: int, version: int) -> None:
        if version == self.state_version and node not in self.admitted_set:
            self.listing(node, 0, lambda: self.admit_now(node, without_older=True))

    def admit_now(self, node: int, without_older: bool = False) -> None:
        version = self.state_version

        def execute() -> tuple[int, int]:
            if version != self.state_version:  # lost the race
                prev = self.keys[self.fmt.state_key]
                return self.api.cas(prev, prev, self.index)
            listed = self.members[: self.listed[node]]
            mine = self.created[node]
            admit = [
                i
                for i in listed
                if i not in self.admitted_set and not (without_older and self.created[i] < mine)
            ]
            return self.write_state(node, admit, 0)

        self.request(node, "compare_and_swap", execute, lambda: self.decide_now(node))

    # progress: followers on the hint, a few candidates

    def follow(self, node: int) -> None:
        """On the hint (or at announce): read the state if decided; act if a candidate."""
        if self.stats[node].done >= 0:
            return
        self.generation[node] += 1
        if node in self.admitted_set:
            if self.final:
                if not self.final_read[node]:  # once: a late hint of an older write
                    self.final_read[node] = True  # (v2 writes it after the state) reads
                    for _ in range(self.rules.reads_when_final):  # nothing more
                        self.get_state(node, lambda: self.check_done(node))
            elif not self.decided_read[node]:
                self.decided_read[node] = True
                for _ in range(self.rules.reads_when_decided):
                    self.get_state(node, lambda: None)
            self.silence(node)
            return
        position = self.undecided_position(node)
        if position is None or position >= self.rules.candidates:
            self.silence(node)
            return
        if self.api.name == "v3":  # v3 counts the older undecided keys; v2 infers it
            self.request(
                node, "count", lambda: self.api.count(self.fmt.directory, self.index), None
            )
        generation = self.generation[node]
        wait = self.rules.gather + position * self.rules.stagger
        self.at(self.now + wait, lambda: self.candidate_acts(node, generation))

    def undecided_position(self, node: int) -> int | None:
        position = 0
        for i in range(self.next_pending, len(self.members)):
            member = self.members[i]
            if member == node:
                return position
            if member not in self.admitted_set:
                position += 1
                if position >= self.rules.candidates:
                    return position
        return None

    def silence(self, node: int, since: float | None = None) -> None:
        """Read the state if no hint reaches ``node`` for a while (see
        :attr:`Rules.silence`)."""
        generation = self.generation[node]
        armed = self.now if since is None else since
        rules = self.rules
        wait = min(rules.silence * rules.silence_backoff ** self.fallbacks[node], rules.silence_max)

        def check() -> None:
            if self.generation[node] != generation or self.stats[node].done >= 0:
                return
            if self.heard[node] > armed:  # a hint came: silent since then only
                self.silence(node, since=self.heard[node])
                return
            if self.waiting[node]:  # etcd is slow to answer: no reason to ask more
                self.silence(node, since=self.now)
                return
            self.fallbacks[node] += 1
            self.get_state(node, lambda: self.check_done(node) or self.follow(node))

        self.at(armed + wait, check)

    def candidate_acts(self, node: int, generation: int) -> None:
        if self.generation[node] != generation or node in self.admitted_set:
            return

        def admit() -> None:
            version = self.seen[node]  # the state it read: its compare-and-swap's base
            listed = self.members[: self.listed[node]]
            if all(i in self.admitted_set for i in listed[self.next_pending :]):
                self.follow(node)  # nothing left to admit: no write
                return

            def execute() -> tuple[int, int]:
                prev = self.keys.get(self.fmt.state_key)
                if version != self.state_version or prev is None:  # lost the race
                    lost = prev or Entry(self.fmt.state_key, "", 0, 0, 0, None)
                    return self.api.cas(lost, lost, self.index)
                admit = [i for i in listed if i not in self.admitted_set]
                upto = self.created[listed[-1]]
                return self.write_state(node, admit, upto)

            def written() -> None:
                self.decided_read[node] = node in self.admitted_set  # it wrote the state
                if not self.check_done(node):
                    self.follow(node)

            self.request(node, "compare_and_swap", execute, written)

        self.get_state(node, lambda: self.listing(node, self.position_of(self.decided_upto), admit))

    def position_of(self, index: int) -> int:
        """How many member keys were created at or before ``index``."""
        low, high = 0, len(self.members)
        while low < high:
            middle = (low + high) // 2
            if self.created[self.members[middle]] <= index:
                low = middle + 1
            else:
                high = middle
        return low

    # -- the results -------------------------------------------------------------------

    def row(self) -> dict[str, Any]:
        n = self.n
        stats = self.stats
        received = sum(sum(s.received.values()) for s in stats)
        by_op: dict[str, float] = {}
        for s in stats:
            for op, value in s.received.items():
                by_op[op] = by_op.get(op, 0) + value
        unfinished = sum(1 for s in stats if s.done < 0)
        return {
            "backend": self.fmt.name,
            "api": self.api.name,
            "protocol": self.protocol,
            "nodes": n,
            "seconds": round(max(s.done for s in stats), 3),
            "unfinished": unfinished,
            # when the last node that is not slow was admitted
            "admitted_seconds": round(
                max(t for t, slow in zip(self.admitted_at, self.slow, strict=True) if not slow), 3
            ),
            "requests": round(sum(s.requests for s in stats) / n, 2),
            "kb_sent": round(sum(s.sent for s in stats) / n / 1000, 2),
            "kb_received": round(received / n / 1000, 2),
            "kb_received_by_op": {
                op: round(v / n / 1000, 2) for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])
            },
            "state_reads": round(sum(s.state_reads for s in stats) / n, 2),
            "listings": round(sum(s.listings for s in stats) / n, 2),
            "state_events": round(sum(s.state_events for s in stats) / n, 2),
            "hint_events": round(sum(s.hint_events for s in stats) / n, 2),
            "state_writes": self.writes,
            "state_bytes": self.state_bytes,
            "max_request_bytes": self.max_request_raw,
            "max_request_wire_bytes": self.max_request_wire,
            "request_limit_share": round(self.max_request_raw / MAX_REQUEST_BYTES, 3),
            "history_mb": round(self.history_bytes / 1e6, 2),
            "v2_ring_mb": round(sum(self.ring) / 1e6, 2) if self.api.name == "v2" else 0.0,
            "etcd_sent_mb": round(self.server_bytes / 1e6, 1),
        }


_FORMATS: dict[tuple[str, int, Names], Format] = {}


def simulate(
    backend: str, api: str, protocol: str, nodes: int, settings: Settings, names: Names
) -> dict[str, Any]:
    """One row: the rendezvous of ``nodes`` nodes of ``backend`` over ``api``."""
    key = (backend, nodes, names)
    if key not in _FORMATS:  # shared by the rows of the same N (its interpolation grid)
        _FORMATS.clear()
        _FORMATS[key] = (
            LegacyFormat(names, nodes) if backend == "etcd" else DynamicFormat(names, nodes)
        )
    sim = Sim(_FORMATS[key], api, protocol, nodes, settings)
    sim.run()
    return sim.row()


# -- where etcd's request limit binds ---------------------------------------------------------


def state_size(backend: str, nodes: int, names: Names, distinct_beats: bool = False) -> int:
    """The size of the final state of ``nodes`` nodes, as stored."""
    if backend == "etcd":
        fmt = LegacyFormat(names, nodes)
        value, _, _ = fmt.state(range(nodes), list(range(10, 10 + nodes)))
        return len(value)
    dyn = DynamicFormat(names, nodes)
    if not distinct_beats:
        value, _, _ = dyn.state(range(nodes), [])
        return len(value)
    state = RendezvousState()
    state.complete = True
    base = datetime(2026, 11, 25, 23, 35, 0, tzinfo=timezone.utc)
    for rank, node in enumerate(sorted(dyn.descs)):
        state.participants[node] = rank
        state.last_heartbeats[node] = base.replace(microsecond=rank % 1_000_000)
    return len(base64.b64encode(_encode_state(state)))


def limit_nodes(backend: str, names: Names, distinct_beats: bool = False) -> int:
    """The smallest N whose final state (plus key and request framing) passes
    ``--max-request-bytes``: extrapolated, then checked exactly."""
    a, b = 4096, 8192
    size_a = state_size(backend, a, names, distinct_beats)
    size_b = state_size(backend, b, names, distinct_beats)
    per_node = (size_b - size_a) / (b - a)
    budget = MAX_REQUEST_BYTES - 256
    guess = int(b + (budget - size_b) / per_node)
    while state_size(backend, guess, names, distinct_beats) > budget:
        guess -= 64
    while state_size(backend, guess + 64, names, distinct_beats) <= budget:
        guess += 64
    return guess


LONG_NAMES = Names(
    run_id="3f2b8c1e-5d4a-4e6b-9c7d-0a1b2c3d4e5f",
    host="gpu-node-{i:05d}.rack-{rack:03d}.training.cluster.example.com",
)


def limits() -> list[dict[str, Any]]:
    """Where each state format reaches 1.5 MiB, with short and long names."""
    rows = []
    for label, names in (("short", Names()), ("long", LONG_NAMES)):
        for backend, distinct in (("etcd", False), ("etcd-v2", False), ("etcd-v2", True)):
            rows.append(
                {
                    "backend": backend,
                    "names": label,
                    "run_id": names.run_id,
                    "host": names.host_of(1234),
                    "heartbeats": "distinct" if distinct else "shared",
                    "bytes_per_node": round(state_size(backend, 1024, names, distinct) / 1024, 1),
                    "state_at_10000": state_size(backend, 10000, names, distinct),
                    "nodes_at_limit": limit_nodes(backend, names, distinct),
                }
            )
    return rows


# -- the comparison with measured rows -----------------------------------------------------


#: The benchmark's conditions (benchmarks/bench_scale.py on a 2-CPU machine): the nodes
#: start together, as threads sharing the machine's CPUs with etcd.
BENCH_CPUS = 2
#: ... and their first requests spread over this many seconds per node.
BENCH_WINDOW_PER_NODE = 0.003
#: ... and etcd, on the same machine, sends this many bytes per second.
BENCH_SERVER_RATE = 150e6


def check(measured_file: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Simulate the ``now`` protocol in the benchmark's conditions and compare it with the
    measured rows of ``measured_file`` (``bench_scale.py --json``)."""
    if not measured_file.exists():
        return []
    found = []
    for real in json.loads(measured_file.read_text())["rows"]:
        if "kb_received" not in real or real.get("mode", "first") != "first":
            continue
        settings = Settings(
            BENCH_WINDOW_PER_NODE * real["nodes"],
            args.rtt,
            BENCH_SERVER_RATE,
            0.0,
            0.0,
            args.seed,
            BENCH_CPUS,
            args.client_rate,
            args.client_overhead,
        )
        row = simulate(real["backend"], real["api"], "now", real["nodes"], settings, Names())
        found.append(
            {
                "backend": row["backend"],
                "api": row["api"],
                "nodes": row["nodes"],
                "sim_kb": row["kb_received"],
                "measured_kb": real["kb_received"],
                "ratio": round(row["kb_received"] / real["kb_received"], 2),
                "sim_kb_by_op": row["kb_received_by_op"],
                "measured_kb_by_op": real.get("kb_received_by_op", {}),
                "sim_requests": row["requests"],
                "measured_requests": round(real["writes"] + real["reads"], 2),
                "sim_seconds": row["seconds"],
                "measured_seconds": real["seconds"],
                "sim_state_writes": row["state_writes"],
            }
        )
    return found


def _table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("backend", "backend"),
        ("api", "API"),
        ("protocol", "protocol"),
        ("nodes", "N"),
        ("seconds", "s"),
        ("requests", "req/node"),
        ("kb_received", "kB in/node"),
        ("kb_sent", "kB out/node"),
        ("state_reads", "S reads"),
        ("listings", "lists"),
        ("state_events", "S events"),
        ("hint_events", "hints"),
        ("state_writes", "W"),
        ("state_bytes", "S bytes"),
        ("request_limit_share", "max req/1.5MiB"),
        ("history_mb", "history MB"),
        ("etcd_sent_mb", "etcd sent MB"),
    ]
    lines = ["  ".join(title for _, title in columns)]
    for row in rows:
        lines.append("  ".join(str(row[name]) for name, _ in columns))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[256, 512, 1024, 4096, 10000])
    parser.add_argument(
        "--protocol", nargs="+", default=["now", "progress"], choices=["now", "progress"]
    )
    parser.add_argument(
        "--backends", nargs="+", default=["etcd", "etcd-v2"], choices=["etcd", "etcd-v2"]
    )
    parser.add_argument("--apis", nargs="+", default=["v2", "v3"], choices=["v2", "v3"])
    parser.add_argument("--window", type=float, help="seconds over which the nodes arrive")
    parser.add_argument(
        "--window-per-node", type=float, default=0.003, help="else this many seconds times N"
    )
    parser.add_argument("--rtt", type=float, default=0.001, help="round trip, seconds")
    parser.add_argument(
        "--server-rate", type=float, default=1e9, help="bytes per second etcd sends"
    )
    parser.add_argument("--slow", type=float, default=0.0, help="fraction of slow nodes")
    parser.add_argument("--slow-delay", type=float, default=5.0, help="seconds a slow node lags")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the rows (and the limits) here")
    parser.add_argument(
        "--check", type=Path, default=DIAGNOSIS, help="measured bench_scale.py rows to compare"
    )
    parser.add_argument(
        "--gather",
        type=float,
        help="seconds the oldest undecided node waits before a batch (both backends)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the comparison")
    parser.add_argument("--no-limits", action="store_true", help="skip the request-size limits")
    parser.add_argument(
        "--client-cpus", type=int, default=0, help="CPUs the nodes share (0: one each)"
    )
    parser.add_argument(
        "--client-rate", type=float, default=35e6, help="bytes per second a CPU decodes"
    )
    parser.add_argument(
        "--client-overhead", type=float, default=0.0007, help="CPU seconds per message"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulations the command line asks for; print them (and write JSON)."""
    args = _parser().parse_args(argv)
    if args.gather is not None:
        global LEGACY_RULES, DYNAMIC_RULES  # noqa: PLW0603 (a command-line override)
        LEGACY_RULES = dataclasses.replace(LEGACY_RULES, gather=args.gather)
        DYNAMIC_RULES = dataclasses.replace(DYNAMIC_RULES, gather=args.gather)
    rows = []
    started = time.process_time()
    for nodes in args.nodes:
        settings = _settings(args, nodes)
        for backend in args.backends:
            for api in args.apis:
                for protocol in args.protocol:
                    rows.append(simulate(backend, api, protocol, nodes, settings, Names()))
                    print(_table(rows[-1:]).splitlines()[1], file=sys.stderr, flush=True)
    print(_table(rows))
    compared = [] if args.no_check else check(args.check, args)
    if compared:
        _print_compared(compared, args.check.name)
    limit_rows = [] if args.no_limits else limits()
    if limit_rows:
        _print_limits(limit_rows)
    print(f"\n({time.process_time() - started:.1f} CPU s)", file=sys.stderr)
    if args.json:
        document = {"model": _model(args), "rows": rows, "compared": compared, "limits": limit_rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


def _settings(args: argparse.Namespace, nodes: int) -> Settings:
    """The model's settings for ``nodes`` nodes, from the command line."""
    window = args.window if args.window is not None else args.window_per_node * nodes
    return Settings(
        window,
        args.rtt,
        args.server_rate,
        args.slow,
        args.slow_delay,
        args.seed,
        args.client_cpus,
        args.client_rate,
        args.client_overhead,
    )


def _print_compared(compared: list[dict[str, Any]], measured: str) -> None:
    """Print the ``now`` rows in the benchmark's conditions against the ``measured`` ones."""
    print(f"\n'now' in the benchmark's conditions vs measured ({measured}):")
    for entry in compared:
        print(
            f"  {entry['backend']:8} {entry['api']} N={entry['nodes']:<5} kB in/node: sim "
            f"{entry['sim_kb']:7.1f} measured {entry['measured_kb']:7.1f} "
            f"ratio {entry['ratio']:.2f}; requests/node {entry['sim_requests']} vs "
            f"{entry['measured_requests']}; s {entry['sim_seconds']} vs "
            f"{entry['measured_seconds']}; W {entry['sim_state_writes']}"
        )
        print(f"      sim {entry['sim_kb_by_op']}\n      bench {entry['measured_kb_by_op']}")


def _print_limits(limit_rows: list[dict[str, Any]]) -> None:
    """Print where the final state reaches etcd's request size limit."""
    print(f"\nWhere the final state reaches --max-request-bytes ({MAX_REQUEST_BYTES} B):")
    for entry in limit_rows:
        print(
            f"  {entry['backend']:8} {entry['names']:5} names, {entry['heartbeats']:8} "
            f"heartbeats: {entry['bytes_per_node']} B/node, "
            f"{entry['state_at_10000'] / 1e6:.2f} MB at 10,000, limit at N = "
            f"{entry['nodes_at_limit']}"
        )


def _model(args: argparse.Namespace) -> dict[str, Any]:
    """The model's parameters, for the JSON document."""
    return {
        "window_per_node": args.window_per_node,
        "window": args.window,
        "rtt": args.rtt,
        "server_rate": args.server_rate,
        "slow": args.slow,
        "slow_delay": args.slow_delay,
        "seed": args.seed,
        "rules": {
            "etcd": dataclasses.asdict(LEGACY_RULES),
            "etcd-v2": dataclasses.asdict(DYNAMIC_RULES),
        },
        "max_request_bytes": MAX_REQUEST_BYTES,
    }


if __name__ == "__main__":
    sys.exit(main())
