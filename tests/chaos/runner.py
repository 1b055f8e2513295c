"""Carry a scenario out against real etcd and real node processes, then check it.

:func:`run_scenario` starts etcd (a server or a 3-member cluster of the scenario's
flavor), a fault proxy per etcd member for each node the network faults may hit, and
the node processes (``chaos.node``) at their start times; injects the faults of the
schedule at their moments (and undoes the timed ones); runs the operator's commands as
processes; watches the rendezvous state; and, once the faults are over, waits until
the healthy nodes show progress or the liveness bound has passed. It then stops the
nodes, looks for leases left behind, tears everything down and runs the checker over
the records (:mod:`chaos.records`), which stay in the scenario's folder.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos import checker
from chaos.etcd_view import EtcdView, KeyInfo
from chaos.records import Recorder, read_all, read_records
from chaos.scenario import FLAVORS, REPO, Fault, Scenario
from etcd_rendezvous.etcd_cluster import EtcdCluster
from etcd_rendezvous.etcd_server import EtcdServer
from support.faultproxy import FaultProxy
from support.torchrun import Agent

__all__ = ["Verdict", "run_scenario"]

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
_FAKETIME_SITE = Path(__file__).resolve().parent / "faketime"
#: How often the runner looks at the state key and at the nodes' progress.
_STATE_POLL = 0.1
_PROGRESS_POLL = 1.0
#: After progress is shown, let the nodes run this much longer before stopping them.
_SETTLE = 1.0
#: The runner's load probe: it wakes every tick and records a stall when it woke this
#: much late.
_LOAD_TICK = 0.1
_STALL = 0.25
#: How long the runner watches after T_f when liveness does not apply.
_WATCH_WITHOUT_LIVENESS = 30.0
#: How long PyTorch's nodes get to end once asked to stop.
_TORCH_STOP = 20.0


@dataclass
class Verdict:
    scenario: Scenario
    out: Path
    violations: list[checker.Violation]
    liveness: checker.Liveness
    seconds: float
    fault_counts: dict[str, int]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.scenario.seed,
            "flavor": self.scenario.flavor,
            "family": self.scenario.family,
            "backend": self.scenario.backend,
            "description": self.scenario.describe(),
            "replay": self.scenario.replay_command(),
            "seconds": round(self.seconds, 1),
            "faults": self.fault_counts,
            "liveness": {
                "applies": self.liveness.applies,
                "why": self.liveness.why,
                "how": self.liveness.how,
            },
            "violations": [v.as_dict() for v in self.violations],
        }


class _Member:
    """One etcd member, whether of an :class:`EtcdServer` or an :class:`EtcdCluster`."""

    def __init__(self, thing: Any) -> None:
        self.thing = thing

    @property
    def endpoint(self) -> str:
        thing = self.thing
        return thing.get_endpoint() if isinstance(thing, EtcdServer) else thing.endpoint

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.endpoint.rsplit(":", 1)
        return host, int(port)

    @property
    def client_url(self) -> str:
        return str(self.thing.client_url)

    def kill(self) -> None:
        self.thing.kill()

    def suspend(self) -> None:
        self.thing.suspend()

    def resume(self) -> None:
        if self.thing.suspended:
            self.thing.resume()

    def restart(self) -> None:
        if isinstance(self.thing, EtcdServer):
            self.thing.restart(timeout=60)
        else:
            self.thing.restart(timeout=60)


class _NodeProcess:
    """A node process, or a torchrun agent (``agent``) with its workers."""

    def __init__(
        self,
        name: str,
        process: subprocess.Popen[bytes],
        clock_file: Path | None,
        agent: Agent | None = None,
    ):
        self.name = name
        self.process = process
        self.clock_file = clock_file
        self.agent = agent
        self.killed = False
        self.frozen = False

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the node (a torchrun agent and all its workers)."""
        if self.agent is not None:
            if sig == signal.SIGKILL:
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    self.agent.kill_node()
            else:
                self.agent.signal_node(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)

    def tell(self, command: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.process.stdin is not None
            self.process.stdin.write((command + "\n").encode())
            self.process.stdin.flush()


class Runner:
    def __init__(self, scenario: Scenario, out: Path, log: Any = print) -> None:
        self.sc = scenario
        self.out = out
        self.log = log
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("*.jsonl"), out / "stop"]:
            stale.unlink(missing_ok=True)
        self.records: list[dict[str, Any]] = []
        self._recorder = Recorder(out / "runner.jsonl")
        # Timed faults wait in the pool until they are undone: room for all of them.
        self.pool = ThreadPoolExecutor(64, thread_name_prefix="chaos-fault")
        self.nodes: dict[str, _NodeProcess] = {}
        self.proxies: dict[str, list[FaultProxy]] = {}
        self.members: list[_Member] = []
        self.server: EtcdServer | None = None
        self.cluster: EtcdCluster | None = None
        self.view: EtcdView | None = None
        self.stopping = threading.Event()
        self.fault_ids = iter(range(1, 1_000_000))
        self.garbage: dict[int, tuple[KeyInfo, bytes]] = {}
        #: The futures of the injections and of the undoing of timed faults: the
        #: faults are over once all are done.
        self.injections: dict[int, Future[Any]] = {}
        self.undos: dict[int, Future[Any]] = {}
        self.lock = threading.Lock()

    def record(self, ev: str, **fields: Any) -> dict[str, Any]:
        rec = self._recorder(ev, **fields)
        with self.lock:
            self.records.append(rec)
        return rec

    # -- etcd ----------------------------------------------------------------------------

    def start_etcd(self) -> None:
        flavor = FLAVORS[self.sc.flavor]
        binary = flavor.resolve_binary()
        extra = []
        if self.sc.max_request_bytes:
            extra.append(f"--max-request-bytes={self.sc.max_request_bytes}")
        enable_v2 = flavor.api == "v2"
        if self.sc.members == 1:
            self.server = EtcdServer(etcd_binary=binary, enable_v2=enable_v2, extra_args=extra)
            self.server.start()
            self.members = [_Member(self.server)]
            version = self.server.version
        else:
            self.cluster = EtcdCluster(
                self.sc.members, etcd_binary=binary, enable_v2=enable_v2, extra_args=extra
            ).start()
            self.members = [_Member(m) for m in self.cluster.members]
            version = self.cluster.version
        self.view = EtcdView([m.client_url for m in self.members], flavor.api)
        self.record(
            "etcd",
            endpoints=[m.endpoint for m in self.members],
            client_urls=[m.client_url for m in self.members],
            api=flavor.api,
            version=version,
        )

    def member(self, target: str | None) -> _Member | None:
        if target == "leader" and self.cluster is not None:
            leader = self.cluster.leader()
            if leader is None:
                return None
            return next(m for m in self.members if m.thing is leader)
        if target is not None and target.startswith("member:"):
            return self.members[int(target.split(":")[1]) % len(self.members)]
        return self.members[0]

    # -- nodes ---------------------------------------------------------------------------

    def members_of(self, name: str) -> list[_Member]:
        """The etcd members a node is given: all of them, but PyTorch's handlers take
        one endpoint, a member drawn from the node's name."""
        spec = self.sc.node(name)
        if spec.impl != "torch":
            return self.members
        return [self.members[int(name.lstrip("n")) % len(self.members)]]

    def endpoints_of(self, name: str) -> str:
        spec = self.sc.node(name)
        members = self.members_of(name)
        if spec.proxied:
            proxies = [
                FaultProxy(*m.host_port, name=f"proxy-{name}-{i}").start()
                for i, m in enumerate(members)
            ]
            self.proxies[name] = proxies
            return ",".join(f"{p.host}:{p.port}" for p in proxies)
        return ",".join(m.endpoint for m in members)

    def start_agent(self, name: str, env: dict[str, str], clock_file: Path | None) -> None:
        """A torchrun agent with this package's handler, its worker ``chaos.train``."""
        sc, settings = self.sc, self.sc.settings
        handler = "etcd-rendezvous" if sc.backend == "etcd" else "etcd-rendezvous-v2"
        conf: dict[str, object] = {
            "last_call_timeout": _whole(settings["last_call"]),
            "read_timeout": 10,
            "request_timeout": _whole(settings["request_timeout"]),
            "silence_timeout": _whole(settings["silence_timeout"]),
        }
        if sc.backend == "etcd":
            conf["timeout"] = _whole(settings["timeout"])
        else:
            conf["join_timeout"] = _whole(settings["timeout"])
            conf["keep_alive_interval"] = _whole(settings["keep_alive_interval"])
            conf["keep_alive_max_attempt"] = _whole(settings["keep_alive_max_attempt"])
        agent = Agent(
            name,
            self.out,
            backend=handler,
            endpoint=self.endpoints_of(name),
            run_id=sc.run_id,
            nnodes=f"{sc.min_nodes}:{sc.max_nodes}",
            nproc_per_node=1,
            rdzv_conf=conf,
            max_restarts=1000,
            env=env,
            script=[
                "--module",
                "chaos.train",
                f"--chaos-records={self.out / f'node-{name}.jsonl'}",
                f"--chaos-stop={self.out / 'stop'}",
                f"--chaos-node={name}",
                f"--chaos-step-interval={settings['step_interval']}",
                f"--chaos-collective-timeout={settings['collective_timeout']}",
            ],
        )
        self.nodes[name] = _NodeProcess(name, agent.process, clock_file, agent)
        self.record(
            "proc",
            node=name,
            pid=agent.process.pid,
            impl="torchrun",
            members=[m.endpoint for m in self.members],
        )

    def start_node(self, name: str) -> None:
        spec = self.sc.node(name)
        config = {
            "name": name,
            "impl": spec.impl,
            "backend": self.sc.backend,
            "endpoint": self.endpoints_of(name),
            "run_id": self.sc.run_id,
            "min_nodes": self.sc.min_nodes,
            "max_nodes": self.sc.max_nodes,
            "records": str(self.out / f"node-{name}.jsonl"),
            **{k: _whole(v) for k, v in self.sc.settings.items()},
        }
        config_path = self.out / f"node-{name}.json"
        config_path.write_text(json.dumps(config, indent=1))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])
        env["PYTHONUNBUFFERED"] = "1"
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.pop("CHAOS_DEBUG_UNUSED", None)
        clock_file = None
        if any(f.kind == "clock" and f.target == name for f in self.sc.faults):
            clock_file = self.out / f"clock-{name}"
            clock_file.write_text("+0\n")
            env.update(_faketime_env(file=clock_file))
        if spec.impl == "torchrun":
            self.start_agent(name, env, clock_file)
            return
        log = open(self.out / f"node-{name}.log", "wb")  # noqa: SIM115 (the child owns it)
        process = subprocess.Popen(
            [sys.executable, "-m", "chaos.node", str(config_path)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        log.close()
        self.nodes[name] = _NodeProcess(name, process, clock_file)
        self.record(
            "proc",
            node=name,
            pid=process.pid,
            impl=spec.impl,
            members=[m.endpoint for m in self.members_of(name)],
        )

    # -- faults --------------------------------------------------------------------------

    def inject(self, fault: Fault, index: int) -> None:
        """Carry out ``fault`` (in a pool thread); record it when done."""
        fid = next(self.fault_ids)
        end = None if fault.duration is None else time.monotonic() + fault.duration
        try:
            params = self._inject(fault, fid)
        except Exception as exc:
            self.record("fault_failed", kind=fault.kind, target=fault.target, error=repr(exc))
            self.log(f"  fault {fault.kind} {fault.target} could not be injected: {exc!r}")
            return
        if params is None:
            return
        self.record(
            "fault",
            id=fid,
            index=index,
            kind=fault.kind,
            target=fault.target,
            params=params,
            end=end,
        )
        if fault.duration is not None:
            self.undos[index] = self.pool.submit(self._undo_later, fault, fid, params, end)

    def _inject(self, fault: Fault, fid: int) -> dict[str, Any] | None:
        kind, target = fault.kind, fault.target
        params = dict(fault.params)
        node = self.nodes.get(target or "")
        if kind in ("kill", "freeze", "pause", "leave", "net", "clock"):
            if node is None or not node.running:
                return None
            if kind == "kill":
                node.signal(signal.SIGKILL)
                node.killed = True
            elif kind in ("freeze", "pause"):
                node.signal(signal.SIGSTOP)
                node.frozen = kind == "freeze"
            elif kind == "leave":
                if node.agent is not None:
                    node.process.send_signal(signal.SIGTERM)  # torchrun leaves the job
                else:
                    node.tell("leave")
            elif kind == "net":
                for proxy in self.proxies.get(target or "", []):
                    _proxy_mode(proxy, params)
            elif kind == "clock":
                assert node.clock_file is not None
                node.clock_file.write_text(f"{params['offset']:+}s\n")
            return params
        if kind in ("etcd_kill", "etcd_freeze", "etcd_pause"):
            member = self.member(target)
            if member is None:
                return None
            params["member"] = member.endpoint
            if kind == "etcd_kill":
                member.kill()
            else:
                member.suspend()
            return params
        assert self.view is not None
        if kind == "compact":
            params["revision"] = self.view.compact()
            return params
        if kind == "history":
            self.view.flood_history(f"/chaos-history/{self.sc.seed}")
            return params
        if kind == "garbage":
            return self._garbage(fault, fid, params)
        if kind in ("status", "list", "delete", "gc", "close"):
            self._command(kind, params)
            return None
        raise ValueError(f"unknown fault kind {kind!r}")

    def _undo_later(self, fault: Fault, fid: int, params: dict[str, Any], end: float) -> None:
        self.stopping.wait(max(0.0, end - time.monotonic()))
        try:
            self._undo(fault, fid, params)
        except Exception as exc:
            self.record("undo_failed", id=fid, kind=fault.kind, error=repr(exc))
            self.log(f"  undoing {fault.kind} {fault.target} failed: {exc!r}")
            return
        self.record("recovered", id=fid, kind=fault.kind, target=fault.target)

    def _undo(self, fault: Fault, fid: int, params: dict[str, Any]) -> None:
        kind = fault.kind
        if kind == "pause":
            self.nodes[fault.target or ""].signal(signal.SIGCONT)
        elif kind == "net":
            for proxy in self.proxies.get(fault.target or "", []):
                proxy.forward()
        elif kind in ("etcd_kill", "etcd_pause"):
            member = next(m for m in self.members if m.endpoint == params["member"])
            if kind == "etcd_pause":
                member.resume()
            else:
                member.restart()
        elif kind == "garbage":
            info, garbage = self.garbage[fid]
            assert self.view is not None
            now = self.view.get(info.key)
            if now is not None and now.value == garbage:
                self.view.put(info.key, info.value, now.ttl, now.lease)

    def _run_keys(self) -> list[tuple[str, KeyInfo]]:
        """Every key of the scenario's run, each with its class (state, worker,
        progress, store, other), leaving out the harness's own fingerprints and
        stored values (garbage there would be the harness's doing)."""
        assert self.view is not None
        run_id = self.sc.run_id
        found: list[tuple[str, KeyInfo]] = []
        if self.sc.backend == "etcd":
            for info in self.view.keys_below(f"/torchelastic/p2p/run_{run_id}"):
                last = info.key.rstrip("/").rsplit("/", 1)[-1]
                if info.key.endswith("/rdzv/active_version"):
                    found.append(("state", info))
                elif "/kv/" in info.key:
                    if not _harness_key(last):
                        found.append(("store", info))
                elif last.startswith(("node_", "rank_", "wait_")):
                    found.append(("worker", info))
                elif last == "progress":
                    found.append(("progress", info))
                else:
                    found.append(("other", info))
            return found
        state = self.view.get(f"/torch/elastic/rendezvous/{run_id}")
        if state is not None:
            found.append(("state", state))
        for info in self.view.keys_below(f"/torch/elastic/rendezvous_nodes/{run_id}/"):
            last = info.key.rsplit("/", 1)[-1]
            found.append(("progress" if last in ("progress", "aggregator") else "worker", info))
        scope = f"torch.rendezvous.{run_id}."
        for info in self.view.keys_below("/torch/elastic/store/"):
            name = _b64_name(info.key.rsplit("/", 1)[-1])
            if name is not None and name.startswith(scope) and not _harness_key(name):
                found.append(("store", info))
        return found

    def _garbage(self, fault: Fault, fid: int, params: dict[str, Any]) -> dict[str, Any] | None:
        assert self.view is not None
        keys = self._run_keys()
        wanted = params.pop("what")
        pool = [k for k in keys if wanted == "any" or k[0] == wanted]
        if not pool:
            pool = keys
        if not pool:
            return None
        rng = random.Random(f"{self.sc.seed}/garbage/{fid}")
        klass, info = rng.choice(sorted(pool, key=lambda k: k[1].key))
        garbage = params["value"].encode("latin-1")
        self.view.put(info.key, garbage, info.ttl, info.lease)
        self.garbage[fid] = (info, garbage)
        params.update({"class": klass, "key": info.key, "old": info.value[:200].decode("latin-1")})
        return params

    def _command(self, kind: str, params: dict[str, Any]) -> None:
        args = list(params.get("args", []))
        command = [sys.executable, "-m", "etcd_rendezvous", kind]
        command += ["--endpoint", ",".join(m.endpoint for m in self.members)]
        if kind in ("status", "delete", "close"):
            command += ["--backend", self.sc.backend, "--run-id", self.sc.run_id]
        command += args
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO / "src")
        if "operator_clock" in params:
            env.update(_faketime_env(offset=params["operator_clock"]))
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=90, env=env, check=False
            )
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = -9, str(exc.stdout or ""), f"timed out after 90 s {exc.stderr}"
        report = None
        if "--json" in args and kind in ("delete", "gc") and stdout.strip():
            with contextlib.suppress(ValueError):
                report = json.loads(stdout)
        self.record(
            "command",
            kind=kind,
            args=args,
            params=params,
            t0=t0,
            rc=rc,
            stdout=stdout[-3000:],
            stderr=stderr[-3000:],
            report=report,
        )

    # -- watching ------------------------------------------------------------------------

    def watch_state(self) -> None:
        """Record each new value of the run's state key (polled)."""
        assert self.view is not None
        view = EtcdView(list(self.view.urls), self.view.api, timeout=1.0)
        if self.sc.backend == "etcd":
            key = f"/torchelastic/p2p/run_{self.sc.run_id}/rdzv/active_version"
        else:
            key = f"/torch/elastic/rendezvous/{self.sc.run_id}"
        last: bytes | None = None
        while not self.stopping.wait(_STATE_POLL):
            try:
                info = view.get(key)
            except Exception:
                continue
            value = None if info is None else info.value
            if value == last:
                continue
            last = value
            self.record(
                "state",
                size=None if value is None else len(value),
                **_describe_state(self.sc.backend, value),
            )

    def watch_load(self) -> None:
        """Record each moment the runner's own thread was scheduled late (``stall``):
        the machine was too busy to keep time, for everyone. The checker gives the
        stalls back to the deadlines and counts them as disturbances."""
        while not self.stopping.is_set():
            start = time.monotonic()
            self.stopping.wait(_LOAD_TICK)
            late = time.monotonic() - start - _LOAD_TICK
            if late > _STALL:
                self.record("stall", start=start + _LOAD_TICK, late=round(late, 3))

    # -- the scenario ----------------------------------------------------------------------

    def run(self) -> Verdict:
        started = time.monotonic()
        sc = self.sc
        bound = sc.liveness_bound()
        self.log(f"{sc.describe()}; liveness bound {bound.explain()}")
        self.record("scenario", scenario=sc.as_dict())
        self.start_etcd()
        watcher = threading.Thread(target=self.watch_state, name="chaos-state", daemon=True)
        watcher.start()
        load = threading.Thread(target=self.watch_load, name="chaos-load", daemon=True)
        load.start()
        t0 = time.monotonic()
        self.record("begin", t=t0, bound=bound.total, bound_terms=bound.explain())
        events: list[tuple[float, int, str, Any]] = []
        for spec in sc.nodes:
            events.append((spec.start, 0, "start", spec.name))
        for index, fault in enumerate(sc.faults):
            events.append((fault.at, 1, "fault", (index, fault)))
        events.sort(key=lambda e: (e[0], e[1]))
        t_f = t0 + sc.faults_over()
        deadline = t_f + bound.total
        reason = ""
        over_recorded = False
        next_look = 0.0
        try:
            while True:
                now = time.monotonic()
                while events and t0 + events[0][0] <= now:
                    _, _, what, item = events.pop(0)
                    if what == "start":
                        self.start_node(item)
                    else:
                        index, fault = item
                        self.injections[index] = self.pool.submit(self.inject, fault, index)
                # Undoing takes a moment: wait for every timed fault to be undone.
                if (
                    not events
                    and not over_recorded
                    and now >= t_f
                    and all(f.done() for f in self.injections.values())
                    and all(f.done() for f in list(self.undos.values()))
                ):
                    over_recorded = True
                    # Now, after the last fault's record was written.
                    t_f = self.record("faults_over")["t"]
                    deadline = t_f + bound.total
                if over_recorded and now >= next_look:
                    next_look = now + _PROGRESS_POLL
                    status = self.liveness_now(now)
                    if status.held_at is not None:
                        self.stopping.wait(_SETTLE)
                        reason = f"liveness shown ({status.how})"
                        break
                    if not status.applies:
                        # Still worth watching for the other invariants a while.
                        if now >= t_f + min(bound.total, _WATCH_WITHOUT_LIVENESS):
                            reason = f"liveness does not apply: {status.why}"
                            break
                    elif now >= deadline + self.stalled_since(t_f):
                        reason = "liveness bound passed"
                        break
                if not any(n.running for n in self.nodes.values()) and not events and over_recorded:
                    reason = "no node left"
                    break
                self.stopping.wait(0.05)
        finally:
            self.log(f"  ending at {time.monotonic() - t0:.1f} s: {reason or 'interrupted'}")
            self.stop_nodes()
            self.stopping.set()
            watcher.join(5)
            load.join(5)
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.observe_leases()
            self.record("end", reason=reason)
            self.teardown()
        return self.verdict(time.monotonic() - started)

    def stalled_since(self, since: float) -> float:
        """Seconds the machine stalled since ``since`` (given back to the bound)."""
        with self.lock:
            return sum(r["late"] for r in self.records if r["ev"] == "stall" and r["t"] >= since)

    def liveness_now(self, now: float) -> checker.Liveness:
        _, nodes = read_all(self.out)
        with self.lock:
            runner = list(self.records)
        return checker.liveness(self.sc.as_dict(), runner, nodes, now=now)

    def stop_nodes(self) -> None:
        settings = self.sc.settings
        for node in self.nodes.values():
            if node.frozen and node.running:
                node.signal(signal.SIGKILL)
                node.killed = True
        (self.out / "stop").touch()  # torchrun's workers end together on it
        for node in self.nodes.values():
            if node.running:
                node.signal(signal.SIGCONT)  # a pause the stop interrupted
                if node.agent is None:
                    node.tell("stop")
        waited = settings["timeout"] + checker.DEADLINE_SLACK + 10 + checker.STOP_MARGIN
        deadline = time.monotonic() + waited
        # PyTorch's nodes are not held to our deadlines (python-etcd waits on a frozen
        # member for ever): they get a while, then are killed.
        torch_deadline = time.monotonic() + _TORCH_STOP
        for node in sorted(self.nodes.values(), key=lambda n: self.sc.node(n.name).impl == "torch"):
            ours = self.sc.node(node.name).impl != "torch"
            remaining = max(0.1, (deadline if ours else torch_deadline) - time.monotonic())
            try:
                node.process.wait(remaining)
            except subprocess.TimeoutExpired:
                if not ours:
                    node.signal(signal.SIGKILL)
                    node.killed = True
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        node.process.wait(10)
                    continue
                path = self.out / f"node-{node.name}.jsonl"
                records = list(read_records(path)) if path.exists() else []
                self.record(
                    "hung", node=node.name, waited=waited, last=records[-1] if records else None
                )
                node.signal(signal.SIGKILL)
                node.killed = True
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.process.wait(10)
        for node in self.nodes.values():
            log = (
                node.agent.log_path
                if node.agent is not None
                else self.out / f"node-{node.name}.log"
            )
            tail = log.read_bytes()[-1500:] if log.exists() else b""
            self.record(
                "proc_end",
                node=node.name,
                rc=node.process.returncode,
                killed=node.killed,
                stderr=tail.decode(errors="replace"),
            )
            if node.process.stdin is not None:
                with contextlib.suppress(OSError):
                    node.process.stdin.close()

    def observe_leases(self) -> None:
        if self.sc.api != "v3" or self.view is None:
            return
        try:
            for member in self.members:
                member.resume()
            leases = self.view.leases()
            for lease in leases:
                lease["pids"] = sorted({p for k in lease["keys"] if (p := self._pid_of_key(k))})
            self.record("leases", leases=leases)
        except Exception as exc:
            self.record("leases_failed", error=repr(exc))

    def _pid_of_key(self, key: str) -> int | None:
        last = key.rsplit("/", 1)[-1]
        if "/rendezvous_nodes/" in key:
            return checker._pid_of(last)
        if last.startswith(("node_", "wait_")) and self.view is not None:
            with contextlib.suppress(Exception):
                info = self.view.get(key)
                if info is not None:
                    return int(json.loads(info.value)["pid"])
        return None

    def teardown(self) -> None:
        for proxies in self.proxies.values():
            for proxy in proxies:
                with contextlib.suppress(Exception):
                    proxy.stop()
        for member in self.members:
            with contextlib.suppress(Exception):
                member.resume()
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.stop()
        self._recorder.close()

    def verdict(self, seconds: float) -> Verdict:
        runner, nodes = read_all(self.out)
        scenario = self.sc.as_dict()
        violations = checker.check(scenario, runner, nodes)
        live = checker.liveness(scenario, runner, nodes)
        counts: dict[str, int] = {}
        for r in runner:
            if r["ev"] == "fault" or r["ev"] == "command":
                counts[r["kind"]] = counts.get(r["kind"], 0) + 1
        joins = sum(1 for n in self.sc.nodes if n.start > 2.0)
        if joins:
            counts["join"] = joins
        if self.sc.max_request_bytes:
            counts["request_limit"] = 1
        verdict = Verdict(self.sc, self.out, violations, live, seconds, counts)
        (self.out / "verdict.json").write_text(json.dumps(verdict.as_dict(), indent=1))
        return verdict


