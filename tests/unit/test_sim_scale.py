"""The rendezvous simulation (benchmarks/sim_scale.py) against hand counts.

The simulation backs the ten-thousand-node figures of docs/scale.rst: its answers must
be etcd's answers byte for byte, its state values the backends' own, and the two
protocols must differ the way the design says.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from urllib.parse import urlencode

import pytest

from etcd_rendezvous._dynamic.state import decode_state
from etcd_rendezvous._legacy.admission import Announced, plan_admission

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sim_scale as sim

from support.v3_gateway import b64

EXPIRATION = "2026-11-25T23:35:00.123456789Z"


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def settings(window: float = 0.0) -> sim.Settings:
    return sim.Settings(
        window=window, rtt=0.001, server_rate=150e6, slow=0.0, slow_delay=0.0, seed=1
    )


def test_legacy_state_is_the_one_plan_admission_writes() -> None:
    fmt = sim.LegacyFormat(sim.Names(), 8)
    created = list(range(20, 28))
    value, ttl, final = fmt.state(range(8), created)
    entries = [
        Announced(created[i], key.rsplit("/", 1)[1], key) for i, key in enumerate(fmt.member_keys)
    ]
    opening = {"status": "joinable", "version": "1", "participants": []}
    write = plan_admission(opening, entries, min_workers=8, max_workers=8)
    assert write is not None
    assert value == json.dumps(write.state)
    assert final
    assert ttl is None
    state = json.loads(value)
    assert state["status"] == "final"
    assert sorted(state["members"].values()) == list(range(8))
    assert state["keep_alives"] == fmt.member_keys


def test_dynamic_state_decodes_as_the_backend_reads_it() -> None:
    fmt = sim.DynamicFormat(sim.Names(), 6)
    value, ttl, complete = fmt.state(range(6), [])
    state = decode_state(base64.b64decode(value), "the simulation")
    assert complete
    assert ttl == 7200
    assert state.complete
    assert sorted(state.participants.values()) == list(range(6))
    assert set(state.last_heartbeats) == set(fmt.descs)
    partial, _, complete = fmt.state(range(3), [])
    assert not complete
    assert len(decode_state(base64.b64decode(partial), "the simulation").participants) == 3


def test_v2_compare_and_swap_sizes_are_etcds_json() -> None:
    api = sim.Api("v2")
    prev = sim.Entry("/s", '{"a": 1}', 5, 9, 2, 10)
    new = sim.Entry("/s", '{"a": 2}', 5, 12, 3, None)
    sent, received = api.cas(new, prev, 12)
    assert sent == len(urlencode({"value": '{"a": 2}', "prevIndex": 9}))
    answer = (
        '{"action":"compareAndSwap",'
        '"node":{"key":"/s","value":"{\\"a\\": 2}","modifiedIndex":12,"createdIndex":5},'
        '"prevNode":{"key":"/s","value":"{\\"a\\": 1}","expiration":"' + EXPIRATION + '",'
        '"ttl":10,"modifiedIndex":9,"createdIndex":5}}'
    )
    assert received == len(answer)


@pytest.mark.parametrize("api", ["v2", "v3"])
def test_one_state_write_costs_each_of_k_watchers_its_event(api: str) -> None:
    """One batch, k followers watching the state: each receives the write's event,
    and nothing else; the total is k times the hand-built event."""
    k = 5
    fmt = sim.LegacyFormat(sim.Names(), k + 1)
    model = sim.Sim(fmt, api, "now", k + 1, settings())
    old = model.write(fmt.state_key, '{"status": "joinable"}', 10, "create")[0]
    for node in range(k):
        model.watchers.setdefault(fmt.state_key, set()).add(node)
    value, _, _ = fmt.state(range(k + 1), list(range(20, 26)))
    new, _ = model.write(fmt.state_key, value, None, "compareAndSwap")
    if api == "v2":
        event = compact(
            {
                "action": "compareAndSwap",
                "node": {
                    "key": fmt.state_key,
                    "value": value,
                    "modifiedIndex": new.modified,
                    "createdIndex": old.created,
                },
                "prevNode": {
                    "key": fmt.state_key,
                    "value": '{"status": "joinable"}',
                    "expiration": EXPIRATION,
                    "ttl": 10,
                    "modifiedIndex": old.modified,
                    "createdIndex": old.created,
                },
            }
        )
    else:
        header = {
            "cluster_id": "14841639068965178418",
            "member_id": "10276657743932975437",
            "revision": str(new.modified),
            "raft_term": "2",
        }
        kv = {
            "key": b64(fmt.state_key),
            "create_revision": str(old.created),
            "mod_revision": str(new.modified),
            "version": "2",
            "value": b64(value),
        }
        event = compact({"result": {"header": header, "events": [{"kv": kv}]}})
    per_watcher = len(event) + 1  # one object per line of the stream
    for node in range(k):
        assert model.stats[node].received == {"watch": per_watcher}
        assert model.stats[node].state_events == 1
        assert model.stats[node].requests == 0
    assert model.stats[k].received == {}
    assert sum(sum(s.received.values()) for s in model.stats) == k * per_watcher


def test_a_listing_is_its_entries_and_an_envelope() -> None:
    fmt = sim.DynamicFormat(sim.Names(), 4)
    model = sim.Sim(fmt, "v2", "now", 4, settings())
    for node in range(4):
        model.announce(node, None)
    model.run_pending()
    model.listing(0, 0, lambda: None)
    model.run_pending()
    entries = [
        compact(
            {
                "key": fmt.member_keys[node],
                "value": fmt.member_values[node],
                "expiration": EXPIRATION,
                "ttl": 10,
                "modifiedIndex": model.created[node],
                "createdIndex": model.created[node],
            }
        )
        for node in model.members
    ]
    envelope = compact(
        {
            "action": "get",
            "node": {
                "key": fmt.directory,
                "dir": True,
                "nodes": [],
                "modifiedIndex": 5,
                "createdIndex": 5,
            },
        }
    )
    assert model.stats[0].received["list"] == len(envelope) + sum(len(e) + 1 for e in entries)
    assert model.stats[0].listings == 1


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
@pytest.mark.parametrize("api", ["v2", "v3"])
def test_every_node_finishes_with_the_whole_state(backend: str, api: str) -> None:
    final = sim.state_size(backend, 64, sim.Names())
    for protocol in ("now", "progress"):
        row = sim.simulate(backend, api, protocol, 64, settings(window=0.2), sim.Names())
        assert row["unfinished"] == 0, (protocol, row)
        assert row["state_bytes"] == final
        assert row["max_request_bytes"] < sim.MAX_REQUEST_BYTES


def per_state(row: dict[str, object]) -> float:
    """kB received per node in units of the final state."""
    return float(row["kb_received"]) * 1000 / int(row["state_bytes"])  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_progress_stays_a_few_states_per_node_while_now_grows(backend: str) -> None:
    rows = {}
    for nodes in (64, 512):
        window = 0.003 * nodes
        for protocol in ("now", "progress"):
            rows[protocol, nodes] = sim.simulate(
                backend, "v3", protocol, nodes, settings(window), sim.Names()
            )
    for nodes in (64, 512):
        progress, now = rows["progress", nodes], rows["now", nodes]
        # The targets: a few states and a small fixed cost per node, few listings.
        state = int(progress["state_bytes"])  # type: ignore[call-overload]
        assert float(progress["kb_received"]) * 1000 <= 4 * state + 16_000  # type: ignore[arg-type]
        assert float(progress["listings"]) <= 0.5  # type: ignore[arg-type]
        assert float(progress["state_events"]) <= 0.5  # type: ignore[arg-type]
        # Today every node receives every state write and lists every key.
        assert per_state(now) >= 3 * per_state(progress)
        assert float(now["listings"]) >= 0.9  # type: ignore[arg-type]
    small, large = rows["progress", 64], rows["progress", 512]
    assert abs(per_state(large) - per_state(small)) <= 0.25 * per_state(small)
    assert abs(float(large["requests"]) - float(small["requests"])) <= 1.0  # type: ignore[arg-type]
    # ... while the bytes of 'now' grow with N faster than the state itself.
    now_growth = float(rows["now", 512]["kb_received"]) / float(rows["now", 64]["kb_received"])  # type: ignore[arg-type]
    progress_growth = float(large["kb_received"]) / float(small["kb_received"])  # type: ignore[arg-type]
    assert now_growth > progress_growth


def test_a_slow_head_is_admitted_by_its_successor_within_a_stagger() -> None:
    slow = sim.Settings(window=0.5, rtt=0.001, server_rate=150e6, slow=0.2, slow_delay=5.0, seed=3)
    progress = sim.simulate("etcd", "v3", "progress", 64, slow, sim.Names())
    now = sim.simulate("etcd", "v3", "now", 64, slow, sim.Names())
    assert progress["unfinished"] == now["unfinished"] == 0
    # A slow oldest key holds every later one in 'now' for a grace period; in
    # 'progress' the next candidate admits it with the others after a stagger.
    assert float(progress["admitted_seconds"]) + 1.0 < float(now["admitted_seconds"])  # type: ignore[arg-type]
