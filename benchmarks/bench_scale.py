"""A rendezvous of 8 to 256 nodes: seconds, etcd requests, bytes and client CPU per node.

Usage::

    python benchmarks/bench_scale.py [--nodes 8 64 256] [--procs P] [--timeout 60]
        [--backends etcd etcd-v2] [--apis v2 v3] [--impls ours torch] [--breakdown]
    python benchmarks/bench_scale.py --rerendezvous [--nodes ...] [--monitor-interval 0.1]
        [--keep-alive-interval 2]
    python benchmarks/bench_scale.py --heartbeats [--heartbeat-nodes 256]
        [--keep-alive-interval 2] [--heartbeat-seconds 30]

Each also takes ``--json FILE``: the rows as JSON, which ``benchmarks/plot_scale.py``
draws (``docs/scale.rst`` shows the results and their plots). Many processes of few
nodes, and handlers made as a launcher makes them::

    python benchmarks/bench_scale.py --nodes 256 512 1024 --per-proc 16 --nice 15 --counts
    python benchmarks/bench_scale.py --nodes 1024 --procs 4 --harness plain --counts
        [--create before|in-node] [--start gated|at-signal] [--start-method spawn|fork]
        [--jitter S] [--backends etcd etcd-v2 c10d --impls ours torch]

(``docs/scale.rst``, "Many processes, plain handlers", says what each changes.)

``BENCH_PYSPY_DIR=<dir>`` samples the first process of each row with ``py-spy`` (``pip
install py-spy``) from the start signal until its nodes are done: the thread holding the
GIL, that is where the process's CPU goes, into ``<dir>/<pid>.txt`` (collapsed stacks,
for ``flamegraph.pl`` or a ``sort | uniq``).
``BENCH_LOG_DIR=<dir>`` logs each node process to ``<dir>/<pid>.log``, each line with
its wall-clock time, so that the processes' logs merge into one timeline (INFO;
``BENCH_LOG_DEBUG=1`` adds the library's DEBUG messages, which slow a row down).

One etcd 3.5 is started with the v2 API enabled, so it serves both APIs (bundled etcd
3.5 unless ``ETCD_BINARY_PATH`` says otherwise). For each node count, backend
(``etcd``, the legacy state machine; ``etcd-v2``, the dynamic rendezvous), etcd API and
implementation (ours; PyTorch 2.13's own backends on v2, which is all they speak,
when torch is installed), N nodes run as threads, spread over P processes (``--procs``;
by default 1 up to 64 nodes, else 2), each node with its own handler and connection.
The handlers are created first, then the parent process gives the start signal.
Every row is checked: the ranks are exactly 0 .. N-1 and every node sees world size N.
Each variant gets ``min_nodes = max_nodes = N`` (the rendezvous completes when the last
node arrives), ``last_call_timeout=1`` and a ``--timeout`` (s) after which the nodes
give up and the row says ``timeout``; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0
publishes its address through the etcd store and starts no TCPStore). Measured:

* the first rendezvous (default): **seconds** from the start signal to the last rank;
  **writes/node**, **reads/node** and **keep-alive/node**: the etcd requests of that
  interval, from etcd's ``/metrics``, divided by N, classified by
  ``tests/support/etcd_requests.py`` (v2: GET and watches are reads, PUT/POST/DELETE writes,
  TTL refreshes keep-alive; v3: Range, Watch, LeaseTimeToLive reads, Put, Txn,
  DeleteRange, LeaseGrant, LeaseRevoke writes, LeaseKeepAlive keep-alive). ``etcd-v2``
  gets ``keep_alive_interval=30`` so its heartbeats fall outside the interval.
* ``--rerendezvous``: after a first rendezvous, at the start signal one node leaves (its
  handler stops its keep-alive, as if its process had died) and a replacement calls
  ``next_rendezvous()``; the others act as torchrun's agent does while its workers are
  healthy (``torch/distributed/elastic/agent/server/api.py``, ``_invoke_run``): every
  ``--monitor-interval`` seconds they call ``num_nodes_waiting()`` and, once it is
  positive, ``next_rendezvous()``. Reported: **seconds** to the last rank of the new
  round, **detect** (seconds until the first node saw a node waiting), the requests per
  node (the polls included) and **polls/node**. The legacy backend notices the departure
  when the node's keep-alive key lapses (TTL 10 s, refreshed every 5 s); ``etcd-v2``
  when its heartbeats are ``keep_alive_max_attempt`` (3) ``--keep-alive-interval`` old,
  its default 2 s here: heartbeats during the interval are counted.
* ``--heartbeats`` (``etcd-v2`` only): ``--heartbeat-nodes`` nodes complete a rendezvous
  with ``keep_alive_interval = --keep-alive-interval``, then for ``--heartbeat-seconds``
  the heartbeat threads run alone: requests per node **per minute**.

Every row also has, per node, the **KB** the clients received from etcd and sent to it
(``kB in``, ``kB out``: HTTP bodies, watch streams included, counted by the transport:
``transport.bytes_received`` and ``transport.bytes_sent`` of
:mod:`etcd_rendezvous.metrics`), on v3 the **KB etcd's gRPC server sent**
(``srv kB``: ``etcd_network_client_grpc_sent_bytes_total``, through the JSON gateway;
etcd counts no v2 bytes), and the **client CPU** (``CPU ms``: the CPU time of all the
row's processes in the measured phase, divided by N; the nodes are threads, so this
includes their share of the GIL's overhead).

``--breakdown`` prints each row's requests by API and method, per node, the KB per node
received by operation (``read``, ``list``, ``watch``, ...), and the CPU seconds of the
row's busiest process in the measured interval: close to the row's seconds, the
client's CPU is the bottleneck and more ``--procs`` help.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _bench_common import (
    APIS,
    BACKENDS,
    C10D,
    IMPLS,
    ThreadDeaths,
    Variant,
    handler_factory,
    release,
    torch_available,
    variants,
)

from etcd_rendezvous._transport import endpoints  # (the jitter's seam: _add_jitter)
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.metrics import MetricsCollector
from support.etcd_requests import (
    Bytes,
    Requests,
    changes,
    count_bytes,
    count_requests,
    read_metrics,
    server_cpu,
)

FIRST, RERENDEZVOUS, HEARTBEATS = "first", "rerendezvous", "heartbeats"
#: The harnesses (``--harness``): the benchmark's own choices, or a user's launcher's.
PREPARED, PLAIN = "prepared", "plain"
#: Where handlers are made (``--create``), how node threads begin (``--start``).
BEFORE, IN_NODE = "before", "in-node"
GATED, AT_SIGNAL = "gated", "at-signal"

#: The library's counters shown per node (``--counts``): the column title of each.
COUNTERS = {
    "lost CAS": ("transport.refusals", {"op": "compare_and_swap"}),
    "lost create": ("transport.refusals", {"op": "create"}),
    "state reads": ("rendezvous.state_reads", {}),
    "decodes": ("rendezvous.state_decodes", {}),
    "events": ("transport.watch_events", {}),
    "silence": ("rendezvous.silence_reads", {}),
    "retries": ("transport.retries", {}),
    "requests": ("transport.requests", {}),
}

#: Seconds the processes of a row may take to start and create their handlers.
_SETUP_TIMEOUT = 300.0
#: Seconds a row's processes get past the nodes' own timeout before they are killed.
_MARGIN = 15.0
#: Seconds past the nodes' own timeout (from the start signal) that a process waits for
#: its nodes before it reports the ones not done: a call that overruns its deadline by
#: less is measured (``longest next_rendezvous()``), one that overruns it by more is
#: reported as not done.
_OVERRUN = 10.0


# -- in each process of a row -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one process of a row does (sent to it, so plain data)."""

    variant: Variant
    endpoint: str
    run_id: str
    #: The world size: all the nodes of the row, in every process.
    nodes: int
    #: The nodes of this process.
    count: int
    mode: str
    options: dict[str, str]
    #: Whether the node that leaves, and its replacement, are in this process.
    leaves: bool
    monitor_interval: float
    timeout: float
    #: Where the handlers are made: before the start signal (:data:`BEFORE`), or by
    #: each node's thread after it (:data:`IN_NODE`), as a launcher that makes the
    #: handler when its job starts.
    create: str = "before"
    #: How the node threads begin: all started before the signal and released together
    #: (:data:`GATED`), or started one after the other once the signal came
    #: (:data:`AT_SIGNAL`).
    start: str = "gated"
    #: Seconds of random delay (0 to this) before each etcd request (see
    #: :func:`_add_jitter`).
    jitter: float = 0.0
    #: The nice value the process adds to its own (``--nice``).
    nice: int = 0
    #: :data:`PREPARED`: the handlers' parameters the benchmark chooses; :data:`PLAIN`:
    #: only what a user must give (see ``handler_factory``), and no
    #: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``.
    harness: str = PREPARED