def run_scenario(scenario: Scenario, out: Path, log: Any = print) -> Verdict:
    """Run ``scenario`` with its records in ``out``; the checker's verdict."""
    return Runner(scenario, out, log).run()


# -- helpers -------------------------------------------------------------------------------


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _faketime_env(*, file: Path | None = None, offset: float | None = None) -> dict[str, str]:
    env = {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(_FAKETIME_SITE), str(REPO / "src"), str(REPO / "tests")]
        ),
    }
    if file is not None:
        env["FAKETIME_TIMESTAMP_FILE"] = str(file)
        env["FAKETIME_CACHE_DURATION"] = "1"
    else:
        env["FAKETIME"] = f"{offset:+}s"
    return env


def _proxy_mode(proxy: FaultProxy, params: dict[str, Any]) -> None:
    mode = params["mode"]
    if mode == "drop":
        proxy.drop_responses()
    elif mode == "delay":
        proxy.delay(float(params["delay"]))
    elif mode == "refuse":
        proxy.refuse()
    elif mode == "reset":
        proxy.reset()


def _b64_name(segment: str) -> str | None:
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        with contextlib.suppress(binascii.Error, ValueError, UnicodeDecodeError):
            return decode(segment.encode()).decode()
    return None


def _harness_key(name: str) -> bool:
    """Whether a store key (its base64 segment or its name) is one of the harness's
    fingerprints or stored values."""
    decoded = _b64_name(name) or name
    return "chaos/data/" in decoded or "chaos/fp" in decoded


def _describe_state(backend: str, value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {"present": False}
    if backend == "etcd":
        try:
            state = json.loads(value)
            return {
                "present": True,
                "status": state.get("status"),
                "version": state.get("version"),
                "participants": len(state.get("participants", [])),
                "keep_alives": [k.rsplit("/", 1)[-1] for k in state.get("keep_alives", [])],
                "waiting": state.get("num_workers_waiting"),
            }
        except (ValueError, AttributeError):
            return {"present": True, "invalid": value[:100].decode("latin-1")}
    from etcd_rendezvous.dynamic_rendezvous import decode_state

    try:
        state = decode_state(base64.b64decode(value), "chaos watcher")
    except Exception:
        return {"present": True, "invalid": value[:100].decode("latin-1")}

    def name(node: Any) -> str:
        return f"{node.addr}_{node.pid}_{node.local_id}"

    return {
        "present": True,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "participants": {name(n): r for n, r in state.participants.items()},
        "wait_list": sorted(name(n) for n in state.wait_list),
        "redundancy_list": sorted(name(n) for n in state.redundancy_list),
        "heartbeats": {name(n): t.isoformat() for n, t in state.last_heartbeats.items()},
    }
