"""Rendezvous events: the callback hook, the log, and the hand-over to PyTorch's events."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from etcd_rendezvous import events
from etcd_rendezvous._dynamic.executor import OpExecutor
from etcd_rendezvous._dynamic.holder import BackendStateHolder
from etcd_rendezvous.api import RendezvousClosedError, RendezvousParameters
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from etcd_rendezvous.events import NodeState, RdzvEvent
from support.events import EventLog, torch_event_destination
from unit.test_dynamic_rendezvous import DictStore, MemoryBackend

_NEEDS_TORCH = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="PyTorch is not installed"
)


def _record_from_a_function(**kwargs: object) -> None:
    events.record_rdzv_event(run_id="run-1", message="hello", **kwargs)  # type: ignore[arg-type]


def test_a_callback_receives_the_event_named_after_the_recording_file_and_function(
    received: list[RdzvEvent],
) -> None:
    _record_from_a_function(node_state=NodeState.RUNNING, rank=3)

    (event,) = received
    assert event.name == "test_events.py:_record_from_a_function"
    assert (event.run_id, event.message, event.node_state) == ("run-1", "hello", NodeState.RUNNING)
    assert (event.rank, event.local_id, event.master_endpoint) == (3, None, "")
    # As in PyTorch: the process and the host fill in what the recorder left out.
    assert event.pid == os.getpid()
    assert event.hostname
    assert event.error_trace == ""


def test_an_explicit_name_and_node_are_kept(received: list[RdzvEvent]) -> None:
    events.record_rdzv_event(
        run_id="run-1",
        message="m",
        node_state=NodeState.SUCCEEDED,
        name="Cls.method",
        hostname="node-a",
        pid=42,
        local_id=7,
    )

    (event,) = received
    assert (event.name, event.hostname, event.pid, event.local_id) == (
        "test_events.py:Cls.method",
        "node-a",
        42,
        7,
    )


def test_a_file_name_replaces_the_callers(received: list[RdzvEvent]) -> None:
    _record_from_a_function(node_state=NodeState.RUNNING, file_name="dynamic_rendezvous.py")

    (event,) = received
    assert event.name == "dynamic_rendezvous.py:_record_from_a_function"


def test_a_failed_event_carries_the_traceback_being_handled(received: list[RdzvEvent]) -> None:
    try:
        raise RendezvousClosedError("closed for the test")
    except RendezvousClosedError:
        _record_from_a_function(node_state=NodeState.FAILED)

    assert "RendezvousClosedError: closed for the test" in received[0].error_trace


def test_a_raising_callback_is_logged_and_the_others_still_run(
    received: list[RdzvEvent], caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: RdzvEvent) -> None:
        raise RuntimeError("callback bug")

    after: list[RdzvEvent] = []
    events.add_event_handler(broken)
    events.add_event_handler(after.append)
    try:
        with caplog.at_level(logging.WARNING, logger="etcd_rendezvous.events"):
            _record_from_a_function(node_state=NodeState.RUNNING)
    finally:
        events.remove_event_handler(broken)
        events.remove_event_handler(after.append)

    assert len(received) == len(after) == 1
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "broken" in warning.getMessage()
    assert warning.exc_info is not None
    assert "callback bug" in str(warning.exc_info[1])


def test_removed_callbacks_are_not_called_and_removing_twice_names_the_handler() -> None:
    seen: list[RdzvEvent] = []
    events.add_event_handler(seen.append)
    events.remove_event_handler(seen.append)
    _record_from_a_function(node_state=NodeState.RUNNING)

    assert seen == []
    with pytest.raises(ValueError, match=r"handler: .* is not a registered event handler"):
        events.remove_event_handler(seen.append)


def test_events_are_logged_at_debug_as_json(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="etcd_rendezvous.events"):
        _record_from_a_function(node_state=NodeState.RUNNING, rank=1)

    (record,) = [r for r in caplog.records if r.name == "etcd_rendezvous.events"]
    logged = json.loads(record.getMessage().split(": ", 1)[1])
    assert logged["name"] == "test_events.py:_record_from_a_function"
    assert (logged["node_state"], logged["rank"]) == ("RUNNING", 1)


def test_the_dynamic_handler_records_pytorchs_events_in_order(
    received: list[RdzvEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    backend, store = MemoryBackend(), DictStore()
    # Renaming our private classes cannot rename PyTorch's events.
    private = {c: c.__name__ for c in (OpExecutor, BackendStateHolder)}
    for cls in private:
        cls.__name__ = "Renamed"
    try:
        handler = DynamicRendezvousHandler.from_backend(
            "run-1", store, backend, 1, 1, "127.0.0.1", keep_alive_interval=60
        )
        late = DynamicRendezvousHandler.from_backend(
            "run-1", store, backend, 1, 1, "127.0.0.1", keep_alive_interval=60
        )
        try:
            assert handler.next_rendezvous().rank == 0
            assert handler.shutdown()
            with pytest.raises(RendezvousClosedError):
                late.next_rendezvous()
        finally:
            handler.close()
            late.close()
    finally:
        for cls, name in private.items():
            cls.__name__ = name

    ours = [(e.name.split(":", 1)[1], e.node_state, e.rank) for e in received]
    running, succeeded, failed = NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED
    assert ours == [
        ("DynamicRendezvousHandler.next_rendezvous", running, None),
        ("_DistributedRendezvousOpExecutor._add_to_participants", running, None),
        ("_DistributedRendezvousOpExecutor._keep_alive", running, None),
        ("_DistributedRendezvousOpExecutor._mark_rendezvous_complete", succeeded, None),
        ("_DistributedRendezvousOpExecutor.run", running, None),
        ("DynamicRendezvousHandler.next_rendezvous", running, 0),
        ("_DistributedRendezvousOpExecutor._mark_rendezvous_closed", succeeded, None),
        ("_DistributedRendezvousOpExecutor.run", running, None),
        ("DynamicRendezvousHandler._close", succeeded, None),
        ("DynamicRendezvousHandler.next_rendezvous", running, None),
        ("DynamicRendezvousHandler.next_rendezvous", failed, None),
    ]
    assert {e.name.split(":", 1)[0] for e in received} == {"dynamic_rendezvous.py"}
    assert {e.run_id for e in received} == {"run-1"}
    assert {e.hostname for e in received} == {"127.0.0.1"}
    joined = received[5]
    assert "has joined round 0 of the rendezvous 'run-1' as rank 0 in a world of size 1" in (
        joined.message
    )
    assert received[-1].message.startswith("RendezvousClosedError")
    assert "RendezvousClosedError" in received[-1].error_trace


def test_a_handler_that_cannot_be_created_records_pytorchs_event(
    received: list[RdzvEvent],
) -> None:
    params = RendezvousParameters("etcd-v2", "h:1", "run-1", 1, 1, join_timeout="soon")
    with pytest.raises(ValueError, match="join_timeout"):
        create_handler(DictStore(), MemoryBackend(), params)
    ((name, state, run_id),) = [(e.name, e.node_state, e.run_id) for e in received]
    assert (name, state, run_id) == (
        "dynamic_rendezvous.py:create_handler",
        NodeState.FAILED,
        "run-1",
    )


def test_recording_imports_no_pytorch() -> None:
    """Without PyTorch loaded, events reach the callbacks and PyTorch stays unimported."""
    script = textwrap.dedent(
        """
        import sys
        from etcd_rendezvous import dynamic_rendezvous, etcd_rendezvous, events
        seen = []
        events.add_event_handler(seen.append)
        events.record_rdzv_event("run", "message", events.NodeState.RUNNING)
        assert len(seen) == 1, seen
        print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- the hand-over to PyTorch ----------------------------------------------------------------


