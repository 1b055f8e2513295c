"""Batched admission and aggregated heartbeats of our ``etcd-v2`` nodes, against a real etcd.

Nodes run as threads of the test process (each with its own handler, connection and
backend), over whichever etcd API the session tests. What is checked is the protocol of
:mod:`etcd_rendezvous._dynamic.admission`: one round, ranks in node order, min/max and
last call, the wait and redundancy lists, a node that died between announcing and being
admitted, and the heartbeat aggregator (a killed one is replaced and nobody is dropped).
Worker processes with a real SIGKILL are in ``test_dynamic_etcd.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from base64 import b64decode
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from etcd_rendezvous._dynamic import admission
from etcd_rendezvous._dynamic.admission import ADMISSION_GRACE
from etcd_rendezvous.api import Deadline, RendezvousGracefulExitError, RendezvousTimeoutError
from etcd_rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    NodeDesc,
    RendezvousState,
    decode_state,
)
from etcd_rendezvous.etcd_server import EtcdServer
from support.handlers import backend_of, join_in
from support.wait import each_version, wait_until

pytestmark = pytest.mark.slow

Handlers = Callable[..., list[DynamicRendezvousHandler]]


@pytest.fixture
def handler_options() -> dict[str, Any]:
    """A short last call and a node dropped after 3 s without a heartbeat."""
    return {
        "last_call_timeout": 1,
        "close_timeout": 10,
        "keep_alive_interval": 1,
        "keep_alive_max_attempt": 3,
        "read_timeout": 10,
    }


def _state(handler: DynamicRendezvousHandler) -> RendezvousState:
    result = backend_of(handler).get_state()
    assert result is not None
    return decode_state(result[0], "the test")


def _check_ranks(group: list[DynamicRendezvousHandler], infos: list[Any]) -> None:
    """One world: every rank once, in the order of the node descriptors."""
    nodes = sorted(handler._this_node for handler in group)
    assert [info.rank for info in infos] == [nodes.index(h._this_node) for h in group]
    assert {info.world_size for info in infos} == {len(group)}
    assert len({handler._state_holder.state.round for handler in group}) == 1


def test_many_nodes_join_at_once_in_one_round(handlers: Handlers, pool: ThreadPoolExecutor):
    group = handlers(16, 16, 16)
    infos = [future.result(60) for future in join_in(pool, group)]
    _check_ranks(group, infos)
    state = _state(group[0])
    assert set(state.participants) == {h._this_node for h in group}
    assert state.complete
    assert not state.wait_list
    assert not state.redundancy_list
    # Every node announced itself: the keys of exactly these nodes.
    listed = [entry.node for entry in backend_of(group[0]).list_nodes()]
    assert sorted(listed) == sorted(h._this_node for h in group)


def test_min_nodes_complete_after_the_last_call(handlers: Handlers, pool: ThreadPoolExecutor):
    group = handlers(3, 2, 5, last_call_timeout=2)
    started = time.monotonic()
    infos = [future.result(60) for future in join_in(pool, group)]
    _check_ranks(group, infos)
    # Not complete before the last call (started when the second node was admitted).
    assert time.monotonic() - started >= 1.5


def test_max_nodes_complete_without_waiting_for_the_last_call(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    group = handlers(4, 2, 4, last_call_timeout=60)
    started = time.monotonic()
    infos = [future.result(60) for future in join_in(pool, group)]
    _check_ranks(group, infos)
    assert time.monotonic() - started < 30


def test_a_late_node_waits_for_the_next_round(handlers: Handlers, pool: ThreadPoolExecutor):
    members = handlers(2, 2, 3)
    first = [future.result(60) for future in join_in(pool, members)]
    _check_ranks(members, first)
    (late,) = handlers(1, 2, 3)
    joining = pool.submit(late.next_rendezvous)
    wait_until(lambda: members[0].num_nodes_waiting() == 1, timeout=30, what="a waiting node")
    assert _state(late).wait_list == {late._this_node}
    # The members re-rendezvous, as their agents do when a node waits.
    group = [*members, late]
    second = [future.result(60) for future in [*join_in(pool, members), joining]]
    _check_ranks(group, second)
    assert late._state_holder.state.round == members[0]._state_holder.state.round > 0


def _state_writes(
    handler: DynamicRendezvousHandler, after: int, until: int
) -> list[RendezvousState]:
    """Every version of the state written after etcd index ``after`` up to ``until``."""
    backend = backend_of(handler)
    versions, index = [], after
    while index < until:
        change = backend.connection.watch(backend.key, index + 1, Deadline(5))
        assert change is not None, "the state's history ended early"
        index = change.modified_index
        versions.append(decode_state(b64decode(change.value or ""), "the test"))
    return versions


def test_nodes_leaving_a_round_are_taken_out_in_batches(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    """A node joins a complete round of 12: the 12 leave it (PyTorch: one write each) and
    all 13 join the next round, in a few state writes."""
    members = handlers(12, 12, 13, keep_alive_interval=5)
    _check_ranks(members, [future.result(60) for future in join_in(pool, members)])
    (late,) = handlers(1, 12, 13, keep_alive_interval=5)
    joining = pool.submit(late.next_rendezvous)
    wait_until(lambda: members[0].num_nodes_waiting() == 1, timeout=30, what="a waiting node")
    before = backend_of(late).connection.get(backend_of(late).key).modified_index
    group = [*members, late]
    second = [future.result(60) for future in [*join_in(pool, members), joining]]
    _check_ranks(group, second)
    after = backend_of(late).connection.get(backend_of(late).key).modified_index
    versions = _state_writes(late, before, after)
    assert versions[-1].round == 1
    assert len(versions[-1].participants) == 13
    # A few writes: 2-3 measured. With PyTorch's exits, one write per member and then
    # the admissions: 17-20 measured.
    removed = [len(a.participants) - len(b.participants) for a, b in itertools.pairwise(versions)]
    assert len(versions) <= 6, (len(versions), removed)
    # Every member's key says it left round 0; the late node's says nothing.
    leaving = {e.node: e.leaving for e in backend_of(late).list_nodes()}
    assert leaving == {**{h._this_node: 0 for h in members}, late._this_node: None}


def test_nodes_waiting_beyond_max_nodes_do_not_restart_the_job_for_ever(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    """A round of 2 (max 3) completes; two late nodes wait for the next round. The
    members re-rendezvous, as their agents do when a node waits: the next round takes 3
    of the 4, and no node may be left on the wait list, or the agents (which restart
    whenever ``num_nodes_waiting()`` is positive, without counting it as a failure)
    re-rendezvous again, and again. A batch admitted the keys in created order, the
    members' first, so the youngest late node stayed on the wait list of every round:
    the job restarted for ever. The nodes that waited go first; a member left over goes
    to the redundancy list, as a node beyond ``max_nodes`` does."""
    members = handlers(2, 2, 3)
    _check_ranks(members, [future.result(60) for future in join_in(pool, members)])
    late = handlers(2, 2, 3)
    waiting = join_in(pool, late)
    wait_until(lambda: members[0].num_nodes_waiting() == 2, timeout=30, what="2 waiting nodes")
    group = [*members, *late]
    futures = [*join_in(pool, members), *waiting]
    wait_until(
        lambda: _state(members[0]).complete and len(_state(members[0]).participants) == 3,
        timeout=30,
        what="the next round complete with 3 nodes",
    )
    state = _state(members[0])
    assert not state.wait_list, "a node left waiting: the agents re-rendezvous again"
    assert len(state.redundancy_list) == 1
    assert set(late) <= {h for h in group if h._this_node in state.participants}
    joined = {h for h in group if h._this_node in state.participants}
    assert {f.result(60).world_size for h, f in zip(group, futures) if h in joined} == {3}
    assert all(h.num_nodes_waiting() == 0 for h in joined)
    members[0].set_closed()
    (spare,) = (f for h, f in zip(group, futures) if h not in joined)
    with pytest.raises(RendezvousGracefulExitError):
        spare.result(60)


def test_a_node_beyond_max_nodes_is_redundant_until_closed(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    members = handlers(2, 2, 2)
    _check_ranks(members, [future.result(60) for future in join_in(pool, members)])
    (extra,) = handlers(1, 2, 2)
    joining = pool.submit(extra.next_rendezvous)
    wait_until(
        lambda: _state(extra).redundancy_list == {extra._this_node},
        timeout=30,
        what="the extra node on the redundancy list",
    )
    assert members[0].num_nodes_waiting() == 0
    members[0].set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        joining.result(60)


def test_a_node_whose_key_expired_before_the_batch_is_not_admitted(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    group = handlers(4, 4, 4)
    # A node that announced itself and died before its admission: its key expires.
    dead = NodeDesc("dead-host", 1, 0)
    backend_of(group[0]).announce_node(dead, 1)
    wait_until(
        lambda: all(e.node != dead for e in backend_of(group[0]).list_nodes()),
        timeout=10,
        what="the dead node's key to expire",
    )
    started = time.monotonic()
    infos = [future.result(60) for future in join_in(pool, group)]
    assert time.monotonic() - started < ADMISSION_GRACE + 15
    _check_ranks(group, infos)
    assert dead not in _state(group[0]).last_heartbeats


def test_a_slow_oldest_node_is_admitted_by_the_next_one(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    """The oldest node gets stuck as it is about to make its batch (its listing of the
    keys does not return, as for a node starved of CPU): the next node admits it with
    everyone else, without waiting for it and without taking it for dead (its key is
    alive); once it gets going again, it finds itself admitted."""
    group = handlers(4, 4, 4, last_call_timeout=1)
    slow, others = group[0], group[1:]
    backend = backend_of(slow)
    stuck, release = threading.Event(), threading.Event()
    list_nodes = backend.list_nodes

    def slow_listing(deadline: Any = None) -> list[Any]:
        stuck.set()
        release.wait(60)
        return list_nodes(deadline)

    backend.list_nodes = slow_listing  # type: ignore[method-assign]
    futures = join_in(pool, [slow])
    wait_until(stuck.is_set, timeout=30, what="the oldest node to start its batch")
    started = time.monotonic()
    futures += join_in(pool, others)

    def complete() -> bool:
        result = backend_of(others[0]).get_state()
        return result is not None and decode_state(result[0], "the test").complete

    try:
        wait_until(complete, timeout=60, what="the round to complete")
        assert time.monotonic() - started < ADMISSION_GRACE + 5
        assert set(_state(others[0]).participants) == {h._this_node for h in group}
    finally:
        release.set()
    infos = [future.result(60) for future in futures]
    _check_ranks(group, infos)


@pytest.mark.parametrize("state_exists", [False, True], ids=["no-state-yet", "state"])
def test_a_batch_in_flight_does_not_admit_a_node_whose_join_timed_out(
    handlers: Handlers, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch, state_exists
):
    """A batch listed the keys while a node's key was alive, and its state write lands
    after that node's join timed out: the node deleted its key, then wrote the state (a
    create, or a compare-and-swap once a node was admitted before), so the batch's write
    fails and its maker lists the keys again. No round completes with a node that gave
    up (a phantom participant)."""
    size = 3 if state_exists else 2
    early = handlers(1, size, size) if state_exists else []
    (maker,) = handlers(1, size, size)
    (late,) = handlers(1, size, size, join_timeout=1)
    (third,) = handlers(1, size, size)
    # The late node waits for the maker's batch rather than making one itself (the
    # maker is stuck, as a node starved of CPU is): its turn as a candidate admitter, or
    # its grace for an older node, would come after its join timed out.
    stagger_wait = admission.stagger_wait

    def patient_late_node(created: int, *args: Any) -> float:
        if created == late._admission._created:
            return 60.0
        return stagger_wait(created, *args)

    monkeypatch.setattr(admission, "stagger_wait", patient_late_node)
    monkeypatch.setattr(admission, "ADMISSION_GRACE", 60.0)
    backend = backend_of(maker)
    entered, listed, release = threading.Event(), threading.Event(), threading.Event()
    list_nodes = backend.list_nodes

    def listing(deadline: Any = None) -> list[Any]:
        # The maker's first listing (its batch's) has the late node's key.
        if not listed.is_set():
            entered.set()
            wait_until(
                lambda: late._this_node in {e.node for e in list_nodes()},
                timeout=30,
                what="the late node's key",
            )
            entries = list_nodes(deadline)
            listed.set()
            return entries
        return list_nodes(deadline)

    def held(set_state: Callable[..., Any], after: threading.Event) -> Callable[..., Any]:
        def write(state: bytes, token: Any = None, *, deadline: Any = None) -> Any:
            if after.is_set():
                release.wait(60)
            return set_state(state, token, deadline=deadline)

        return write

    futures = join_in(pool, early)
    if early:
        wait_until(
            lambda: (
                backend.get_state() is not None
                and early[0]._this_node in _state(early[0]).participants
            ),
            timeout=30,
            what="a node admitted before",
        )
    # The batch's write is held until the late node gave up; so are the early node's
    # heartbeat folds, lest they fence off the batch instead.
    backend.list_nodes = listing  # type: ignore[method-assign]
    backend.set_state = held(backend.set_state, listed)  # type: ignore[method-assign]
    always = threading.Event()
    always.set()
    for node in early:
        backend_of(node).set_state = held(backend_of(node).set_state, always)  # type: ignore[method-assign]
    futures += join_in(pool, [maker])
    wait_until(entered.is_set, timeout=30, what="the maker's batch")
    (failed,) = join_in(pool, [late])
    wait_until(listed.is_set, timeout=30, what="a listing with the late node's key")
    with pytest.raises(RendezvousTimeoutError):
        failed.result(60)
    release.set()
    futures += join_in(pool, [third])
    assert futures[-2].result(60) is not None  # the maker's round
    assert late._this_node not in _state(maker).participants
    _check_ranks([*early, maker, third], [future.result(60) for future in futures])


def _aggregator(handler: DynamicRendezvousHandler) -> NodeDesc | None:
    return backend_of(handler).aggregator()


def test_the_aggregator_keeps_everyone_alive_and_a_killed_one_is_replaced(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    group = handlers(4, 3, 4, keep_alive_interval=1, keep_alive_max_attempt=3)
    infos = [future.result(60) for future in join_in(pool, group)]
    _check_ranks(group, infos)
    wait_until(lambda: _aggregator(group[0]) is not None, timeout=10, what="an aggregator")
    holder = _aggregator(group[0])
    (victim,) = [h for h in group if h._this_node == holder]
    survivors = [h for h in group if h is not victim]
    # Killed: its heartbeats stop, its key and the lock stay until they expire.
    victim._stop_heartbeats()
    wait_until(
        lambda: _aggregator(group[0]) not in (None, holder),
        timeout=15,
        what="another aggregator",
    )
    # The victim's key lapses (3 s), then its heartbeat in the state (3 s more); every
    # version of the state until then still has the survivors.
    backend = backend_of(group[0])
    for node in each_version(backend.connection, backend.key, 20):
        state = decode_state(b64decode(node.value or ""), "the test")
        assert all(h._this_node in state.participants for h in survivors), state.participants
        if victim._this_node not in state.participants:
            break
    state = _state(group[0])
    assert {h._this_node for h in survivors} <= set(state.last_heartbeats)
    # Its fellows learn of it and rendezvous again without it.
    regrouped = [future.result(60) for future in join_in(pool, survivors)]
    _check_ranks(survivors, regrouped)


def test_when_the_aggregator_dies_no_heartbeat_gets_older_than_pytorchs_would(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    # A PyTorch node looks at its heartbeat every interval and writes it once it is an
    # interval old, so it is at most two intervals old when written: the margin to the
    # expiry (keep_alive_max_attempt intervals) that a node whose clock is ahead, or an
    # etcd election, eats into. Ours must keep at least that margin when nobody folds.
    interval = 2.0
    group = handlers(4, 4, 4, keep_alive_interval=int(interval), keep_alive_max_attempt=3)
    _check_ranks(group, [future.result(60) for future in join_in(pool, group)])
    wait_until(lambda: _aggregator(group[0]) is not None, timeout=20, what="an aggregator")
    holder = _aggregator(group[0])
    (victim,) = [h for h in group if h._this_node == holder]
    survivors = [h for h in group if h is not victim]
    backend = backend_of(group[0])
    # The aggregator dies right after a fold (a version with every heartbeat the same),
    # one seen early enough to place the survivors' phase after it.
    clock = survivors[0]._state_holder.clock  # etcd's, as the node estimates it
    phase = 0.375 * interval
    for seen, node in enumerate(each_version(backend.connection, backend.key, 30)):
        state = decode_state(b64decode(node.value or ""), "the test")
        beats = set(state.last_heartbeats.values())
        if seen and len(beats) == 1 and (clock.now() - min(beats)).total_seconds() < phase:
            break
    victim._stop_heartbeats()  # Killed: its lock stays until it lapses.
    # The survivors' keep-alive threads start over 0.375 intervals after that fold: a
    # node that looked at its heartbeat only every interval would find it late but not
    # due (1.5 intervals) one interval later, and write it only the interval after
    # (2.375 intervals old). A deliberate phase, not a wait.
    for handler in survivors:
        handler._stop_heartbeats()
    time.sleep(max(phase - (clock.now() - min(beats)).total_seconds(), 0.0))
    for handler in survivors:
        handler._start_heartbeats()
    written_by: dict[NodeDesc, list[float]] = {h._this_node: [] for h in survivors}
    replaced_at = None
    for node in each_version(backend.connection, node.key, 30):
        state = decode_state(b64decode(node.value or ""), "the test")
        assert set(written_by) <= set(state.participants), state.participants
        for survivor, written in written_by.items():
            beat = state.last_heartbeats[survivor].timestamp()
            if not written or written[-1] != beat:
                written.append(beat)
        if replaced_at is None and _aggregator(group[0]) not in (None, holder):
            replaced_at = time.monotonic()
        if replaced_at is not None and time.monotonic() - replaced_at > 2 * interval:
            break
    # The times are etcd's, as the nodes estimate it: within a round trip or so.
    slack = 0.3
    for survivor, written in written_by.items():
        gaps = [later - earlier for earlier, later in itertools.pairwise(written)]
        assert gaps, f"{survivor}: no heartbeat written after the aggregator died"
        assert max(gaps) <= 2 * interval + slack, f"{survivor}: heartbeats {written}"


def test_steady_heartbeats_do_not_write_the_state_per_node(
    handlers: Handlers, pool: ThreadPoolExecutor
):
    group = handlers(6, 6, 6, keep_alive_interval=1, keep_alive_max_attempt=3)
    _check_ranks(group, [future.result(60) for future in join_in(pool, group)])
    wait_until(lambda: _aggregator(group[0]) is not None, timeout=10, what="an aggregator")
    first = backend_of(group[0]).connection.get(backend_of(group[0]).key).modified_index
    conn = backend_of(group[0]).connection
    writes = 0
    index = first
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        change = conn.watch(
            backend_of(group[0]).key, index + 1, Deadline(deadline - time.monotonic())
        )
        if change is not None:
            writes += 1
            index = change.modified_index
    # About one fold per interval (6 s), not one write per node and interval (36).
    assert writes <= 12, writes
    state = _state(group[0])
    assert {h._this_node for h in group} == set(state.participants)


# -- a mixed fleet ----------------------------------------------------------------------------


def _torch_handlers(
    etcd_server: EtcdServer, run_id: str, count: int, size: int, max_nodes: int | None = None
) -> list[Any]:
    """PyTorch 2.13's handlers (its etcd-v2 backend), on another address than ours so
    that the node descriptors of the two generators in this process differ."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    made = []
    for _ in range(count):
        params = TorchParameters(
            "etcd-v2",
            etcd_server.get_endpoint(),
            run_id,
            size,
            max_nodes or size,
            local_addr="127.0.0.2",
            join_timeout=60,
            last_call_timeout=1,
            close_timeout=10,
            keep_alive_interval=1,
            keep_alive_max_attempt=3,
            read_timeout=10,
        )
        backend, store = create_backend(params)
        made.append(create_handler(store, backend, params))
    return made


