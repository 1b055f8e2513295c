"""The dynamic rendezvous over ``etcd-v2`` with real worker processes and a real etcd.

Each scenario runs with our implementation and with PyTorch 2.13's (skipped without
PyTorch), and mixed fleets run both in one rendezvous. PyTorch's backend speaks only
etcd's v2 API, so its runs are ``v2_only``; ours run over either API.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
from base64 import b64decode, b64encode
from datetime import timedelta
from pathlib import Path

import pytest

from etcd_rendezvous.api import RendezvousParameters, RendezvousStateError
from etcd_rendezvous.dynamic_rendezvous import decode_state
from etcd_rendezvous.etcd_server import EtcdServer
from support.rdzv import Worker, check_shared_store, expect_joined, join_all, started
from support.wait import each_version, wait_until

_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_NEEDS_TORCH = pytest.mark.skipif(
    not _HAVE_TORCH, reason="PyTorch is not installed: `pip install torch==2.13.0`"
)
_TORCH_SPEAKS_V2 = pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")
IMPLS = [
    pytest.param("ours", id="ours"),
    pytest.param("torch", id="torch", marks=[_NEEDS_TORCH, pytest.mark.torch, _TORCH_SPEAKS_V2]),
]

pytestmark = pytest.mark.slow


def _spawn(
    workers: list[Worker],
    etcd_server: EtcdServer,
    run_id: str,
    impls: list[str],
    lo: int,
    hi: int,
    *,
    last_call: int = 1,
    keep_alive_interval: int = 1,
    keep_alive_max_attempt: int = 4,
) -> list[Worker]:
    extra = [
        "--backend=etcd-v2",
        f"--keep-alive-interval={keep_alive_interval}",
        f"--keep-alive-max-attempt={keep_alive_max_attempt}",
    ]
    new = [
        Worker(
            etcd_server.get_endpoint(),
            run_id,
            lo,
            hi,
            impl=impl,
            last_call=last_call,
            extra_args=extra,
        )
        for impl in impls
    ]
    return started(workers, new)


def _check_group(joined: list[dict], size: int) -> None:
    assert sorted(j["rank"] for j in joined) == list(range(size))
    assert {j["world_size"] for j in joined} == {size}
    assert len({j["round"] for j in joined}) == 1
    # Rank 0 published the bootstrap address; everyone read the same one.
    assert len({(j["master_addr"], j["master_port"]) for j in joined}) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_static_four_nodes(etcd_server, run_id, workers, impl):
    group = _spawn(workers, etcd_server, run_id, [impl] * 4, 4, 4, last_call=30)
    joined = join_all(group)
    _check_group(joined, 4)
    check_shared_store(group, joined)


@pytest.mark.parametrize("impl", IMPLS)
def test_third_node_joining_during_last_call_completes_at_max(etcd_server, run_id, workers, impl):
    group = _spawn(workers, etcd_server, run_id, [impl] * 3, 2, 3, last_call=30)
    joined = join_all(group)
    _check_group(joined, 3)
    # Reaching max_nodes completes the rendezvous without waiting for the last call.
    assert max(j["elapsed"] for j in joined) < 20


@pytest.mark.parametrize("impl", IMPLS)
def test_late_node_waits_and_is_admitted_on_rerendezvous(etcd_server, run_id, workers, impl):
    members = _spawn(workers, etcd_server, run_id, [impl] * 2, 2, 3, last_call=1)
    first = join_all(members)
    _check_group(first, 2)

    (late,) = _spawn(workers, etcd_server, run_id, [impl], 2, 3, last_call=1)
    late.send("join")
    wait_until(lambda: members[0].request("waiting")["n"] == 1, timeout=30, what="a waiting node")
    # The members re-rendezvous, as an agent does when num_nodes_waiting() > 0.
    for member in members:
        member.send("join")
    second = [expect_joined(w.next_event(), w) for w in [*members, late]]
    _check_group(second, 3)
    assert second[0]["round"] > first[0]["round"]


@pytest.mark.parametrize("impl", IMPLS)
def test_killed_node_is_removed_after_its_heartbeats_lapse(etcd_server, run_id, workers, impl):
    group = _spawn(workers, etcd_server, run_id, [impl] * 3, 2, 3, last_call=1)
    joined = join_all(group)
    _check_group(joined, 3)
    victim = next(w for w, j in zip(group, joined) if j["rank"] == 2)
    survivors = [w for w in group if w is not victim]

    victim.kill()
    # The survivors re-rendezvous (their agent restarts them); the victim is dropped
    # once it missed keep_alive_interval * keep_alive_max_attempt seconds of heartbeats.
    regrouped = join_all(survivors)
    _check_group(regrouped, 2)
    assert regrouped[0]["round"] > joined[0]["round"]


@pytest.mark.parametrize("impl", IMPLS)
def test_close(etcd_server, run_id, workers, impl):
    group = _spawn(workers, etcd_server, run_id, [impl] * 2, 2, 2)
    join_all(group)
    assert group[0].request("closed") == {"event": "closed", "value": False}
    assert group[0].request("close") == {"event": "ok"}
    # is_closed() may serve a state cached for up to a second: it propagates eventually.
    wait_until(lambda: group[1].request("closed")["value"], timeout=10, what="closed")
    event = group[1].request("join")
    assert event["event"] == "error"
    assert event["type"] == "RendezvousClosedError"
    # A node that arrives after the close is refused as well.
    (late,) = _spawn(workers, etcd_server, run_id, [impl], 2, 2)
    event = late.request("join")
    assert (event["event"], event["type"]) == ("error", "RendezvousClosedError")


def test_shutdown_stops_the_heartbeat_thread(etcd_server, run_id, workers):
    group = _spawn(workers, etcd_server, run_id, ["ours"] * 2, 2, 2)
    join_all(group)
    event = group[0].request("shutdown")
    assert event["event"] == "shutdown"
    assert event["result"] is True
    assert not [name for name in event["threads"] if "keep" in name.lower()], event
    wait_until(lambda: group[1].request("closed")["value"], timeout=10, what="closed")


# -- mixed fleets ---------------------------------------------------------------------------


@_NEEDS_TORCH
@_TORCH_SPEAKS_V2
@pytest.mark.torch
@pytest.mark.parametrize("first", ["ours", "torch"])
def test_mixed_fleet_rendezvous_and_share_a_store(etcd_server, run_id, workers, first):
    other = "torch" if first == "ours" else "ours"
    group = _spawn(workers, etcd_server, run_id, [first, other, first, other], 4, 4, last_call=30)
    # The first node creates the state alone, then the others join it.
    group[0].send("join")
    for worker in group[1:]:
        worker.send("join")
    joined = [expect_joined(w.next_event(), w) for w in group]
    _check_group(joined, 4)
    check_shared_store(group, joined)


@_NEEDS_TORCH
@_TORCH_SPEAKS_V2
@pytest.mark.torch
@pytest.mark.parametrize("victim_impl", ["ours", "torch"])
def test_mixed_fleet_removes_a_killed_node(etcd_server, run_id, workers, victim_impl):
    group = _spawn(workers, etcd_server, run_id, ["ours", "torch", victim_impl], 2, 3)
    joined = join_all(group)
    _check_group(joined, 3)
    victim = group[2]
    victim.kill()
    survivors = group[:2]
    regrouped = join_all(survivors)
    _check_group(regrouped, 2)


@_NEEDS_TORCH
@_TORCH_SPEAKS_V2
@pytest.mark.torch
def test_torch_sees_a_rendezvous_closed_by_us(etcd_server, run_id, workers):
    ours, theirs = _spawn(workers, etcd_server, run_id, ["ours", "torch"], 2, 2)
    join_all([ours, theirs])
    assert ours.request("close") == {"event": "ok"}
    wait_until(lambda: theirs.request("closed")["value"], timeout=10, what="closed")


# -- safety ---------------------------------------------------------------------------------


class _Hostile:
    """Unpickling this opens (and so creates) the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_hostile_pickle_in_the_state_is_not_executed(etcd_server, run_id, conn, tmp_path):
    from etcd_rendezvous.registry import get_rendezvous_handler

    marker = tmp_path / "pwned"
    key = f"/torch/elastic/rendezvous/{run_id}"
    hostile = b64encode(pickle.dumps(_Hostile(marker))).decode()
    conn.set(key, hostile)

    params = RendezvousParameters(
        backend="etcd-v2",
        endpoint=etcd_server.get_endpoint(),
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        join_timeout=10,
        read_timeout=5,
    )
    handler = get_rendezvous_handler(params)
    with pytest.raises(RendezvousStateError, match=key):
        handler.next_rendezvous()
    with pytest.raises(RendezvousStateError, match=key):
        handler.num_nodes_waiting()
    # shutdown() must not overwrite the key either (it reports the failure).
    handler.shutdown()
    assert not marker.exists()
    assert conn.get(key).value == hostile