@_NEEDS_TORCH
def test_an_event_reaches_pytorchs_destination_exactly_as_pytorch_records_it() -> None:
    from torch.distributed.elastic.events import NodeState as TorchNodeState
    from torch.distributed.elastic.events import construct_and_record_rdzv_event

    log = EventLog()
    with torch_event_destination(log):
        for record, state in [
            (events.record_rdzv_event, NodeState.RUNNING),
            (construct_and_record_rdzv_event, TorchNodeState.RUNNING),
        ]:
            record(
                run_id="run-1",
                message="joined",
                node_state=state,  # type: ignore[arg-type]
                name="DynamicRendezvousHandler.next_rendezvous",
                hostname="127.0.0.1",
                pid=1234,
                local_id=0,
                rank=1,
            )

    ours, theirs = log.events()
    assert ours == theirs
    assert ours["name"] == "test_events.py:DynamicRendezvousHandler.next_rendezvous"


@_NEEDS_TORCH
def test_pytorchs_default_destination_drops_the_event_but_callbacks_get_it(
    received: list[RdzvEvent],
) -> None:
    import torch.distributed.elastic.events as torch_events

    torch_events._events_loggers.pop("dynamic_rendezvous", None)
    _record_from_a_function(node_state=NodeState.RUNNING)

    assert len(received) == 1
    # PyTorch's shortcut for its NullHandler: no event logger was even created.
    assert "dynamic_rendezvous" not in torch_events._events_loggers


@_NEEDS_TORCH
def test_a_raising_pytorch_event_handler_does_not_break_recording(
    received: list[RdzvEvent], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise RuntimeError("agent handler bug")

    destination = torch_event_destination(Broken())
    with destination, caplog.at_level(logging.WARNING, logger="etcd_rendezvous.events"):
        _record_from_a_function(node_state=NodeState.RUNNING)

    assert len(received) == 1
    assert any("agent handler bug" in str(r.exc_info and r.exc_info[1]) for r in caplog.records)


def test_an_event_serializes_as_pytorchs_json() -> None:
    event = RdzvEvent("n", "r", "m", "h", 1, NodeState.FAILED, rank=2, error_trace="tb")
    assert json.loads(event.serialize()) == {
        "name": "n",
        "run_id": "r",
        "message": "m",
        "hostname": "h",
        "pid": 1,
        "node_state": "FAILED",
        "master_endpoint": "",
        "rank": 2,
        "local_id": None,
        "error_trace": "tb",
    }
    assert str(event) == event.serialize()
