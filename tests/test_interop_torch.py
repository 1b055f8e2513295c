"""Mixed fleets: our workers and PyTorch 2.13's ``etcd`` backend in one rendezvous.

Skipped when PyTorch is not installed (CI installs ``torch==2.13.0``), and on an etcd
without the v2 API: PyTorch's backend speaks only v2 (our workers pick v2 too, with
``etcd_api=auto``, where the server serves it).
"""

from __future__ import annotations

import json

import pytest

from etcd_rendezvous.etcd_server import EtcdServer
from rdzv_helpers import Worker, expect_joined, wait_for_state

pytest.importorskip(
    "torch.distributed.elastic.rendezvous.etcd_rendezvous",
    reason="PyTorch is not installed: `pip install torch==2.13.0` to run mixed-fleet tests",
)

pytestmark = [
    pytest.mark.torch,
    pytest.mark.v2_only(reason="PyTorch's etcd backend speaks only v2"),
]


def _spawn(workers: list[Worker], impls: list[str], etcd_server: EtcdServer, *args, **kw):
    new = [Worker(etcd_server.get_endpoint(), *args, impl=impl, **kw) for impl in impls]
    workers.extend(new)
    for worker in new:
        worker.wait_ready()
    return new


@pytest.mark.parametrize("first", ["ours", "torch"])
def test_mixed_static_fleet_rendezvous_and_share_a_store(etcd_server, run_id, workers, first):
    other = "torch" if first == "ours" else "ours"
    # Our workers hand out their TorchEtcdStore, as they do by default with PyTorch installed.
    group = _spawn(
        workers,
        [first, other, first, other],
        etcd_server,
        run_id,
        4,
        4,
        extra_args=["--torch-store=auto"],
    )
    # The first worker creates the rendezvous state alone, then the rest join.
    group[0].send("join")
    for worker in group[1:]:
        worker.send("join")
    joined = [expect_joined(w.next_event(), w) for w in group]

    assert sorted(j["rank"] for j in joined) == [0, 1, 2, 3]
    assert {j["world_size"] for j in joined} == {4}
    assert {j["version"] for j in joined} == {"1"}
    assert len({(j["master_addr"], j["master_port"]) for j in joined}) == 1
    assert {j["store_type"] for w, j in zip(group, joined) if w.impl == "ours"} == {
        "TorchEtcdStore"
    }

    # One store: values set by either implementation are read by the other.
    for worker, info in zip(group, joined):
        assert worker.request(f"set from_{info['rank']} {worker.impl}")["event"] == "ok"
    for worker in group:
        for info, writer in zip(joined, group):
            reply = worker.request(f"get from_{info['rank']}")
            assert reply == {"event": "value", "value": writer.impl}
    totals = sorted(w.request("add shared 5")["value"] for w in group)
    assert totals == [5, 10, 15, 20]


# PyTorch's worker sleeps 1 s after a lost race (for example when another worker destroyed
# the lapsed rendezvous first), so a 1 s last call can close the next rendezvous before it
# is back; 4 s leaves it a margin without making the test slow.
LATE_JOINER_LAST_CALL = 4


def test_late_torch_worker_makes_our_members_rerendezvous(etcd_server, run_id, workers, conn):
    members = _spawn(
        workers, ["ours", "torch"], etcd_server, run_id, 2, 3, last_call=LATE_JOINER_LAST_CALL
    )
    for worker in members:
        worker.send("join")
    first = [expect_joined(w.next_event(), w) for w in members]
    assert {j["world_size"] for j in first} == {2}

    (late,) = _spawn(workers, ["torch"], etcd_server, run_id, 2, 3, last_call=LATE_JOINER_LAST_CALL)
    late.send("join")
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    wait_for_state(conn, key, lambda s: s is not None and s.get("num_workers_waiting") == 1)
    assert members[0].request("waiting") == {"event": "waiting", "n": 1}
    assert members[1].request("waiting") == {"event": "waiting", "n": 1}

    for worker in members:
        worker.send("join")
    second = [expect_joined(w.next_event(), w) for w in [*members, late]]
    assert sorted(j["rank"] for j in second) == [0, 1, 2]
    assert {j["world_size"] for j in second} == {3}
    assert {j["version"] for j in second} == {"2"}


def test_torch_sees_a_rendezvous_closed_by_us(etcd_server, run_id, workers, conn):
    ours, theirs = _spawn(workers, ["ours", "torch"], etcd_server, run_id, 2, 2)
    for worker in (ours, theirs):
        worker.send("join")
    for worker in (ours, theirs):
        expect_joined(worker.next_event(), worker)
    assert ours.request("close") == {"event": "ok"}
    assert theirs.request("closed") == {"event": "closed", "value": True}
    state = json.loads(conn.get(f"/torchelastic/p2p/run_{run_id}/rdzv/active_version").value)
    assert state["status"] == "closed"
    reply = theirs.request("join")
    assert reply["event"] == "error"
    assert reply["type"] == "RendezvousClosedError"