def test_late_node_is_admitted_with_the_shared_tcp_store(etcd_server, run_id, workers, monkeypatch):
    """With TCPStore sharing on (PyTorch's default), a node admitted in a later round
    gets the master address: our rank 0 republishes it every round (PyTorch 2.13's
    handler publishes it only in its first round, so its late joiners time out)."""
    pytest.importorskip("torch.distributed", reason="TCPStore sharing needs PyTorch")
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    members = _spawn(workers, etcd_server, run_id, ["ours"] * 2, 2, 3, last_call=1)
    first = join_all(members)
    _check_group(first, 2)

    (late,) = _spawn(workers, etcd_server, run_id, ["ours"], 2, 3, last_call=1)
    late.send("join")
    wait_until(lambda: members[0].request("waiting")["n"] == 1, timeout=30, what="a waiting node")
    for member in members:
        member.send("join")
    second = [expect_joined(w.next_event(timeout=60), w) for w in [*members, late]]
    _check_group(second, 3)


@pytest.mark.torch
@_NEEDS_TORCH
@_TORCH_SPEAKS_V2
def test_a_torch_node_surviving_a_round_finds_our_rank_0_s_new_tcp_store(
    etcd_server, run_id, workers, monkeypatch
):
    """With TCPStore sharing on, PyTorch 2.13's nodes other than rank 0 keep the master
    address and port of their first round: when our node stays rank 0 across a
    membership change, its new (empty) server listens on the same port."""
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    # Ranks go by node order (address, then pid): our node, spawned first, is rank 0.
    ours, theirs = _spawn(workers, etcd_server, run_id, ["ours", "torch"], 2, 3, last_call=1)
    first = join_all([ours, theirs])
    _check_group(first, 2)
    assert first[0]["rank"] == 0, "our node (the lower pid) should be rank 0"
    address = (first[0]["master_addr"], first[0]["master_port"])
    assert (first[1]["master_addr"], first[1]["master_port"]) == address
    # What the first world's workers leave in the shared store.
    old = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=10))
    old.set("gloo/first_world", "stale")

    (late,) = _spawn(workers, etcd_server, run_id, ["ours"], 2, 3, last_call=1)
    late.send("join")
    wait_until(lambda: ours.request("waiting")["n"] == 1, timeout=30, what="a waiting node")
    ours.send("join")
    theirs.send("join")
    second = [expect_joined(w.next_event(timeout=60), w) for w in (ours, theirs, late)]
    _check_group(second, 3)
    assert second[0]["rank"] == 0
    # PyTorch's node reports its first round's address (it never reads it again), and
    # our rank 0's new server is there: a fresh one, the old world's keys gone.
    assert {(j["master_addr"], j["master_port"]) for j in second} == {address}
    new = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=10))
    assert not new.check(["gloo/first_world"])
    new.set("gloo/second_world", "fresh")
    assert new.get("gloo/second_world") == b"fresh"