@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")
def test_a_mixed_fleet_rendezvous_and_keeps_each_other_alive(
    etcd_server: EtcdServer, run_id: str, handlers: Handlers, pool: ThreadPoolExecutor
):
    pytest.importorskip("torch.distributed.elastic.rendezvous.etcd_rendezvous_backend")
    ours = handlers(4, 8, 8, keep_alive_interval=1, keep_alive_max_attempt=3)
    theirs = _torch_handlers(etcd_server, run_id, 4, 8)
    try:
        group = [node for pair in zip(ours, theirs) for node in pair]
        infos = [future.result(60) for future in join_in(pool, group)]
        nodes = [(h._this_node.addr, h._this_node.pid, h._this_node.local_id) for h in group]
        assert [info.rank for info in infos] == [sorted(nodes).index(n) for n in nodes]
        assert {info.world_size for info in infos} == {8}
        rounds = {h._state_holder.state.round for h in group}
        assert len(rounds) == 1
        # Three times PyTorch's expiry (keep_alive_interval * keep_alive_max_attempt):
        # our nodes' heartbeats come from our aggregator, PyTorch's from PyTorch's nodes,
        # and neither side drops the other's nodes in any version of the state.
        backend = backend_of(ours[0])
        node = backend.connection.get(backend.key)
        deadline = time.monotonic() + 9
        while time.monotonic() < deadline:
            state = decode_state(b64decode(node.value or ""), "the test")
            assert len(state.participants) == 8, state.participants
            assert state.round in rounds
            change = backend.connection.watch(
                backend.key, node.modified_index + 1, Deadline(deadline - time.monotonic())
            )
            node = change if change is not None else node
        assert ours[0].num_nodes_waiting() == 0
    finally:
        for handler in theirs:
            handler._stop_heartbeats()