@dataclass(frozen=True)
class NodeResult:
    """What one node saw (times from ``time.monotonic()``, the same in every process)."""

    rank: int = -1
    world_size: int = -1
    finished: float = 0.0
    #: ``num_nodes_waiting()`` calls before ``next_rendezvous()`` (re-rendezvous).
    polls: int = 0
    #: When a poll saw a node waiting (re-rendezvous).
    detected: float = 0.0
    error: str = ""
    #: When ``next_rendezvous()`` was called (0: never; the handler's creation failed).
    called: float = 0.0


@dataclass(frozen=True)
class Phase:
    """What one process reports of a phase: its nodes' results, the CPU seconds the
    process used from the start signal until its last node was done, and the HTTP body
    bytes its transports received and sent meanwhile (received also by ``op``)."""

    results: list[NodeResult]
    cpu: float
    received: float = 0.0
    sent: float = 0.0
    received_by_op: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The CPU seconds of every process of the row, summed (in the parent's sum).
    cpu_total: float = 0.0
    #: The library's counters of :data:`COUNTERS`, by column title (summed).
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The CPU seconds of each node's process, divided by its nodes (one per process).
    cpu_per_node: list[float] = dataclasses.field(default_factory=list)


def _received_by_op(collected: MetricsCollector) -> dict[str, float]:
    """``transport.bytes_received`` by ``op``, from what ``collected`` added up."""
    by_op: dict[str, float] = {}
    for entry in collected.snapshot()["counters"]:
        if entry["name"] == "transport.bytes_received":
            op = entry["labels"].get("op", "other")
            by_op[op] = by_op.get(op, 0.0) + entry["value"]
    return by_op


def _counters(collected: MetricsCollector) -> dict[str, float]:
    """The counters of :data:`COUNTERS` that ``collected`` added up."""
    return {title: collected.counter(name, **labels) for title, (name, labels) in COUNTERS.items()}


def _join(handler: Any) -> NodeResult:
    called = time.monotonic()
    try:
        info = handler.next_rendezvous()
    except Exception as exc:  # the parent reports it
        error = f"{type(exc).__name__}: {exc}"
        return NodeResult(error=error, finished=time.monotonic(), called=called)
    return NodeResult(info.rank, info.world_size, time.monotonic(), called=called)


def _add_jitter(seconds: float) -> None:
    """Delay every etcd request of this process by a random 0 to ``seconds`` s, as a
    network of uneven latency would: the benchmark wraps the transport's one function
    that sends one request (``try_once``, which the failover loop calls)."""
    if seconds <= 0:
        return
    send_once = endpoints.try_once

    def jittered(send: Any, endpoint: int, cap: float | None) -> Any:
        time.sleep(random.uniform(0.0, seconds))
        return send_once(send, endpoint, cap)

    endpoints.try_once = jittered  # type: ignore[assignment]


def _agent(handler: Any, interval: float, timeout: float) -> NodeResult:
    """What torchrun's agent does while its workers are healthy: poll
    ``num_nodes_waiting()`` every ``interval`` s; re-rendezvous once it is positive."""
    deadline = time.monotonic() + timeout
    polls = 0
    while True:
        time.sleep(interval)
        polls += 1
        if handler.num_nodes_waiting() > 0:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no node was waiting within {timeout} s")
    detected = time.monotonic()
    return dataclasses.replace(_join(handler), polls=polls, detected=detected)


def _run_nodes(
    calls: Sequence[Callable[[], NodeResult]],
    ready: Callable[[], None],
    go: Event,
    timeout: float,
    on_go: Callable[[], None] = lambda: None,
    start: str = GATED,
) -> Phase:
    """Each call in a thread of its own: ``ready()`` tells the parent that the process is
    ready, the parent sets ``go``; then ``on_go()`` and every call runs. With ``start``
    :data:`GATED` the threads are started before ``ready()`` and released together;
    with :data:`AT_SIGNAL` they are started one after the other once ``go`` is set. A
    call not done within ``timeout`` s plus :data:`_OVERRUN` (from the signal) says so in
    its result."""
    released = threading.Event()
    late = f"TimeoutError: not done within {timeout + _OVERRUN:g} s of the start"
    results = [NodeResult(error=late)] * len(calls)

    def node(i: int, call: Callable[[], NodeResult]) -> None:
        released.wait()
        try:
            results[i] = call()
        except Exception as exc:  # the parent reports it
            results[i] = NodeResult(error=f"{type(exc).__name__}: {exc}", finished=time.monotonic())

    threads = [
        threading.Thread(target=node, args=(i, call), name=f"node-{i}", daemon=True)
        for i, call in enumerate(calls)
    ]
    if start == GATED:
        for thread in threads:
            thread.start()
    ready()
    if not go.wait(_SETUP_TIMEOUT + timeout):
        raise RuntimeError("the parent gave no start signal")
    with MetricsCollector() as collected:
        cpu = time.process_time()
        deadline = time.monotonic() + timeout + _OVERRUN
        on_go()
        released.set()
        if start != GATED:
            for thread in threads:
                thread.start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        cpu = time.process_time() - cpu
    return Phase(
        list(results),
        cpu,
        received=collected.counter("transport.bytes_received"),
        sent=collected.counter("transport.bytes_sent"),
        received_by_op=_received_by_op(collected),
        cpu_total=cpu,
        counters=_counters(collected),
        cpu_per_node=[cpu / max(len(calls), 1)],
    )


def _child(plan: Plan, index: int, signals: tuple[Event, Event, Event], out: Any) -> None:
    """One process of a row: create the handlers, report ready, then run each phase on
    the parent's signal (start, second round, release); reports go to ``out``."""
    start, second, done = signals
    if os.environ.get("BENCH_LOG_DIR"):  # each process's log, for looking into a row
        logging.basicConfig(
            filename=os.path.join(os.environ["BENCH_LOG_DIR"], f"{os.getpid()}.log"),
            level=logging.INFO,
            format="%(created).3f %(relativeCreated)8.0f %(threadName)s %(name)s %(message)s",
            force=True,
        )
        if os.environ.get("BENCH_LOG_DEBUG"):  # the library's own DEBUG messages too
            logging.getLogger("etcd_rendezvous").setLevel(logging.DEBUG)
    deaths = ThreadDeaths()
    threading.excepthook = deaths
    _add_jitter(plan.jitter)
    if plan.nice:
        os.nice(plan.nice)
    if plan.harness == PLAIN:
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    make = handler_factory(
        plan.variant, plan.endpoint, plan.nodes, plan.options, plain=plan.harness == PLAIN
    )
    handlers: list[Any] = []
    try:
        if plan.create == IN_NODE:
            calls = [lambda: _join(_made(handlers, make(plan.run_id))) for _ in range(plan.count)]
        else:
            handlers.extend(make(plan.run_id) for _ in range(plan.count + plan.leaves))
            # The replacement, if any, is the last handler; it joins in the second round.
            calls = [_bind(_join, handler) for handler in handlers[: plan.count]]
        with _sampled(index == 0):
            joined = _run_nodes(
                calls,
                lambda: out.put(("ready", index, None)),
                start,
                plan.timeout,
                start=plan.start,
            )
        out.put(("joined", index, joined))
        if plan.mode == RERENDEZVOUS:
            again = _second_round(
                plan, handlers, lambda: out.put(("ready again", index, None)), second
            )
            out.put(("rejoined", index, again))
        # Released once the parent has read etcd's counters (or given up on the row).
        done.wait(_SETUP_TIMEOUT + 3 * plan.timeout)
    except BaseException:
        out.put(("failed", index, traceback.format_exc()))
    finally:
        for handler in handlers:
            release(handler, plan.variant.impl)
        out.put(("done", index, deaths.seen))


@contextlib.contextmanager
def _sampled(wanted: bool) -> Iterator[None]:
    """Sample this process with ``py-spy`` while in the block, if ``wanted`` and
    ``BENCH_PYSPY_DIR`` is set (see the module's documentation)."""
    folder = os.environ.get("BENCH_PYSPY_DIR")
    if not wanted or not folder:
        yield
        return
    output = os.path.join(folder, f"{os.getpid()}.txt")
    command = ["py-spy", "record", "--pid", str(os.getpid()), "--rate", "500", "--gil"]
    spy = subprocess.Popen([*command, "--format", "raw", "--output", output, "--nonblocking"])
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()


def _bind(call: Callable[[Any], NodeResult], handler: Any) -> Callable[[], NodeResult]:
    return lambda: call(handler)


def _made(handlers: list[Any], handler: Any) -> Any:
    """``handler``, kept in ``handlers`` to be released at the end (``list.append`` is
    atomic)."""
    handlers.append(handler)
    return handler


def _second_round(
    plan: Plan, handlers: list[Any], ready: Callable[[], None], second: Event
) -> Phase:
    """The re-rendezvous: the leaving node stops, its replacement joins, the others poll."""
    stays = handlers[: plan.count - 1] if plan.leaves else handlers
    calls = [_bind(lambda h: _agent(h, plan.monitor_interval, plan.timeout), h) for h in stays]

    def leave() -> None:
        if plan.leaves:
            release(handlers[plan.count - 1], plan.variant.impl)

    if plan.leaves:
        calls.append(_bind(_join, handlers[-1]))
    return _run_nodes(calls, ready, second, plan.timeout, on_go=leave)


# -- in the parent ------------------------------------------------------------------------


class Server(Protocol):
    """The etcd a row runs against: one the benchmark started, or :class:`External`."""

    @property
    def client_url(self) -> str: ...

    def get_endpoint(self) -> str: ...


class RowError(Exception):
    """A row could not be measured; the message says why."""


class _Inbox:
    """The reports of a row's processes, by kind."""

    def __init__(self, reports: Any, processes: list[BaseProcess]) -> None:
        self._reports = reports
        self._processes = processes
        self._held: dict[tuple[str, int], Any] = {}

    def gather(self, kind: str, deadline: float) -> list[Any] | None:
        """Every process's ``kind`` report, in process order; ``None`` if one is still
        missing at ``deadline``.

        Raises:
            RowError: a process failed, or died without reporting.
        """
        count = len(self._processes)
        while sum(k == kind for k, _ in self._held) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                what, index, payload = self._reports.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [p.name for p in self._processes if p.exitcode not in (None, 0)]
                if dead:
                    raise RowError(f"process(es) {', '.join(dead)} died") from None
                continue
            if what == "failed":
                raise RowError(f"process {index}: {payload.strip().splitlines()[-1]}")
            self._held[what, index] = payload
        return [self._held.pop((kind, i)) for i in range(count)]


@dataclass
class Outcome:
    """One row's measurement, or why there is none (``problem``)."""

    seconds: float = 0.0
    detect: float = 0.0
    polls: float = 0.0
    #: The seconds the requests were counted over (heartbeats).
    window: float = 0.0
    requests: Requests | None = None
    #: CPU seconds of the busiest process of the row in the measured phase (first
    #: rendezvous, re-rendezvous): near ``seconds``, the client's CPU is the bottleneck.
    cpu: float = 0.0
    #: CPU seconds of all the row's processes in the measured phase, summed.
    cpu_total: float = 0.0
    #: HTTP body bytes the clients received from etcd and sent to it (all processes).
    client_received: float = 0.0
    client_sent: float = 0.0
    #: ``client_received`` by operation.
    received_by_op: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Bytes etcd's gRPC server exchanged with its clients (v3; zero on v2).
    server: Bytes | None = None
    #: CPU seconds etcd's process used in the measured phase.
    server_cpu: float = 0.0
    #: The library's counters of :data:`COUNTERS`, summed over the nodes.
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The most CPU seconds per node of any process (its CPU over its nodes).
    busiest_per_node: float = 0.0
    #: The longest ``next_rendezvous()`` call, and the latest a node called it (seconds
    #: from the start signal: with the plain harness, its handler's creation).
    longest_call: float = 0.0
    last_called: float = 0.0
    problem: str = ""


def _check(results: list[NodeResult], nodes: int, timeout: float, started: float) -> None:
    """Raise :class:`RowError` unless every node got a rank in 0 .. N-1, once, in a
    world of N (a node that timed out makes it ``timeout``). The message says how many
    nodes got a rank and when the last did, and how many failed of each error."""
    errors = [r.error for r in results if r.error]
    if errors:
        ranked = [r.finished - started for r in results if not r.error]
        last = f", the last at {max(ranked):.1f} s" if ranked else ""
        kinds: dict[str, int] = {}
        for error in errors:
            kind = error.split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        failed = max((r.finished - started for r in results if r.error and r.finished), default=0)
        why = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        seen = f"{len(ranked)} of {nodes} ranked{last}; failed: {why} (by {failed:.1f} s)"
        if any("Timeout" in error for error in errors):
            raise RowError(f"timeout ({seen}); the first: {errors[0][:300]}")
        raise RowError(f"{len(errors)} node(s) failed ({seen}); the first: {errors[0][:300]}")
    ranks = sorted(r.rank for r in results)
    if ranks != list(range(nodes)):
        raise RowError(f"the ranks are not 0 .. {nodes - 1}: {ranks}")
    sizes = {r.world_size for r in results}
    if sizes != {nodes}:
        raise RowError(f"world sizes {sorted(sizes)}, not {nodes}")


def _gathered(inbox: _Inbox, kind: str, deadline: float, timeout: float) -> Phase:
    """Every node's result of one phase, and the CPU seconds of the busiest process;
    :class:`RowError` (timeout) if late."""
    phases: list[Phase] | None = inbox.gather(kind, deadline)
    if phases is None:
        raise RowError(f"timeout (not done within {timeout:g} s)")
    results = [result for phase in phases for result in phase.results]
    by_op: dict[str, float] = {}
    for phase in phases:
        for op, value in phase.received_by_op.items():
            by_op[op] = by_op.get(op, 0.0) + value
    counters: dict[str, float] = {}
    for phase in phases:
        for title, value in phase.counters.items():
            counters[title] = counters.get(title, 0.0) + value
    return Phase(
        results,
        max(phase.cpu for phase in phases),
        received=sum(phase.received for phase in phases),
        sent=sum(phase.sent for phase in phases),
        received_by_op=dict(sorted(by_op.items(), key=lambda item: -item[1])),
        cpu_total=sum(phase.cpu for phase in phases),
        counters=counters,
        cpu_per_node=[cpu for phase in phases for cpu in phase.cpu_per_node],
    )


def _counted(phase: Phase, delta: dict[str, float], **fields: Any) -> Outcome:
    """A measured phase's outcome: etcd's counters that changed (``delta``) and what the
    processes counted."""
    return Outcome(
        requests=count_requests(delta),
        server=count_bytes(delta),
        server_cpu=server_cpu(delta),
        cpu=phase.cpu,
        cpu_total=phase.cpu_total,
        client_received=phase.received,
        client_sent=phase.sent,
        received_by_op=phase.received_by_op,
        counters=phase.counters,
        busiest_per_node=max(phase.cpu_per_node, default=0.0),
        longest_call=max((r.finished - r.called for r in phase.results if r.called), default=0.0),
        **fields,
    )


def _measure(
    server: Server,
    plan: Plan,
    inbox: _Inbox,
    signals: tuple[Event, Event, Event],
    heartbeat_seconds: float,
) -> Outcome:
    """Run a row's phases once its processes are ready, and measure the one that counts."""
    start, second, _ = signals
    url, nodes, timeout = server.client_url, plan.nodes, plan.timeout
    if inbox.gather("ready", _deadline(_SETUP_TIMEOUT)) is None:
        raise RowError(f"the handlers were not ready within {_SETUP_TIMEOUT:g} s")
    before = read_metrics(url)
    started = time.monotonic()
    start.set()
    # Outside the first-rendezvous table, say which round a problem was in.
    try:
        first = _gathered(inbox, "joined", started + timeout + _OVERRUN + _MARGIN, timeout)
        if plan.mode == FIRST:
            # The counts of a row that failed tell why: kept, with the problem.
            delta = changes(before, read_metrics(url))
            seconds = max((r.finished for r in first.results if r.finished), default=started)
            seconds -= started
            called = max((r.called for r in first.results if r.called), default=started)
            outcome = _counted(first, delta, seconds=seconds, last_called=called - started)
            try:
                _check(first.results, nodes, timeout, started)
            except RowError as exc:
                outcome.problem = str(exc)
            return outcome
        _check(first.results, nodes, timeout, started)
    except RowError as exc:
        raise RowError(exc if plan.mode == FIRST else f"first round: {exc}") from None
    if plan.mode == RERENDEZVOUS and inbox.gather("ready again", _deadline(_SETUP_TIMEOUT)) is None:
        raise RowError("the nodes were not ready for the second round")
    before = read_metrics(url)
    started = time.monotonic()
    if plan.mode == HEARTBEATS:
        time.sleep(heartbeat_seconds)  # the window, in which only heartbeats run
        delta = changes(before, read_metrics(url))
        return Outcome(
            window=time.monotonic() - started,
            requests=count_requests(delta),
            server=count_bytes(delta),
        )
    second.set()
    try:
        again = _gathered(inbox, "rejoined", started + timeout + _OVERRUN + _MARGIN, timeout)
        delta = changes(before, read_metrics(url))
        _check(again.results, nodes, timeout, started)
    except RowError as exc:
        raise RowError(f"second round: {exc}") from None
    return _counted(
        again,
        delta,
        seconds=max(r.finished for r in again.results) - started,
        detect=min(r.detected for r in again.results if r.polls) - started,
        polls=sum(r.polls for r in again.results) / nodes,
    )


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _split(nodes: int, procs: int) -> list[int]:
    """``nodes`` spread as evenly as possible over ``procs`` processes."""
    return [nodes // procs + (i < nodes % procs) for i in range(procs)]


def run_row(
    plan: Plan,
    procs: int,
    server: Server,
    heartbeat_seconds: float,
    deaths: ThreadDeaths,
    start_method: str = "spawn",
) -> Outcome:
    """Measure one row in ``procs`` fresh processes (started by ``start_method``), which
    are gone on return; the background threads that died in them are added to
    ``deaths``."""
    context = multiprocessing.get_context(start_method)
    signals = (context.Event(), context.Event(), context.Event())
    reports = context.Queue()
    counts = _split(plan.nodes, procs)
    processes: list[BaseProcess] = [
        context.Process(
            target=_child,
            args=(
                dataclasses.replace(plan, count=count, leaves=plan.leaves and i == procs - 1),
                i,
                signals,
                reports,
            ),
            name=f"bench-scale-{i}",
            daemon=True,
        )
        for i, count in enumerate(counts)
    ]
    inbox = _Inbox(reports, processes)
    outcome = Outcome(problem="interrupted")
    try:
        for process in processes:
            process.start()
        outcome = _measure(server, plan, inbox, signals, heartbeat_seconds)
    except RowError as exc:
        outcome = Outcome(problem=str(exc))
    finally:
        signals[2].set()
        _end(processes, inbox, deaths, wait=not outcome.problem)
    return outcome


def _end(processes: list[BaseProcess], inbox: _Inbox, deaths: ThreadDeaths, wait: bool) -> None:
    """Let the processes release their handlers and exit (if ``wait``), then kill the
    ones left: a row that failed may have nodes stuck in a rendezvous."""
    if wait:
        with_deaths = inbox.gather("done", time.monotonic() + 60)
        for seen in with_deaths or ():
            deaths.add(seen)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(10)


# -- the tables ---------------------------------------------------------------------------


def _per_node(requests: Requests, scale: float) -> str:
    return (
        f"{requests.writes * scale:>11.1f} {requests.reads * scale:>10.1f} "
        f"{requests.keepalives * scale:>15.1f}"
    )


#: The titles of the bytes and CPU columns (first rendezvous, re-rendezvous).
_COSTS = f" {'kB in':>7} {'kB out':>6} {'srv kB':>7} {'CPU ms':>6}"


def _costs(outcome: Outcome, nodes: int) -> str:
    """Per node: kB received and sent by the clients, kB sent by etcd's gRPC server
    (``-`` when it counted none: the v2 API), client CPU milliseconds."""
    server = outcome.server.sent if outcome.server is not None else 0.0
    return (
        f" {outcome.client_received / nodes / 1000:>7.1f} "
        f"{outcome.client_sent / nodes / 1000:>6.1f} "
        + (f"{server / nodes / 1000:>7.1f}" if server else f"{'-':>7}")
        + f" {outcome.cpu_total / nodes * 1000:>6.1f}"
    )


_HEADERS = {
    FIRST: f"{'seconds':>8} {'writes/node':>11} {'reads/node':>10} {'keep-alive/node':>15}"
    + _COSTS,
    RERENDEZVOUS: (
        f"{'seconds':>8} {'detect':>7} {'writes/node':>11} {'reads/node':>10} "
        f"{'keep-alive/node':>15} {'polls/node':>10}" + _COSTS
    ),
    HEARTBEATS: (
        f"{'seconds':>8} {'writes/node':>11} {'reads/node':>10} {'keep-alive/node':>15}"
        "  (per minute)"
    ),
}


def header(mode: str) -> str:
    """The column titles of ``mode``'s table."""
    return f"{'backend':<8} {'API':<3} {'impl':<5} {'N':>5} {'P':>3} {_HEADERS[mode]}"


def row(plan: Plan, procs: int, outcome: Outcome) -> str:
    """One line of the table (requests of no known class appended)."""
    variant = plan.variant
    start = f"{variant.backend:<8} {variant.api:<3} {variant.impl:<5} {plan.nodes:>5} {procs:>3}"
    requests = outcome.requests
    if outcome.problem or requests is None:
        return f"{start} {outcome.problem}"
    # Per node; per node and minute for heartbeats.
    scale = (60 / outcome.window if plan.mode == HEARTBEATS else 1) / plan.nodes
    if plan.mode == HEARTBEATS:
        numbers = f"{outcome.window:>8.1f} {_per_node(requests, scale)}"
    elif plan.mode == RERENDEZVOUS:
        numbers = (
            f"{outcome.seconds:>8.2f} {outcome.detect:>7.2f} "
            f"{_per_node(requests, scale)} {outcome.polls:>10.1f}"
        ) + _costs(outcome, plan.nodes)
    else:
        numbers = f"{outcome.seconds:>8.2f} {_per_node(requests, scale)}" + _costs(
            outcome, plan.nodes
        )
    other = "".join(f"  +{v * scale:.1f} {k}" for k, v in requests.other.items())
    return f"{start} {numbers}{other}"


def record(plan: Plan, procs: int, outcome: Outcome) -> dict[str, Any]:
    """One row as a JSON object, for ``--json`` (and ``plot_scale.py``): requests per
    node (per node and minute for heartbeats); bytes (``kb_received``, ``kb_sent``,
    ``kb_server_sent``, ``kb_server_received``, ``kb_received_by_op``: kB per node) and
    client CPU (``cpu_ms``: ms per node; ``busiest_cpu_s``: the busiest process's CPU
    seconds; ``etcd_cpu_s``: etcd's) except for heartbeats; ``problem`` instead when there is
    none."""
    variant = plan.variant
    entry: dict[str, Any] = {
        "mode": plan.mode,
        "backend": variant.backend,
        "api": variant.api,
        "impl": variant.impl,
        "nodes": plan.nodes,
        "procs": procs,
    }
    requests = outcome.requests
    if outcome.problem:
        entry["problem"] = outcome.problem
    if requests is None:
        return entry
    scale = (60 / outcome.window if plan.mode == HEARTBEATS else 1) / plan.nodes
    entry.update(
        counters={title: round(v / plan.nodes, 3) for title, v in outcome.counters.items()},
        busiest_cpu_ms_per_node=round(outcome.busiest_per_node * 1000, 2),
        longest_call_s=round(outcome.longest_call, 3),
        last_called_s=round(outcome.last_called, 3),
        seconds=round(outcome.seconds, 3),
        writes=round(requests.writes * scale, 2),
        reads=round(requests.reads * scale, 2),
        keepalives=round(requests.keepalives * scale, 2),
    )
    if plan.mode == RERENDEZVOUS:
        entry.update(detect=round(outcome.detect, 3), polls=round(outcome.polls, 2))
    if plan.mode != HEARTBEATS:
        server = outcome.server or Bytes(0.0, 0.0)
        per_kb = 1 / plan.nodes / 1000
        entry.update(
            kb_received=round(outcome.client_received * per_kb, 2),
            kb_sent=round(outcome.client_sent * per_kb, 2),
            kb_server_sent=round(server.sent * per_kb, 2),
            kb_server_received=round(server.received * per_kb, 2),
            kb_received_by_op={
                op: round(value * per_kb, 2) for op, value in outcome.received_by_op.items()
            },
            cpu_ms=round(outcome.cpu_total / plan.nodes * 1000, 2),
            busiest_cpu_s=round(outcome.cpu, 3),
            etcd_cpu_s=round(outcome.server_cpu, 3),
        )
    return entry


def per_node_counts(nodes: int, outcome: Outcome) -> str:
    """The library's counters of :data:`COUNTERS` per node, and the busiest process's
    CPU milliseconds per node."""
    counted = ", ".join(f"{title} {value / nodes:.2f}" for title, value in outcome.counters.items())
    return (
        f"    per node: {counted}; CPU ms per node in the busiest process: "
        f"{outcome.busiest_per_node * 1000:.1f}; longest next_rendezvous(): "
        f"{outcome.longest_call:.1f} s, the last called at {outcome.last_called:.1f} s"
    )


def breakdown(mode: str, nodes: int, outcome: Outcome) -> str:
    """A row's requests by method, per node (and minute, for heartbeats), and the CPU
    seconds of its busiest process."""
    if outcome.requests is None:
        return ""
    per = nodes * (outcome.window / 60 if mode == HEARTBEATS else 1)
    if mode == HEARTBEATS:
        return f"    {outcome.requests.describe(per)}"
    received = ", ".join(
        f"{op} {value / nodes / 1000:.1f}" for op, value in outcome.received_by_op.items()
    )
    return (
        f"    {outcome.requests.describe(per)}; busiest process: {outcome.cpu:.2f} CPU s; "
        f"etcd: {outcome.server_cpu:.2f} CPU s\n"
        f"    kB in/node by op: {received or '-'}"
    )


# -- the command line ---------------------------------------------------------------------


def default_procs(nodes: int) -> int:
    """The processes for ``nodes`` nodes unless ``--procs`` says: 1 up to 64 nodes, else 2."""
    return 1 if nodes <= 64 else 2


def options(backend: str, mode: str, args: argparse.Namespace) -> dict[str, str]:
    """The backend options of every variant of ``backend`` (strings, as torchrun's). The
    plain harness keeps the dynamic backends' default ``keep_alive_interval``."""
    timeout = f"{args.timeout:g}"
    if backend == "etcd":
        return {"timeout": timeout, "last_call_timeout": "1"}
    chosen = {"join_timeout": timeout, "last_call_timeout": "1"}
    if args.harness == PLAIN or backend == C10D:
        return chosen
    interval = "30" if mode == FIRST else f"{args.keep_alive_interval:g}"
    return {**chosen, "keep_alive_interval": interval}


@dataclass(frozen=True)
class External:
    """An etcd the benchmark did not start (``--endpoint``), as the rows use a server."""

    endpoint: str

    def get_endpoint(self) -> str:
        return self.endpoint

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def version(self) -> str:
        with urllib.request.urlopen(f"{self.client_url}/version", timeout=5) as answer:
            return str(json.load(answer).get("etcdserver", "?"))

    def __enter__(self) -> External:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serves_v2(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/keys/", timeout=5):
            return True
    except (urllib.error.URLError, OSError):
        return False


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--procs", type=int, help="processes per row (default: 1 up to 64 nodes)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per rendezvous")
    parser.add_argument("--backends", nargs="+", choices=(*BACKENDS, C10D), default=list(BACKENDS))
    parser.add_argument("--apis", nargs="+", choices=APIS, default=list(APIS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--breakdown", action="store_true", help="requests by method too")
    parser.add_argument(
        "--counts",
        action="store_true",
        help="the library's counters per node: lost CAS, state reads and decodes, watch "
        "events, silence reads, retries",
    )
    parser.add_argument(
        "--per-proc",
        type=int,
        metavar="K",
        help="K nodes per process (as many processes as it takes; instead of --procs)",
    )
    parser.add_argument(
        "--harness",
        choices=(PREPARED, PLAIN),
        default=PREPARED,
        help="prepared: the benchmark's handler parameters, handlers made before the "
        "start, threads gated; plain: a user's parameters, each node making its handler "
        "after the start, threads started at the signal",
    )
    parser.add_argument("--create", choices=(BEFORE, IN_NODE), help="where handlers are made")
    parser.add_argument("--start", choices=(GATED, AT_SIGNAL), help="how node threads begin")
    parser.add_argument(
        "--start-method",
        choices=("spawn", "fork", "forkserver"),
        default="spawn",
        help="how the node processes are started",
    )
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="random delay of 0 to this (s) per request"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the node processes this much nicer than etcd (as if etcd had its own "
        "host: many node processes on a small machine otherwise starve it)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="measure each row this many times")
    parser.add_argument(
        "--endpoint", help="an etcd already running (HOST:PORT) instead of one started here"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rerendezvous", action="store_true", help="measure a re-rendezvous")
    mode.add_argument("--heartbeats", action="store_true", help="measure etcd-v2 heartbeats")
    parser.add_argument("--monitor-interval", type=float, default=0.1, help="agents' poll (s)")
    parser.add_argument(
        "--keep-alive-interval", type=float, default=2.0, help="etcd-v2's, when not the first"
    )
    parser.add_argument("--heartbeat-nodes", type=int, default=256)
    parser.add_argument("--heartbeat-seconds", type=float, default=30.0)
    parser.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the rows to FILE as JSON (what benchmarks/plot_scale.py plots)",
    )
    args = parser.parse_args()
    least = 2 if args.rerendezvous else 1
    if min(args.nodes) < least or args.heartbeat_nodes < 1 or (args.procs or 1) < 1:
        parser.error(f"--nodes must be at least {least}, --heartbeat-nodes and --procs 1")
    if min(args.timeout, args.keep_alive_interval, args.heartbeat_seconds) <= 0:
        parser.error("--timeout, --keep-alive-interval and --heartbeat-seconds must be > 0")
    if (args.per_proc or 1) < 1 or args.repeat < 1 or args.jitter < 0:
        parser.error("--per-proc and --repeat must be at least 1, --jitter not negative")
    plain = args.harness == PLAIN
    args.create = args.create or (IN_NODE if plain else BEFORE)
    args.start = args.start or (AT_SIGNAL if plain else GATED)
    if (args.rerendezvous or args.heartbeats) and args.create == IN_NODE:
        parser.error("--rerendezvous and --heartbeats need the handlers made before (--create)")
    return args


def _procs(nodes: int, args: argparse.Namespace) -> int:
    """The processes of a row of ``nodes`` nodes (``--per-proc``, ``--procs``, or the
    default)."""
    if args.per_proc:
        return -(-nodes // args.per_proc)
    return min(args.procs or default_procs(nodes), nodes)


def main() -> None:
    """Measure every row and print the table."""
    args = parse_args()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # inherited by the processes
    deaths = ThreadDeaths()
    mode = RERENDEZVOUS if args.rerendezvous else HEARTBEATS if args.heartbeats else FIRST
    impls = list(args.impls)
    if "torch" in impls and not torch_available():
        print("note: torch is not installed; PyTorch's reference rows are skipped")
        impls.remove("torch")
    counts = [args.heartbeat_nodes] if mode == HEARTBEATS else args.nodes
    backends = ["etcd-v2"] if mode == HEARTBEATS else args.backends
    records: list[dict[str, Any]] = []
    target = External(args.endpoint) if args.endpoint else EtcdServer(enable_v2=None)
    with target as server:
        apis = list(args.apis)
        if "v2" in apis and not _serves_v2(server.client_url):
            print(f"note: etcd {server.version} does not serve the v2 API; v2 rows skipped")
            apis.remove("v2")
        if args.harness == PLAIN:
            # A plain handler speaks the API its etcd_api=auto picks: v2 where served.
            apis = ["v2"] if "v2" in apis else ["v3"]
        print(
            f"etcd {server.version} at {server.get_endpoint()} ({', '.join(apis)}); "
            f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; measuring: {mode}"
            + (f", {args.heartbeat_seconds:g} s window" if mode == HEARTBEATS else "")
            + f"; harness {args.harness} (handlers made {args.create}, threads {args.start}, "
            f"{args.start_method}"
            + (f", jitter {args.jitter:g} s" if args.jitter else "")
            + (f", nice {args.nice}" if args.nice else "")
            + ")"
        )
        print(header(mode), flush=True)
        for nodes in counts:
            procs = _procs(nodes, args)
            for variant in variants(backends, apis, impls):
                endpoint = server.get_endpoint()
                for _ in range(args.repeat):
                    if variant.backend == C10D:  # a fresh TCPStore port per row
                        endpoint = f"127.0.0.1:{_free_port()}"
                    plan = Plan(
                        variant,
                        endpoint,
                        f"scale-{uuid.uuid4().hex[:8]}",
                        nodes,
                        nodes,
                        mode,
                        options(variant.backend, mode, args),
                        leaves=mode == RERENDEZVOUS,
                        monitor_interval=args.monitor_interval,
                        timeout=args.timeout,
                        create=args.create,
                        start=args.start,
                        jitter=args.jitter,
                        harness=args.harness,
                        nice=args.nice,
                    )
                    load = os.getloadavg()[0]
                    outcome = run_row(
                        plan, procs, server, args.heartbeat_seconds, deaths, args.start_method
                    )
                    print(row(plan, procs, outcome), flush=True)
                    records.append({**record(plan, procs, outcome), "load": round(load, 2)})
                    if args.breakdown and outcome.requests is not None:
                        print(breakdown(mode, nodes, outcome), flush=True)
                    if args.counts and outcome.counters:
                        print(per_node_counts(nodes, outcome), flush=True)
        if args.json is not None:
            document = {
                "etcd": server.version,
                "cpus": os.cpu_count(),
                "harness": args.harness,
                "create": args.create,
                "start": args.start,
                "start_method": args.start_method,
                "jitter": args.jitter,
                "nice": args.nice,
                "rows": records,
            }
            args.json.write_text(json.dumps(document, indent=1) + "\n")
    deaths.report()


if __name__ == "__main__":
    main()
