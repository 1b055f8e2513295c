"""Rendezvous events of real runs against etcd: the legacy backend's phase changes, and the
dynamic handler's events next to PyTorch 2.13's for the same scenario."""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousClosedError, RendezvousParameters, RendezvousTimeoutError
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler, create_rdzv_handler
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.events import NodeState, RdzvEvent
from support.events import EventLog, torch_event_destination
from support.wait import wait_until

_NEEDS_TORCH = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="PyTorch is not installed"
)

RUNNING, SUCCEEDED, FAILED = NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED


def _legacy(etcd_server: EtcdServer, run_id: str, lo: int, hi: int, **kw: Any) -> Any:
    params = RendezvousParameters(
        backend="etcd",
        endpoint=etcd_server.get_endpoint(),
        run_id=run_id,
        min_nodes=lo,
        max_nodes=hi,
        local_addr="127.0.0.1",
        read_timeout=5,
        last_call_timeout=1,
        **kw,
    )
    return create_rdzv_handler(params)


def _legacy_events(received: list[RdzvEvent], run_id: str) -> Counter[tuple[str, str, Any]]:
    """``(method, node state, rank)`` of the legacy events of ``run_id``, counted."""
    prefix = "etcd_rendezvous.py:EtcdRendezvous."
    of_run = [e for e in received if e.run_id == run_id]
    assert all(e.name.startswith(prefix) for e in of_run), of_run
    return Counter((e.name[len(prefix) :], e.node_state.value, e.rank) for e in of_run)


def test_legacy_backend_reports_its_phase_changes(
    etcd_server: EtcdServer, run_id: str, conn: Transport, received: list[RdzvEvent]
) -> None:
    members = [_legacy(etcd_server, run_id, 2, 2, timeout=30) for _ in range(2)]
    late = _legacy(etcd_server, run_id, 1, 2, timeout=30)
    closed_out = _legacy(etcd_server, run_id, 1, 2, timeout=30)
    handlers: list[EtcdRendezvousHandler] = [*members, late, closed_out]
    try:
        with ThreadPoolExecutor(3) as pool:
            ranks = [info.rank for info in pool.map(lambda h: h.next_rendezvous(), members)]
            assert sorted(ranks) == [0, 1]
            # A late worker waits on the final version 1 until a member's keep-alive lapses
            # (here: the member stops renewing it and the key is deleted), then starts
            # version 2 alone.
            rejoined = pool.submit(late.next_rendezvous)
            wait_until(
                lambda: any(e.name.endswith(".handle_existing_rendezvous") for e in received),
                what="the late worker waiting",
            )
            leaving = members[ranks.index(1)].rendezvous
            keep_alive = leaving._lease_this_rank
            assert keep_alive is not None
            leaving.close()
            conn.delete(keep_alive.key)
            info = rejoined.result(timeout=30)
        assert (info.rank, info.world_size) == (0, 1)
        late.set_closed()
        with pytest.raises(RendezvousClosedError):
            closed_out.next_rendezvous()
    finally:
        for handler in handlers:
            handler.close()

    assert _legacy_events(received, run_id) == Counter(
        {
            ("rendezvous_barrier", "RUNNING", None): 4,
            ("join_phase", "RUNNING", 0): 2,  # a member, then the late worker in version 2
            ("join_phase", "RUNNING", 1): 1,
            ("confirm_phase", "SUCCEEDED", 0): 2,
            ("confirm_phase", "SUCCEEDED", 1): 1,
            ("handle_existing_rendezvous", "RUNNING", None): 1,
            ("wait_for_rendezvous_to_free", "RUNNING", None): 1,
            ("set_closed", "SUCCEEDED", None): 1,
            ("rendezvous_barrier", "FAILED", None): 1,
        }
    )
    messages = {e.name.rsplit(".", 1)[1]: e.message for e in received if e.run_id == run_id}
    assert f"{keep_alive.key} lapsed" in messages["wait_for_rendezvous_to_free"]
    assert messages["rendezvous_barrier"].startswith("RendezvousClosedError: ")
    last_complete = [e for e in received if e.name.endswith(".confirm_phase")][-1]
    assert f"Version 2 of the rendezvous of run '{run_id}' is complete" in last_complete.message


def test_legacy_backend_reports_a_timeout(
    etcd_server: EtcdServer, run_id: str, received: list[RdzvEvent]
) -> None:
    handler = _legacy(etcd_server, run_id, 2, 2, timeout=1)
    with handler, pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()

    assert _legacy_events(received, run_id) == Counter(
        {
            ("rendezvous_barrier", "RUNNING", None): 1,
            ("join_phase", "RUNNING", 0): 1,
            ("rendezvous_barrier", "FAILED", None): 1,
        }
    )
    (failure,) = [e for e in received if e.node_state == FAILED]
    assert failure.message.startswith(f"RendezvousTimeoutError: The rendezvous of run '{run_id}'")
    assert "RendezvousTimeoutError" in failure.error_trace


# -- the dynamic handler next to PyTorch's ----------------------------------------------------