@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")
def test_a_mixed_fleet_leaves_a_round_together(
    etcd_server: EtcdServer, run_id: str, handlers: Handlers, pool: ThreadPoolExecutor
):
    """Our nodes leave a round in batches, PyTorch's by themselves: a late node makes a
    mixed round of 8 rendezvous again, and all 9 form the next round."""
    pytest.importorskip("torch.distributed.elastic.rendezvous.etcd_rendezvous_backend")
    ours = handlers(4, 8, 9, keep_alive_interval=1, keep_alive_max_attempt=3)
    theirs = _torch_handlers(etcd_server, run_id, 4, 8, 9)
    try:
        members = [node for pair in zip(ours, theirs) for node in pair]
        assert {f.result(60).world_size for f in join_in(pool, members)} == {8}
        (late,) = handlers(1, 8, 9, keep_alive_interval=1, keep_alive_max_attempt=3)
        joining = pool.submit(late.next_rendezvous)
        wait_until(lambda: ours[0].num_nodes_waiting() == 1, timeout=30, what="a waiting node")
        group = [*members, late]
        infos = [future.result(60) for future in [*join_in(pool, members), joining]]
        nodes = [(h._this_node.addr, h._this_node.pid, h._this_node.local_id) for h in group]
        assert [info.rank for info in infos] == [sorted(nodes).index(n) for n in nodes]
        assert {info.world_size for info in infos} == {9}
        assert len({h._state_holder.state.round for h in group}) == 1
        # Our members asked to leave through their keys; PyTorch's left by themselves.
        leaving = {e.node: e.leaving for e in backend_of(late).list_nodes()}
        assert leaving == {**{h._this_node: 0 for h in ours}, late._this_node: None}
    finally:
        for handler in theirs:
            handler._stop_heartbeats()
