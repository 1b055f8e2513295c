"""An agent-side event handler under ``torchrun`` receives our dynamic rendezvous's events.

Two real ``torchrun`` agents (``tests/support/scripts/event_agent.py``: torchrun's
``main()`` with a handler installed for PyTorch's ``dynamic_rendezvous`` event
destination) rendezvous through the ``etcd-rendezvous-v2`` backend of this package and
run a one-step gloo job. Skipped when PyTorch is not installed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous.etcd_server import EtcdServer
from support import EVENT_AGENT
from support.torchrun import Agent

pytest.importorskip("torch.distributed.run", reason="PyTorch is not installed")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

AGENT_TIMEOUT = 180
CONF = {
    "last_call_timeout": 1,
    "join_timeout": 60,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
    "read_timeout": 10,
}
HANDLER = "dynamic_rendezvous.py:DynamicRendezvousHandler"
JOINED = re.compile(
    r"has joined round (\d+) of the rendezvous '(.+)' as rank (\d+) in a world of size (\d+)\."
)


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_agents_event_handler_receives_our_rendezvous_events(
    etcd_server: EtcdServer, run_id: str, tmp_path: Path, agents: list[Agent]
) -> None:
    for name in ["a", "b"]:
        agents.append(
            Agent(
                name,
                tmp_path,
                backend="etcd-rendezvous-v2",
                endpoint=etcd_server.get_endpoint(),
                run_id=run_id,
                nnodes="2",
                nproc_per_node=1,
                rdzv_conf=CONF,
                steps=1,
                env={"EVENTS_FILE": str(tmp_path / f"events-{name}.jsonl")},
                launcher=[sys.executable, str(EVENT_AGENT)],
            )
        )
    for agent in agents:
        code = agent.wait(AGENT_TIMEOUT)
        assert code == 0, f"agent {agent.name} exited with {code}\n{agent.log()}"

    joined_ranks = []
    for agent in agents:
        events = _events(tmp_path / f"events-{agent.name}.jsonl")
        assert {e["run_id"] for e in events} == {run_id}
        # Recorded by the agent process itself, for its node (the --local-addr).
        assert {(e["pid"], e["hostname"]) for e in events} == {(agent.process.pid, "127.0.0.1")}
        names = [(e["name"], e["node_state"]) for e in events]
        assert names[0] == (f"{HANDLER}.next_rendezvous", "RUNNING")
        assert (
            "dynamic_rendezvous.py:_DistributedRendezvousOpExecutor._add_to_participants",
            "RUNNING",
        ) in names
        # The agent shuts the rendezvous down once the job succeeded.
        assert names[-1] == (f"{HANDLER}._close", "SUCCEEDED")
        assert not [e for e in events if e["node_state"] == "FAILED"]

        (joined,) = [
            e for e in events if e["name"] == f"{HANDLER}.next_rendezvous" and e["rank"] is not None
        ]
        match = JOINED.search(joined["message"])
        assert match, joined
        round_, run, rank, world_size = match.groups()
        assert (round_, run, int(rank), world_size) == ("0", run_id, joined["rank"], "2")
        joined_ranks.append(joined["rank"])
    assert sorted(joined_ranks) == [0, 1]