_DYNAMIC_CONFIG = {
    "join_timeout": 30,
    "last_call_timeout": 1,
    "close_timeout": 10,
    # No heartbeat falls due during the test: the events are those of the scenario only.
    "keep_alive_interval": 60,
    "keep_alive_max_attempt": 3,
    "read_timeout": 10,
}


def _ours(etcd_server: EtcdServer, run_id: str) -> Any:
    from etcd_rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        "etcd-v2",
        etcd_server.get_endpoint(),
        run_id,
        2,
        2,
        local_addr="127.0.0.1",
        torch_store="false",
        **_DYNAMIC_CONFIG,
    )
    return get_rendezvous_handler(params)


def _pytorchs(etcd_server: EtcdServer, run_id: str) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    params = TorchParameters(
        "etcd-v2",
        etcd_server.get_endpoint(),
        run_id,
        2,
        2,
        local_addr="127.0.0.1",
        **_DYNAMIC_CONFIG,
    )
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def _two_join_one_closes_one_is_turned_away(
    make: Callable[[], Any], log: EventLog, run_id: str
) -> dict[str, Any]:
    """Node a joins, then b (the round completes), a closes, c is refused.

    Sequenced, so that no write race makes one implementation retry where the other
    does not. Returns the handlers by role.
    """
    nodes = {"a": make(), "b": make()}
    try:
        with ThreadPoolExecutor(1) as pool:
            joined_a = pool.submit(nodes["a"].next_rendezvous)
            wait_until(
                lambda: any("successfully synced" in e["message"] for e in log.events(run_id)),
                what="node a in the rendezvous",
            )
            assert nodes["b"].next_rendezvous().rank == 1
            assert joined_a.result(timeout=30).rank == 0
        assert nodes["a"].shutdown()
        nodes["c"] = make()
        with pytest.raises(Exception) as refused:  # PyTorch's class or ours
            nodes["c"].next_rendezvous()
        assert type(refused.value).__name__ == "RendezvousClosedError"
    finally:
        for node in nodes.values():
            node._stop_heartbeats()
    return nodes


def _comparable(events: list[dict[str, Any]], nodes: dict[str, Any], run_id: str) -> Counter[Any]:
    """The events with node names and the run id replaced by their roles, counted. Of a
    failure, only the exception type is compared (PyTorch's errors carry no message)."""

    def neutral(message: str) -> str:
        for role, node in nodes.items():
            message = message.replace(repr(node._this_node), f"<{role}>")
        return message.replace(run_id, "<run>")

    return Counter(
        (
            e["name"],
            e["node_state"],
            e["rank"],
            e["message"].split(":")[0] if e["node_state"] == "FAILED" else neutral(e["message"]),
        )
        for e in events
    )


@_NEEDS_TORCH
@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend talks to etcd through python-etcd")
def test_dynamic_handler_records_the_events_pytorchs_handler_records(
    etcd_server: EtcdServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    log = EventLog()
    with torch_event_destination(log):
        # Both go through PyTorch's event system: ours by the hand-over of etcd_rendezvous.events.
        our_run, their_run = f"{run_id}-ours", f"{run_id}-torch"
        ours = _two_join_one_closes_one_is_turned_away(
            lambda: _ours(etcd_server, our_run), log, our_run
        )
        theirs = _two_join_one_closes_one_is_turned_away(
            lambda: _pytorchs(etcd_server, their_run), log, their_run
        )

    our_events, their_events = log.events(our_run), log.events(their_run)
    assert _comparable(our_events, ours, our_run) == _comparable(their_events, theirs, their_run)
    handler, executor = "DynamicRendezvousHandler", "_DistributedRendezvousOpExecutor"
    assert Counter((e["name"], e["node_state"], e["rank"]) for e in our_events) == Counter(
        {
            (f"dynamic_rendezvous.py:{handler}.next_rendezvous", "RUNNING", None): 3,
            (f"dynamic_rendezvous.py:{handler}.next_rendezvous", "RUNNING", 0): 1,
            (f"dynamic_rendezvous.py:{handler}.next_rendezvous", "RUNNING", 1): 1,
            (f"dynamic_rendezvous.py:{handler}.next_rendezvous", "FAILED", None): 1,
            (f"dynamic_rendezvous.py:{executor}._add_to_participants", "RUNNING", None): 2,
            (f"dynamic_rendezvous.py:{executor}._keep_alive", "RUNNING", None): 2,
            (f"dynamic_rendezvous.py:{executor}._mark_rendezvous_complete", "SUCCEEDED", None): 1,
            (f"dynamic_rendezvous.py:{executor}.run", "RUNNING", None): 3,
            (f"dynamic_rendezvous.py:{executor}._mark_rendezvous_closed", "SUCCEEDED", None): 1,
            (f"dynamic_rendezvous.py:{handler}._close", "SUCCEEDED", None): 1,
        }
    )
    assert {(e["hostname"], e["pid"]) for e in our_events} == {("127.0.0.1", os.getpid())}
    local_ids = {node._this_node.local_id for node in ours.values()}
    assert {e["local_id"] for e in our_events} == local_ids
