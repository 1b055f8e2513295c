"""Membership changes under real ``torchrun`` agents: ours vs PyTorch 2.13, in one run.

Usage::

    python benchmarks/bench_torchrun.py [--variants ours-etcd-v2@v2 torch-etcd-v2 ...]
        [--scenarios node-loss scale-up surplus] [--repeat 1] [--keep-alive-interval 5]

Each agent is ``python -m torch.distributed.run`` on localhost with one gloo worker
(``tests/support/scripts/torchrun_worker.py``, a step every 0.2 s), ``--max-restarts=3``,
``--monitor-interval=0.5`` and ``--rdzv-conf=last_call_timeout=2,join_timeout=90,
timeout=90`` (the dynamic backends' keep-alive at its default: every 5 s, 3 attempts)
and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ``LOGLEVEL=INFO`` (see :data:`AGENT_ENV`). With
``BENCH_LOG_DEBUG=1`` the agent logs (their paths are printed) have this package's DEBUG
messages.
The variants are this package's ``etcd`` and ``etcd-v2`` (as the torchrun plugins
``etcd-rendezvous`` and ``etcd-rendezvous-v2``) against an etcd serving v2 (``@v2``)
and one without v2 (``@v3``), and PyTorch's ``etcd``, ``etcd-v2`` (on the v2 etcd) and
``c10d`` (a TCPStore in the first agent). The scenarios, each on a fresh run id:

* ``node-loss``: three agents (``--nnodes=2:3``) train together; the third agent is
  SIGKILLed with its worker. Reported: seconds from the kill to the first step of the
  two-node world, and the failure detection in it (the time a dead node keeps its place:
  the legacy backend's 10 s member key TTL; the dynamic backends' ``keep_alive_interval
  x keep_alive_max_attempt``, 15 s) as a share of that, and the seconds until the
  survivors' agents logged the new world's rendezvous (before their workers start);
* ``scale-up``: two agents train; a third is started. Seconds from its start (its
  imports included) to the first step of the three-node world, and to its rendezvous;
* ``surplus``: ``--nnodes=1:2``, two agents train and a third waits as a spare; the job
  ends. Seconds from the last worker's end to the spare agent's exit, and how it exited
  (torch's agent logs "Rendezvous gracefully exited" when it catches torch's
  ``RendezvousGracefulExitError``; torch 2.13's launcher then fails on the ``None``
  result, exit code 1).

etcd 3.5 (bundled; ``ETCD_BINARY_PATH`` chooses another) is started by the script. The
run is CPU-heavy (three agents importing torch at once): run it on a quiet machine.
Results are in ``docs/torchrun.rst``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from etcd_rendezvous.etcd_server import EtcdServer
from support.torchrun import Agent

#: torchrun's options of the measurements (as in the scenario the numbers compare to).
CONF: dict[str, object] = {"last_call_timeout": 2, "join_timeout": 90, "timeout": 90}
MONITOR_INTERVAL = 0.5
MAX_RESTARTS = 3
STEP_SECONDS = 0.2
#: The workers' TCPStore is rank 0's own in every world (a fresh one each time): torch's
#: agent store outlives a world while its host survives, and the workers use it without
#: a prefix per attempt, so the next world reads the gloo addresses the last one left.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
#: ``BENCH_LOG_DEBUG=1``: torchrun with this package's DEBUG messages in the agent logs.
DEBUG_LAUNCHER = [
    sys.executable,
    "-c",
    "import logging; logging.basicConfig(format='%(asctime)s %(name)s %(message)s'); "
    "logging.getLogger('etcd_rendezvous').setLevel(logging.DEBUG); "
    "from torch.distributed.run import main; main()",
]
#: How long one scenario may take before it counts as failed.
SCENARIO_TIMEOUT = 180.0


@dataclass(frozen=True)
class Variant:
    """One column: the torchrun backend name, the etcd it runs against, the extra conf."""

    name: str
    backend: str
    server: str  # "v2", "v3" or "" (c10d: no etcd)
    conf: dict[str, object]
    #: Seconds a dead node keeps its place at most (the failure detection).
    detection: float


def _variants(keep_alive: float) -> dict[str, Variant]:
    dynamic = keep_alive * 3
    return {
        "ours-etcd@v2": Variant("ours etcd (v2)", "etcd-rendezvous", "v2", {}, 10.0),
        "ours-etcd@v3": Variant("ours etcd (v3)", "etcd-rendezvous", "v3", {}, 10.0),
        "ours-etcd-v2@v2": Variant("ours etcd-v2 (v2)", "etcd-rendezvous-v2", "v2", {}, dynamic),
        "ours-etcd-v2@v3": Variant("ours etcd-v2 (v3)", "etcd-rendezvous-v2", "v3", {}, dynamic),
        "torch-etcd": Variant("PyTorch etcd", "etcd", "v2", {}, 10.0),
        "torch-etcd-v2": Variant("PyTorch etcd-v2", "etcd-v2", "v2", {}, dynamic),
        "torch-c10d": Variant("PyTorch c10d", "c10d", "", {}, dynamic),
    }


@dataclass
class Outcome:
    """One scenario's measurement."""

    seconds: float | None
    note: str = ""
    #: Seconds from the event to the new world's rendezvous (its workers not started).
    rendezvous: float | None = None


