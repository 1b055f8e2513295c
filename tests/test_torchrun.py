"""``torchrun`` with this package's plugin backends: real agents, real gloo training.

Each test starts ``torchrun`` agents on localhost against the session's etcd. Their
workers (``torchrun_worker.py``) all-reduce over gloo and write what they saw as JSON.
The backends talk to etcd over the API ``etcd_api=auto`` picks (v2 where the server
serves it, else v3); one run insists on v3 with ``--rdzv-conf etcd_api=v3``.
Skipped when PyTorch is not installed (CI installs ``torch==2.13.0``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous._connect import open_transport
from etcd_rendezvous._transport import Transport
from etcd_rendezvous.etcd_server import EtcdServer
from torchrun_helpers import Agent, wait_for

pytest.importorskip("torch.distributed.run", reason="PyTorch is not installed")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

# Per backend: the torchrun name, the --rdzv-conf that keeps the test short (every value
# reaches the backend as a string), and the etcd key holding the run's state.
LEGACY = "etcd-rendezvous"
V2 = "etcd-rendezvous-v2"
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


def _state_key(backend: str, run_id: str) -> str:
    if backend == LEGACY:
        return f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    return f"/torch/elastic/rendezvous/{run_id}"


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


@pytest.fixture
def agents():
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.stop()


def _start(agents: list[Agent], names: list[str], out: Path, **kwargs: Any) -> list[Agent]:
    new = [Agent(name, out, **kwargs) for name in names]
    agents.extend(new)
    return new


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
    node = conn.get(_state_key(backend, run_id))
    if backend == LEGACY:
        assert json.loads(node.value)["status"] == "closed"  # set by the agents' shutdown()


@pytest.mark.parametrize("backend", [LEGACY, V2])
def test_survivors_finish_with_a_smaller_world_after_a_node_is_killed(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent], backend: str
) -> None:
    group = _start(
        agents,
        ["a", "b", "c"],
        tmp_path,
        backend=backend,
        endpoint=etcd_server.get_endpoint(),
        run_id=run_id,
        nnodes="1:3",
        nproc_per_node=1,
        rdzv_conf=CONF[backend],
        max_restarts=3,
        steps=40,
        step_seconds=0.15,
    )

    def training_with_three() -> list[dict[str, Any]]:
        return [p for p in _progress(tmp_path) if p["world_size"] == 3 and p["step"] >= 1]

    wait_for(
        lambda: len({p["agent"] for p in training_with_three()}) == 3,
        timeout=120,
        what="three nodes training together",
        agents=group,
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
        assert v3.get(_state_key(V2, run_id)).value


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
