"""The dynamic rendezvous with nodes whose wall clocks are wrong (libfaketime).

Our nodes write and judge the times in the state (heartbeats, the last-call deadline) on
etcd's clock, so one node whose own clock is off, even the one aggregating everyone's
heartbeats, drops nobody, and nobody drops it. See docs/how-it-works.rst, "The dynamic
rendezvous", Clocks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from base64 import b64decode

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.dynamic_rendezvous import decode_state
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.layout import EtcdV2NodesLayout
from support.rdzv import FAKETIME_LIBRARY, Worker, check_shared_store, skewed_clock, started
from support.wait import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(FAKETIME_LIBRARY), reason="libfaketime is not installed"),
]

INTERVAL = 1
ATTEMPTS = 3
#: A heartbeat's lifetime: how long after its last heartbeat a node is taken for dead.
LIFETIME = INTERVAL * ATTEMPTS
#: How far off the skewed node's clock is: more than a lifetime, less than two.
SKEW = 6


def _worker(
    etcd_server: EtcdServer, run_id: str, lo: int, hi: int, skew: int = 0, impl: str = "ours"
) -> Worker:
    """A worker of the ``etcd-v2`` backend (``impl``: ours or PyTorch's) whose host clock
    is ``skew`` seconds off."""
    extra = [
        "--backend=etcd-v2",
        f"--keep-alive-interval={INTERVAL}",
        f"--keep-alive-max-attempt={ATTEMPTS}",
    ]
    env = skewed_clock(skew) if skew else None
    return Worker(
        etcd_server.get_endpoint(),
        run_id,
        lo,
        hi,
        impl=impl,
        last_call=1,
        extra_args=extra,
        env=env,
    )


def _clock_offset(worker: Worker) -> float:
    """How far the worker's wall clock is from ours, in seconds."""
    before = time.time()
    reported = float(worker.request("clock")["time"])
    return reported - (before + time.time()) / 2


def _participants(conn: Transport, run_id: str) -> tuple[int, dict[int, int]]:
    """The state's modification index and its participants (pid: rank)."""
    key = f"/torch/elastic/rendezvous/{run_id}"
    node = conn.get(key)
    state = decode_state(b64decode(node.value or ""), key)
    return node.modified_index, {n.pid: rank for n, rank in state.participants.items()}


def _aggregator(conn: Transport, run_id: str) -> int | None:
    """The pid of the node holding the aggregator lock (``None``: nobody)."""
    lock = conn.try_get(EtcdV2NodesLayout(run_id).aggregator_key)
    return None if lock is None or not lock.value else int(json.loads(lock.value)["pid"])


def _first_aggregator(conn: Transport, run_id: str, first: Worker, others: list[Worker]) -> None:
    """``first`` joins alone and takes the aggregator lock (the first admitter does), then
    ``others`` join."""
    first.send("join")
    wait_until(lambda: _aggregator(conn, run_id) is not None, 15, "the first batch's lock")
    assert _aggregator(conn, run_id) == first.proc.pid
    for worker in others:
        worker.send("join")


def _assert_participants_stay(conn: Transport, run_id: str, pids: set[int], seconds: float):
    """The participants are ``pids`` in every version of the state for ``seconds``,
    while the state keeps changing (the aggregator's heartbeat folds)."""
    key = f"/torch/elastic/rendezvous/{run_id}"
    deadline = time.monotonic() + seconds
    index, participants = _participants(conn, run_id)
    versions = 0
    while (remaining := deadline - time.monotonic()) > 0:
        assert set(participants) == pids, f"participants changed: {participants} after {versions}"
        change = conn.watch(key, index + 1, Deadline(remaining))
        if change is not None:
            index, participants = _participants(conn, run_id)
            versions += 1
    assert set(participants) == pids
    # The heartbeats were refreshed meanwhile (about one fold per interval).
    assert versions >= seconds / INTERVAL / 2


@pytest.mark.parametrize(
    ("skew", "skewed_aggregates"),
    [
        pytest.param(-SKEW, True, id="behind-aggregating"),
        pytest.param(SKEW, True, id="ahead-aggregating"),
        pytest.param(SKEW, False, id="ahead-not-aggregating"),
    ],
)
def test_a_node_whose_clock_is_off_drops_nobody(
    etcd_server, run_id, workers, conn, skew, skewed_aggregates
):
    skewed = _worker(etcd_server, run_id, 2, 3, skew)
    right = [_worker(etcd_server, run_id, 2, 3) for _ in range(2)]
    started(workers, [skewed, *right])
    assert abs(_clock_offset(skewed) - skew) < 1, "libfaketime did not shift the clock"
    if skewed_aggregates:
        _first_aggregator(conn, run_id, skewed, right)
    else:
        _first_aggregator(conn, run_id, right[0], [skewed, right[1]])
    group = [skewed, *right]
    joined = [worker.next_event() for worker in group]
    assert [j["event"] for j in joined] == ["joined"] * 3, [
        (j, w.stderr) for j, w in zip(joined, group)
    ]
    assert sorted(j["rank"] for j in joined) == [0, 1, 2]
    _assert_participants_stay(conn, run_id, {w.proc.pid for w in group}, 3 * LIFETIME)
    # The node whose host clock is off said so (logging's last resort: stderr), with the
    # difference as it knows it: within half a second and a round trip.
    said = re.search(r"The wall clock of this host is (\d+\.\d) s (\w+)", skewed.all_stderr)
    assert said is not None, skewed.stderr
    assert abs(float(said[1]) - abs(skew)) < 1
    assert said[2] == ("behind" if skew < 0 else "ahead")
    assert not any("The wall clock of this host" in worker.all_stderr for worker in right)


def test_a_full_round_with_a_node_behind_completes_and_its_store_works(
    etcd_server, run_id, workers, conn
):
    skewed = _worker(etcd_server, run_id, 3, 3, -SKEW)
    right = [_worker(etcd_server, run_id, 3, 3) for _ in range(2)]
    started(workers, [skewed, *right])
    _first_aggregator(conn, run_id, skewed, right)
    group = [skewed, *right]
    joined = [worker.next_event() for worker in group]
    assert [j["event"] for j in joined] == ["joined"] * 3, [
        (j, w.stderr) for j, w in zip(joined, group)
    ]
    check_shared_store(group, joined)
    _assert_participants_stay(conn, run_id, {w.proc.pid for w in group}, 2 * LIFETIME)


@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed")
def test_a_pytorch_node_keeps_our_nodes_when_ours_aggregates_with_a_clock_behind(
    etcd_server, run_id, workers, conn
):
    """PyTorch's node judges heartbeats with its own (right) clock; ours stamp them in
    etcd's time, so it finds them fresh even when our aggregator's host is 6 s behind."""
    # A full round of three: PyTorch's node joins at once, ours when a batch admits it.
    skewed = _worker(etcd_server, run_id, 3, 3, -SKEW)
    ours = _worker(etcd_server, run_id, 3, 3)
    torch_node = _worker(etcd_server, run_id, 3, 3, impl="torch")
    started(workers, [skewed, ours, torch_node])
    _first_aggregator(conn, run_id, skewed, [ours, torch_node])
    group = [skewed, ours, torch_node]
    joined = [worker.next_event() for worker in group]
    assert [j["event"] for j in joined] == ["joined"] * 3, [
        (j, w.stderr) for j, w in zip(joined, group)
    ]
    _assert_participants_stay(conn, run_id, {w.proc.pid for w in group}, 3 * LIFETIME)