class Run:
    """The agents of one scenario of one variant, in a directory of their own."""

    def __init__(self, variant: Variant, endpoint: str, keep_alive: float) -> None:
        self.variant = variant
        self.endpoint = endpoint
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.out = Path(tempfile.mkdtemp(prefix=f"bench-torchrun-{self.run_id}-"))
        conf = dict(CONF)
        conf.update(variant.conf)
        if keep_alive != 5 and variant.backend not in {"etcd", "etcd-rendezvous"}:
            conf["keep_alive_interval"] = keep_alive
        self.conf = conf
        self.agents: list[Agent] = []

    def start(self, name: str, nnodes: str, steps: int) -> Agent:
        agent = Agent(
            name,
            self.out,
            backend=self.variant.backend,
            endpoint=self.endpoint,
            run_id=self.run_id,
            nnodes=nnodes,
            nproc_per_node=1,
            rdzv_conf=self.conf,
            max_restarts=MAX_RESTARTS,
            steps=steps,
            step_seconds=STEP_SECONDS,
            monitor_interval=MONITOR_INTERVAL,
            env=AGENT_ENV,
            launcher=DEBUG_LAUNCHER if os.environ.get("BENCH_LOG_DEBUG") else None,
        )
        self.agents.append(agent)
        return agent

    def progress(self) -> list[dict[str, Any]]:
        found = []
        for path in self.out.glob("progress-*.json"):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return found

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("result-*.json"))]

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + SCENARIO_TIMEOUT
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.variant.name}: no {what} after {SCENARIO_TIMEOUT} s")
            time.sleep(0.05)

    def new_world_started(self, size: int, after: float) -> float | None:
        """The wall time of the first step of a world of ``size`` begun after ``after``."""
        starts = [
            p["first_step_at"]
            for p in self.progress()
            if p["world_size"] == size and p["first_step_at"] > after
        ]
        return min(starts) if len(starts) == size else None

    def rendezvous_done(self, names: list[str], after: float) -> float | None:
        """The wall time by which each of the agents ``names`` logged (at INFO) its first
        "Rendezvous complete" after ``after``: the new world formed, workers not started."""
        done = []
        for agent in self.agents:
            if agent.name not in names:
                continue
            first = None
            for line in agent.log_path.read_text(errors="replace").splitlines():
                if "Rendezvous complete for workers" not in line:
                    continue
                # glog style: I<MMDD> <HH:MM:SS.micro> <pid> ... (local time)
                stamp = " ".join(line[1:].split()[:2])
                year = time.localtime(after).tm_year
                at = datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").timestamp()
                if at > after:
                    first = at
                    break
            if first is None:
                return None
            done.append(first)
        return max(done) if done else None

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()


def _training(run: Run, size: int) -> bool:
    agents = {p["agent"] for p in run.progress() if p["world_size"] == size and p["step"] >= 1}
    return len(agents) == size


def node_loss(run: Run) -> Outcome:
    for name in ("a", "b", "c"):
        run.start(name, "2:3", steps=100_000)
    run.wait(lambda: _training(run, 3), "three-node world")
    killed_at = time.time()
    run.agents[-1].kill_node()
    run.wait(lambda: run.new_world_started(2, killed_at) is not None, "two-node world")
    started = run.new_world_started(2, killed_at)
    assert started is not None
    seconds = started - killed_at
    share = run.variant.detection / seconds
    formed = run.rendezvous_done(["a", "b"], killed_at)
    rendezvous = "-" if formed is None else f"{formed - killed_at:.1f}"
    note = f"detection <= {run.variant.detection:.0f} s ({share:.0%}); rendezvous {rendezvous} s"
    return Outcome(seconds, note, None if formed is None else formed - killed_at)


