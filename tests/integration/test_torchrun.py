"""``torchrun`` with this package's plugin backends: real agents, real gloo training.

Each test starts ``torchrun`` agents on localhost against the session's etcd. Their
workers (``torchrun_worker.py``) all-reduce over gloo and write what they saw as JSON.
The backends talk to etcd over the API ``etcd_api=auto`` picks (v2 where the server
serves it, else v3); one run insists on v3 with ``--rdzv-conf etcd_api=v3``.
Skipped when PyTorch is not installed (CI installs ``torch==2.13.0``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.etcd_server import EtcdServer
from support.rdzv import state_key
from support.torchrun import Agent, wait_for

pytest.importorskip("torch.distributed.run", reason="PyTorch is not installed")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

# Per backend: the torchrun name, the --rdzv-conf that keeps the test short (every value
# reaches the backend as a string), and the etcd key holding the run's state.
LEGACY = "etcd-rendezvous"
V2 = "etcd-rendezvous-v2"
#: The rendezvous backend behind each torchrun handler.
RDZV_BACKEND = {LEGACY: "etcd", V2: "etcd-v2"}
CONF: dict[str, dict[str, object]] = {
    LEGACY: {"last_call_timeout": 2, "read_timeout": 10, "timeout": 120},
    V2: {
        "last_call_timeout": 2,
        "join_timeout": 120,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
        "read_timeout": 10,
    },
}
AGENT_TIMEOUT = 180


def _results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("result-*.json"))]


def _progress(out: Path) -> list[dict[str, Any]]:
    found = []
    for path in out.glob("progress-*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # replaced between glob and read
            continue
    return found


def _start(agents: list[Agent], names: list[str], out: Path, **kwargs: Any) -> list[Agent]:
    new = [Agent(name, out, **kwargs) for name in names]
    agents.extend(new)
    return new


def _three_train_together(
    agents: list[Agent], out: Path, backend: str, endpoint: str, run_id: str, **kwargs: Any
) -> list[Agent]:
    """Start agents a, b and c (one worker each, up to 3 restarts) and wait until all
    three train in one world of three (each past its first step)."""
    group = _start(
        agents,
        ["a", "b", "c"],
        out,
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        nproc_per_node=1,
        max_restarts=3,
        **kwargs,
    )

    def training() -> set[str]:
        return {p["agent"] for p in _world(out, 3) if p["step"] >= 1}

    wait_for(lambda: len(training()) == 3, 120, "three nodes training together", group)
    return group


def _expect_success(group: list[Agent]) -> None:
    for agent in group:
        code = agent.wait(AGENT_TIMEOUT)
        assert code == 0, f"agent {agent.name} exited with {code}\n{agent.log()}"


def _train_on_two_agents(
    agents: list[Agent], out: Path, backend: str, endpoint: str, run_id: str, **kwargs: Any
) -> list[dict[str, Any]]:
    """Run two agents (``--nnodes=2``) to success; the results their workers wrote."""
    group = _start(
        agents,
        ["a", "b"],
        out,
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        nnodes="2",
        **kwargs,
    )
    _expect_success(group)
    return _results(out)


@pytest.mark.parametrize(
    ("backend", "share_agent_store"),
    [(LEGACY, False), (V2, True), (V2, False)],
    ids=["etcd-rendezvous", "etcd-rendezvous-v2", "etcd-rendezvous-v2-no-agent-store"],
)
def test_two_agents_train_with_world_size_four(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    tmp_path: Path,
    agents: list[Agent],
    backend: str,
    share_agent_store: bool,
) -> None:
    env = {} if share_agent_store else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    results = _train_on_two_agents(
        agents,
        tmp_path,
        backend,
        etcd_server.get_endpoint(),
        run_id,
        nproc_per_node=2,
        rdzv_conf=CONF[backend],
        env=env,
    )
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world_size"] for r in results} == {4}
    assert {r["env_world_size"] for r in results} == {4}
    assert {r["sum"] for r in results} == {1.0 + 2 + 3 + 4}
    assert {r["group_world_size"] for r in results} == {2}
    assert sorted(r["group_rank"] for r in results) == [0, 0, 1, 1]
    assert {r["run_id"] for r in results} == {run_id}
    # The legacy backend never shares the agent's store; etcd-v2 does unless opted out.
    assert {r["use_agent_store"] for r in results} == {str(share_agent_store)}
    # The run's state is in etcd under PyTorch's key layout (so this was our backend).
    node = conn.get(state_key(RDZV_BACKEND[backend], run_id))
    if backend == LEGACY:
        assert json.loads(node.value)["status"] == "closed"  # set by the agents' shutdown()


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_survivors_finish_with_a_smaller_world_after_a_node_is_killed(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent], backend: str
) -> None:
    group = _three_train_together(
        agents,
        tmp_path,
        backend,
        etcd_server.get_endpoint(),
        run_id,
        nnodes="1:3",
        rdzv_conf=CONF[backend],
        steps=40,
        step_seconds=0.15,
    )
    # Lose the node of global rank 0: it hosts the master store, so the survivors must
    # also move MASTER_ADDR/PORT to a new rank 0.
    victim_name = _agent_of_rank_zero(tmp_path)
    victim = next(agent for agent in group if agent.name == victim_name)
    survivors = [agent for agent in group if agent is not victim]
    victim.kill_node()

    _expect_success(survivors)
    results = _results(tmp_path)
    assert sorted(r["agent"] for r in results) == sorted(a.name for a in survivors)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["world_size"] for r in results} == {2}
    assert {r["sum"] for r in results} == {1.0 + 2}
    # They resumed from the checkpoint: the kill happened mid-training, not after it.
    assert all(r["resumed_from"] >= 1 for r in results), results
    # The first survivor to notice restarted its failed workers, which counts as a
    # restart. The other may instead have seen that node waiting before its own workers
    # failed: torchrun restarts for such a membership change without counting it.
    assert max(r["restart"] for r in results) >= 1, results


def _agent_of_rank_zero(out: Path) -> str:
    """The agent whose worker is global rank 0 in the three-node world."""
    for path in out.glob("progress-*-0.json"):
        data = json.loads(path.read_text())
        if data["world_size"] == 3:
            return str(data["agent"])
    raise AssertionError("no rank 0 progress in the three-node world")


TLS_CONF = {
    LEGACY: {"protocol": "https", "cacert": "ca.crt", "cert": "node.crt", "key": "node.key"},
    V2: {
        "protocol": "https",
        "ca_cert": "ca.crt",
        "ssl_cert": "node.crt",
        "ssl_cert_key": "node.key",
    },
}


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_two_agents_over_tls_with_client_certificates(
    tls_etcd_server: EtcdServer,
    tls_certs: dict[str, str],
    run_id: str,
    tmp_path: Path,
    agents: list[Agent],
    backend: str,
) -> None:
    # The TLS options name files; torchrun passes them through --rdzv-conf as strings.
    tls = {
        option: value if option == "protocol" else tls_certs[value]
        for option, value in TLS_CONF[backend].items()
    }
    results = _train_on_two_agents(
        agents,
        tmp_path,
        backend,
        tls_etcd_server.get_endpoint(),
        run_id,
        nproc_per_node=1,
        rdzv_conf={**CONF[backend], **tls},
    )
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["sum"] for r in results} == {3.0}


def test_two_agents_insisting_on_the_v3_api(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent]
) -> None:
    results = _train_on_two_agents(
        agents,
        tmp_path,
        V2,
        etcd_server.get_endpoint(),
        run_id,
        nproc_per_node=1,
        rdzv_conf={**CONF[V2], "etcd_api": "v3"},
    )
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["sum"] for r in results} == {3.0}
    # The state is in the v3 key space (on etcd 3.4/3.5 it is apart from v2's).
    endpoint = [(etcd_server.get_host(), etcd_server.get_port())]
    with open_transport(endpoint, etcd_api="v3") as v3:
        assert v3.get(state_key("etcd-v2", run_id)).value


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_insisting_on_v2_against_an_etcd_without_it_fails_naming_etcd_api(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent], backend: str
) -> None:
    with EtcdServer(etcd_binary=etcd_server.binary, enable_v2=False) as server:
        (agent,) = _start(
            agents,
            ["a"],
            tmp_path,
            backend=backend,
            endpoint=server.get_endpoint(),
            run_id=run_id,
            nnodes="1",
            nproc_per_node=1,
            rdzv_conf={**CONF[backend], "etcd_api": "v2"},
        )
        code = agent.wait(AGENT_TIMEOUT)
    log = agent.log(tail=400)
    assert code != 0, log
    # The agent's last words are the error, naming the option and the endpoint.
    last = log.strip().splitlines()[-1]
    assert "etcd_api=v2, but etcd" in last, log
    assert server.get_endpoint() in last, log
    assert _results(tmp_path) == []


# -- membership changes over v3, and torch's graceful exit --------------------------------

V3_CONF = {backend: {**conf, "etcd_api": "v3"} for backend, conf in CONF.items()}


def _world(out: Path, size: int, after: float = 0.0) -> list[dict[str, Any]]:
    """The latest progress of each rank of a world of ``size`` begun after ``after``."""
    return [p for p in _progress(out) if p["world_size"] == size and p["first_step_at"] > after]


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_over_v3_the_survivors_of_a_node_loss_train_as_a_world_of_two(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent], backend: str
) -> None:
    group = _three_train_together(
        agents,
        tmp_path,
        backend,
        etcd_server.get_endpoint(),
        run_id,
        nnodes="2:3",
        rdzv_conf=V3_CONF[backend],
        steps=10_000,
        step_seconds=0.1,
    )
    # Agent c is the youngest: its worker is not rank 0 (in most runs), so rank 0's agent,
    # hosting the workers' TCPStore, survives and must start a new one for the next world.
    victim = next(a for a in group if a.name == "c")
    victim.kill_node()
    killed_at = time.time()
    survivors = [a for a in group if a is not victim]
    wait_for(lambda: len(_world(tmp_path, 2, killed_at)) == 2, 120, "a world of two", survivors)
    world = _world(tmp_path, 2, killed_at)
    assert sorted(p["agent"] for p in world) == ["a", "b"]
    ranks = sorted(int(path.stem.rsplit("-", 1)[1]) for path in _progress_files(tmp_path, world))
    assert ranks == [0, 1]


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_over_v3_a_third_agent_joins_two_that_train(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent], backend: str
) -> None:
    common: dict[str, Any] = {
        "backend": backend,
        "endpoint": etcd_server.get_endpoint(),
        "run_id": run_id,
        "nnodes": "2:3",
        "nproc_per_node": 1,
        "rdzv_conf": V3_CONF[backend],
        "max_restarts": 3,
        "steps": 10_000,
        "step_seconds": 0.1,
    }
    group = _start(agents, ["a", "b"], tmp_path, **common)
    wait_for(lambda: len(_world(tmp_path, 2)) == 2, 120, "two nodes training", group)
    started_at = time.time()
    group += _start(agents, ["c"], tmp_path, **common)
    wait_for(lambda: len(_world(tmp_path, 3, started_at)) == 3, 120, "a world of three", group)
    world = _world(tmp_path, 3, started_at)
    assert sorted(p["agent"] for p in world) == ["a", "b", "c"]
    ranks = sorted(int(path.stem.rsplit("-", 1)[1]) for path in _progress_files(tmp_path, world))
    assert ranks == [0, 1, 2]


def test_over_v3_a_surplus_etcd_v2_agent_exits_through_torch_s_graceful_exit(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent]
) -> None:
    common: dict[str, Any] = {
        "backend": V2,
        "endpoint": etcd_server.get_endpoint(),
        "run_id": run_id,
        "nnodes": "1:2",
        "nproc_per_node": 1,
        "rdzv_conf": V3_CONF[V2],
        "steps": 40,
        "step_seconds": 0.2,
        # torch's agent says "Rendezvous gracefully exited" at INFO.
        "env": {"LOGLEVEL": "INFO"},
    }
    members = _start(agents, ["a", "b"], tmp_path, **common)
    wait_for(lambda: len(_world(tmp_path, 2)) == 2, 120, "two nodes training", members)
    (spare,) = _start(agents, ["c"], tmp_path, **common)
    _expect_success(members)
    code = spare.wait(AGENT_TIMEOUT)
    log = spare.log(tail=400)
    # torch's agent caught torch's RendezvousGracefulExitError (ours, re-classed)...
    assert "Rendezvous gracefully exited" in log, log
    assert "etcd_rendezvous.api.RendezvousGracefulExitError" not in log, log
    # ... and then torch 2.13's launcher fails on the None that agent.run() returns
    # after it (as with torch's own etcd-v2): that is the only error allowed.
    if code != 0:
        assert "'NoneType' object has no attribute 'is_failed'" in log, log
    results = _results(tmp_path)
    assert sorted(r["agent"] for r in results) == ["a", "b"]
    assert sorted(r["rank"] for r in results) == [0, 1]


def _progress_files(out: Path, world: list[dict[str, Any]]) -> list[Path]:
    """The progress files (``progress-<restart>-<rank>.json``) of the workers in ``world``."""
    pids = {p["pid"] for p in world}
    found = []
    for path in out.glob("progress-*.json"):
        try:
            if json.loads(path.read_text())["pid"] in pids:
                found.append(path)
        except (OSError, ValueError):
            continue
    return found


# -- etcd-torchrun ------------------------------------------------------------------------


def _etcd_torchrun() -> list[str]:
    """The ``etcd-torchrun`` console script next to this Python, else its module."""
    script = Path(sys.executable).with_name("etcd-torchrun")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "etcd_rendezvous.torchrun"]


def test_etcd_torchrun_serves_torch_s_etcd_v2_name_against_an_etcd_without_v2(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent]
) -> None:
    # PyTorch's own etcd-v2 cannot work here: it speaks v2 only.
    with EtcdServer(etcd_binary=etcd_server.binary, enable_v2=False) as server:
        results = _train_on_two_agents(
            agents,
            tmp_path,
            "etcd-v2",
            server.get_endpoint(),
            run_id,
            nproc_per_node=1,
            rdzv_conf=CONF[V2],
            launcher=_etcd_torchrun(),
        )
        endpoint = [(server.get_host(), server.get_port())]
        with open_transport(endpoint, etcd_api="v3") as v3:
            assert v3.get(state_key("etcd-v2", run_id)).value
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["sum"] for r in results} == {3.0}
    assert {r["run_id"] for r in results} == {run_id}