# -- our node keys ----------------------------------------------------------------------------


def test_killed_heartbeat_aggregator_is_replaced_and_nobody_else_is_dropped(
    etcd_server, run_id, workers, conn
):
    from etcd_rendezvous.layout import EtcdV2NodesLayout

    group = _spawn(workers, etcd_server, run_id, ["ours"] * 3, 2, 3, keep_alive_max_attempt=3)
    joined = join_all(group)
    _check_group(joined, 3)
    lock_key = EtcdV2NodesLayout(run_id).aggregator_key
    wait_until(lambda: conn.try_get(lock_key) is not None, timeout=15, what="an aggregator")
    holder = json.loads(conn.get(lock_key).value)
    (victim,) = [w for w in group if w.proc.pid == holder["pid"]]
    survivors = [w for w in group if w is not victim]
    victim.kill()
    # Another takes the lock once it lapses; the victim is dropped (its key lapses, then
    # its heartbeat), and no version of the state lacks a survivor meanwhile.
    state_key = f"/torch/elastic/rendezvous/{run_id}"
    pids = {w.proc.pid for w in survivors}
    for node in each_version(conn, state_key, 30):
        state = decode_state(b64decode(node.value), state_key)
        present = {n.pid for n in state.participants}
        assert pids <= present, (present, pids)
        if victim.proc.pid not in present:
            break

    def survivor_aggregates() -> bool:
        lock = conn.try_get(lock_key)
        return lock is not None and json.loads(lock.value)["pid"] in pids

    wait_until(survivor_aggregates, timeout=15, what="a surviving aggregator")
    regrouped = join_all(survivors)
    _check_group(regrouped, 2)