def scale_up(run: Run) -> Outcome:
    for name in ("a", "b"):
        run.start(name, "2:3", steps=100_000)
    run.wait(lambda: _training(run, 2), "two-node world")
    started_at = time.time()
    run.start("c", "2:3", steps=100_000)
    run.wait(lambda: run.new_world_started(3, started_at) is not None, "three-node world")
    started = run.new_world_started(3, started_at)
    assert started is not None
    formed = run.rendezvous_done(["a", "b", "c"], started_at)
    rendezvous = None if formed is None else formed - started_at
    note = "" if rendezvous is None else f"rendezvous {rendezvous:.1f} s"
    return Outcome(started - started_at, note, rendezvous)


def surplus(run: Run) -> Outcome:
    steps = 60  # 12 s of training: the spare starts and waits meanwhile
    for name in ("a", "b"):
        run.start(name, "1:2", steps=steps)
    run.wait(lambda: _training(run, 2), "two-node world")
    spare = run.start("c", "1:2", steps=steps)
    members = run.agents[:2]
    run.wait(lambda: all(a.process.poll() is not None for a in members), "end of the job")
    code = spare.wait(SCENARIO_TIMEOUT)
    exited_at = time.time()
    finished = [r["finished_at"] for r in run.results()]
    if len(finished) != 2 or {a.process.returncode for a in members} != {0}:
        return Outcome(None, f"job failed: {len(finished)} results")
    log = spare.log(tail=400)
    # torch 2.13's launcher fails on the None agent.run() returns after a graceful exit.
    how = "torch's graceful exit" if "Rendezvous gracefully exited" in log else "error"
    how += f", exit code {code}"
    if "etcd_rendezvous.api.RendezvousGracefulExitError" in log:
        how += " (traceback of ours)"
    # Upper bound: the exit is noticed by polling (0.05 s).
    return Outcome(exited_at - max(finished), how)


SCENARIOS: dict[str, Callable[[Run], Outcome]] = {
    "node-loss": node_loss,
    "scale-up": scale_up,
    "surplus": surplus,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    all_variants = _variants(5)
    parser.add_argument("--variants", nargs="+", default=list(all_variants), choices=all_variants)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--keep-alive-interval", type=float, default=5.0)
    args = parser.parse_args()
    variants = _variants(args.keep_alive_interval)

    with EtcdServer(enable_v2=True) as v2, EtcdServer(enable_v2=False) as v3:
        servers = {"v2": v2.get_endpoint(), "v3": v3.get_endpoint()}
        table: dict[tuple[str, str], list[Outcome]] = {}
        for _ in range(args.repeat):
            for scenario in args.scenarios:
                for key in args.variants:
                    variant = variants[key]
                    endpoint = servers.get(variant.server) or f"127.0.0.1:{_free_port()}"
                    run = Run(variant, endpoint, args.keep_alive_interval)
                    try:
                        outcome = SCENARIOS[scenario](run)
                    except (TimeoutError, AssertionError) as exc:
                        outcome = Outcome(None, str(exc).splitlines()[0])
                    finally:
                        run.stop()
                    shown = "-" if outcome.seconds is None else f"{outcome.seconds:.1f}"
                    print(f"{scenario:10} {variant.name:20} {shown:>6} s  {outcome.note}")
                    print(f"{'':10} logs: {run.out}", flush=True)
                    table.setdefault((scenario, key), []).append(outcome)

    print(f"\n{'scenario':10} {'variant':20} {'median':>7} {'rdzv':>7}  runs")
    for (scenario, key), outcomes in table.items():
        seconds = [o.seconds for o in outcomes if o.seconds is not None]
        median = f"{statistics.median(seconds):.1f}" if seconds else "-"
        runs = ", ".join("-" if o.seconds is None else f"{o.seconds:.1f}" for o in outcomes)
        formed = [o.rendezvous for o in outcomes if o.rendezvous is not None]
        rdzv = f"{statistics.median(formed):.1f}" if formed else "-"
        notes = "; ".join(sorted({o.note.split(";")[0] for o in outcomes if o.note}))
        print(f"{scenario:10} {variants[key].name:20} {median:>7} {rdzv:>7}  {runs}  {notes}")


if __name__ == "__main__":
    main()
