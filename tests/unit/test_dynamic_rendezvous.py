"""The dynamic rendezvous state machine, with in-memory backends and stores.

Ports the relevant cases of PyTorch's ``dynamic_rendezvous_test.py`` (state holder,
operation executor, the operations) and adds handler-level scenarios run with threads:
several nodes, late and redundant nodes, close, dead-node removal, heartbeats.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from etcd_rendezvous import dynamic_rendezvous as dr
from etcd_rendezvous._dynamic import handler as _dynamic_handler
from etcd_rendezvous._dynamic import settings as _dynamic_settings
from etcd_rendezvous._dynamic.admission import CHANGED, Admission
from etcd_rendezvous._dynamic.executor import OpExecutor
from etcd_rendezvous._dynamic.holder import BackendStateHolder, StateHolder
from etcd_rendezvous._dynamic.ops import (
    Action,
    CloseOp,
    Context,
    ExitOp,
    JoinOp,
    KeepAliveOp,
)
from etcd_rendezvous._dynamic.prefix_store import PrefixStore, prefix_store
from etcd_rendezvous._dynamic.state import (
    _encode_state,
    _NodeDesc,
    _NodeDescGenerator,
    _RendezvousState,
)
from etcd_rendezvous._transport.clock import ServerClock
from etcd_rendezvous._transport.retry import Deadline
from etcd_rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from etcd_rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
)
from etcd_rendezvous.events import RdzvEvent, add_event_handler, remove_event_handler
from support.wait import wait_until

from .test_dynamic_admission import BoardRegistry, Clock, MemoryRegistry

NOW = datetime(2000, 1, 1, tzinfo=timezone.utc)
ME = _NodeDesc("this_node", 1, 1)


# -- fakes ------------------------------------------------------------------------------------


class FixedClock:
    """The clock of the state's times (see :mod:`etcd_rendezvous._dynamic.clock`),
    standing at ``at`` until a test moves it."""

    def __init__(self, at: datetime = NOW) -> None:
        self.at = at

    def now(self) -> datetime:
        return self.at


class MemoryBackend(RendezvousBackend):
    """A thread-safe in-memory backend with integer tokens and a watch.

    ``failures`` holds exceptions raised by the next calls to get/set_state.
    """

    def __init__(self, key: str | None = None) -> None:
        self._cond = threading.Condition()
        self._state: bytes | None = None
        self._token = 0
        self._key = key
        self.failures: list[Exception] = []
        self.calls: dict[str, int] = {"get": 0, "set": 0, "wait": 0}
        self.writes: list[tuple[float, _RendezvousState]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def state_key(self) -> str | None:
        return self._key

    def _maybe_fail(self) -> None:
        if self.failures:
            raise self.failures.pop(0)

    def get_state(self) -> tuple[bytes, Any] | None:
        with self._cond:
            self.calls["get"] += 1
            self._maybe_fail()
            if self._state is None:
                return None
            return self._state, self._token

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        with self._cond:
            self.calls["set"] += 1
            self._maybe_fail()
            if (token or 0) != self._token:
                assert self._state is not None
                return self._state, self._token, False
            self._state = state
            self._token += 1
            self.writes.append((time.monotonic(), dr.decode_state(state, "memory")))
            self._cond.notify_all()
            return state, self._token, True

    def wait_for_change(self, token: Any, timeout: float) -> None:
        with self._cond:
            self.calls["wait"] += 1
            self._cond.wait_for(lambda: self._token != (token or 0), timeout)

    # Test helpers.
    def load(self) -> _RendezvousState:
        with self._cond:
            assert self._state is not None
            return dr.decode_state(self._state, "memory")

    def store(self, state: _RendezvousState) -> None:
        with self._cond:
            self._state = _encode_state(state)
            self._token += 1
            self._cond.notify_all()

    def corrupt(self, data: bytes = b"corrupt_state") -> None:
        with self._cond:
            self._state = data
            self._token += 1


class PollingBackend(MemoryBackend):
    """A backend without a watch: uses :class:`RendezvousBackend`'s default wait."""

    def wait_for_change(self, token: Any, timeout: float) -> None:
        self.calls["wait"] += 1
        RendezvousBackend.wait_for_change(self, token, timeout)


class DictStore:
    """In-memory c10d-like store shared by all the nodes of a test; ``get`` waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        with self._cond:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self.data, 10):
                raise TimeoutError(key)
            return self.data[key]

    def add(self, key: str, value: int) -> int:
        with self._cond:
            total = int(self.data.get(key, b"0")) + value
            self.data[key] = str(total).encode()
            self._cond.notify_all()
            return total

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: all(k in self.data for k in keys), 10):
                raise TimeoutError(keys)

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self.data for k in keys)


def make_settings(
    min_nodes: int = 1,
    max_nodes: int = 1,
    *,
    interval: timedelta = timedelta(seconds=30),
    attempts: int = 3,
    timeout: RendezvousTimeout | None = None,
    run_id: str = "dummy_run_id",
) -> RendezvousSettings:
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        timeout=timeout or RendezvousTimeout(),
        keep_alive_interval=interval,
        keep_alive_max_attempt=attempts,
    )


@pytest.fixture(autouse=True)
def _no_shared_tcp_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most handler tests exercise the torch-free bootstrap (no TCPStore server)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


# -- settings and node descriptors ----------------------------------------------------------


def test_the_private_modules_log_and_name_events_as_this_module() -> None:
    assert dr.__name__ == _dynamic_settings.LOGGER_NAME
    assert os.path.basename(dr.__file__) == _dynamic_settings.EVENT_FILE


def test_timeout_keeps_given_values() -> None:
    timeout = RendezvousTimeout(
        timedelta(seconds=50), timedelta(seconds=60), timedelta(seconds=70), timedelta(seconds=80)
    )
    assert (timeout.join, timeout.last_call, timeout.close, timeout.heartbeat) == (
        timedelta(seconds=50),
        timedelta(seconds=60),
        timedelta(seconds=70),
        timedelta(seconds=80),
    )


def test_timeout_defaults() -> None:
    timeout = RendezvousTimeout()
    assert (timeout.join, timeout.last_call, timeout.close, timeout.heartbeat) == (
        timedelta(seconds=600),
        timedelta(seconds=30),
        timedelta(seconds=30),
        timedelta(seconds=5),
    )


@pytest.mark.parametrize("join", [timedelta(seconds=0), timedelta(seconds=-1)])
def test_timeout_must_be_positive(join: timedelta) -> None:
    with pytest.raises(ValueError, match=rf"^The join timeout \({join}\) must be positive.$"):
        RendezvousTimeout(join)


def test_node_desc_repr_hash_and_order() -> None:
    a, b = _NodeDesc("dummy_fqdn", 2, 4), _NodeDesc("dummy_fqdn", 3, 5)
    assert repr(b) == "dummy_fqdn_3_5"
    assert {a, b} == {_NodeDesc("dummy_fqdn", 2, 4), _NodeDesc("dummy_fqdn", 3, 5)}
    assert sorted([b, a]) == [a, b]


def test_node_desc_generator_counts_per_process() -> None:
    import socket

    generator = _NodeDescGenerator()
    for local_id in range(4):
        assert repr(generator.generate()) == f"{socket.getfqdn()}_{os.getpid()}_{local_id}"
    assert generator.generate("given-addr").addr == "given-addr"


# -- BackendStateHolder ------------------------------------------------------------


def full_state() -> _RendezvousState:
    state = _RendezvousState()
    state.round = 999
    state.complete = True
    state.deadline = NOW
    state.closed = True
    state.participants = {
        _NodeDesc("dummy1", 1, 1): 0,
        _NodeDesc("dummy2", 1, 1): 1,
        _NodeDesc("dummy3", 1, 1): 2,
    }
    state.wait_list = {_NodeDesc("dummy4", 1, 1), _NodeDesc("dummy5", 1, 1)}
    state.last_heartbeats = {
        _NodeDesc("dummy1", 1, 1): NOW,
        _NodeDesc("dummy2", 1, 1): NOW - timedelta(seconds=15),
        _NodeDesc("dummy3", 1, 1): NOW - timedelta(seconds=30),
        _NodeDesc("dummy4", 1, 1): NOW - timedelta(seconds=60),
        _NodeDesc("dummy5", 1, 1): NOW - timedelta(seconds=90),
    }
    return state


def make_holder(backend: RendezvousBackend, cache_duration: int = 0) -> BackendStateHolder:
    """A holder whose clock stands at ``NOW``."""
    return BackendStateHolder(backend, make_settings(), cache_duration, FixedClock())


def test_holder_starts_empty_without_calling_the_backend() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    assert vars(holder.state) == vars(_RendezvousState())
    assert backend.calls == {"get": 0, "set": 0, "wait": 0}


def test_sync_gets_empty_state_if_backend_has_none() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    assert holder.sync(Deadline(10)) is None
    assert vars(holder.state) == vars(_RendezvousState())
    assert backend.calls["get"] == 1


def test_sync_gets_backend_state_if_local_state_is_clean() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    expected = full_state()
    for attempt in range(1, 4):
        expected.round = attempt
        backend.store(expected)
        assert holder.sync(Deadline(10)) is None
        assert vars(holder.state) == vars(expected)
    assert backend.calls == {"get": 3, "set": 0, "wait": 0}


def test_sync_gets_backend_state_if_local_state_is_old_and_dirty() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    expected = full_state()
    for attempt in range(1, 4):
        backend.store(expected)  # Moves the token on.
        holder.state.round = attempt
        holder.mark_dirty()
        assert holder.sync(Deadline(10)) is False
        assert vars(holder.state) == vars(expected)
    assert backend.calls == {"get": 0, "set": 3, "wait": 0}


def test_sync_sets_backend_state_if_local_state_is_new_and_dirty() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    for attempt in range(1, 4):
        holder.state.round = attempt
        holder.mark_dirty()
        assert holder.sync(Deadline(10)) is True
        assert vars(holder.state) == vars(backend.load())
        assert backend.load().round == attempt
    assert backend.calls == {"get": 0, "set": 3, "wait": 0}


def test_sync_serves_the_cache_until_it_expires_or_a_wait_ends() -> None:
    backend = MemoryBackend()
    backend.store(full_state())
    holder = make_holder(backend, cache_duration=60)
    holder.sync(Deadline(10))
    assert holder.sync(Deadline(10)) is None
    assert backend.calls["get"] == 1
    holder.wait_for_change(0, Deadline(10))
    holder.sync(Deadline(10))
    assert backend.calls["get"] == 2
    assert backend.calls["wait"] == 1


def test_wait_for_change_returns_when_another_node_writes() -> None:
    backend = MemoryBackend()
    holder = make_holder(backend)
    holder.sync(Deadline(10))
    threading.Timer(0.2, backend.store, args=(full_state(),)).start()
    started = time.monotonic()
    holder.wait_for_change(30, Deadline(10))
    assert time.monotonic() - started < 5
    holder.sync(Deadline(10))
    assert holder.state.round == 999


def test_holder_polls_a_backend_without_wait_for_change() -> None:
    class Bare:
        """Duck-typed backend, like one written before the hook existed."""

        name = "bare"

        def get_state(self) -> None:
            return None

        def set_state(self, state: bytes, token: Any = None) -> None:
            return None

    holder = BackendStateHolder(Bare(), make_settings())  # type: ignore[arg-type]
    started = time.monotonic()
    holder.wait_for_change(0.05, Deadline(10))
    assert 0.04 <= time.monotonic() - started < 1


def test_sync_removes_nodes_whose_heartbeats_lapsed() -> None:
    state = full_state()
    expected = full_state()
    dead = [_NodeDesc(f"dead{i}", 1, 1) for i in range(1, 7)]
    for i, node in enumerate(dead):
        state.last_heartbeats[node] = NOW - timedelta(seconds=91 + 10 * i)
    for node in dead[:3]:
        state.participants[node] = 0
    state.wait_list.update(dead[3:5])
    state.redundancy_list.add(dead[5])
    backend = MemoryBackend()
    backend.store(state)
    holder = make_holder(backend)
    holder.sync(Deadline(10))
    assert vars(holder.state) == vars(expected)


def test_sync_moves_to_next_round_if_no_participant_is_left() -> None:
    state = full_state()
    for node in state.last_heartbeats:
        state.last_heartbeats[node] = NOW - timedelta(seconds=100)
    backend = MemoryBackend()
    backend.store(state)
    holder = make_holder(backend)
    holder.sync(Deadline(10))
    assert holder.state.complete is False
    assert holder.state.round == 1000
    assert holder.state.participants == {}
    assert holder.state.wait_list == set()
    assert holder.state.last_heartbeats == {}


def test_sync_raises_state_error_naming_the_key() -> None:
    backend = MemoryBackend(key="/torch/elastic/rendezvous/r1")
    backend.corrupt()
    with pytest.raises(
        RendezvousStateError,
        match=r"^The rendezvous state in memory key '/torch/elastic/rendezvous/r1' is corrupt",
    ):
        make_holder(backend).sync(Deadline(10))


def test_sync_raises_state_error_naming_a_keyless_backend() -> None:
    backend = MemoryBackend()
    backend.corrupt(b"\x80\x04N.")  # A pickled None.
    with pytest.raises(RendezvousStateError, match="in the 'memory' backend is corrupt"):
        make_holder(backend).sync(Deadline(10))


# -- OpExecutor ---------------------------------------------------------


class FakeStateHolder(StateHolder):
    """Records calls; ``sync`` reports the dirty flag like a backend that always accepts.
    Its clock stands at ``NOW`` unless given another."""

    def __init__(
        self, state: _RendezvousState | None = None, clock: FixedClock | None = None
    ) -> None:
        self._state = state or _RendezvousState()
        self._dirty: bool | None = None
        self._clock = clock or FixedClock()
        self.calls: list[Any] = []

    @property
    def state(self) -> _RendezvousState:
        return self._state

    @property
    def clock(self) -> FixedClock:
        return self._clock

    def sync(self, deadline: Deadline) -> bool | None:
        self.calls.append("sync")
        self._dirty, dirty = None, self._dirty
        return dirty

    def mark_dirty(self) -> None:
        self.calls.append("mark")
        self._dirty = True

    def wait_for_change(self, timeout: float, deadline: Deadline) -> None:
        self.calls.append(("wait", timeout))


def run_action(
    action: Action,
    state: _RendezvousState,
    settings: RendezvousSettings | None = None,
    deadline: Deadline | None = None,
    renew: Callable[[], Deadline] | None = None,
) -> FakeStateHolder:
    holder = FakeStateHolder(state)
    executor = OpExecutor(ME, holder, settings or make_settings())
    actions = iter([action, Action.FINISH])
    executor.run(
        lambda ctx, dl: next(actions),
        Deadline(100) if deadline is None else deadline,
        renew,
    )
    return holder


def add_participants(state: _RendezvousState, count: int, *, ranked: bool = False) -> None:
    for i in range(count):
        if ranked:
            node, rank = _NodeDesc(f"dummy{i}", 1, 1), i
        else:
            node, rank = _NodeDesc(f"dummy{count - i - 1}", 1, 1), 0  # Added in reverse.
        state.participants[node] = rank
        state.last_heartbeats[node] = NOW


def test_run_passes_context_and_deadline_to_the_operation() -> None:
    settings = make_settings()
    holder = FakeStateHolder()
    seen: list[tuple[Context, float]] = []

    def op(ctx: Context, deadline: Deadline) -> Action:
        seen.append((ctx, deadline))
        return Action.FINISH

    given = Deadline(3)
    OpExecutor(ME, holder, settings).run(op, given)
    ((ctx, deadline),) = seen
    assert ctx.node is ME
    assert ctx.state is holder.state
    assert ctx.settings is settings
    assert deadline is given


def test_run_keeps_alive() -> None:
    state = _RendezvousState()
    holder = run_action(Action.KEEP_ALIVE, state)
    assert state.last_heartbeats == {ME: NOW}
    assert holder.calls == ["sync", "mark", "sync"]


@pytest.mark.parametrize("was_waiting", [False, True])
def test_run_adds_to_participants(was_waiting: bool) -> None:
    state = _RendezvousState()
    if was_waiting:
        state.wait_list.add(ME)
    run_action(Action.ADD_TO_PARTICIPANTS, state, make_settings(2, 2))
    assert state.participants == {ME: 0}
    assert state.wait_list == set()
    assert state.last_heartbeats == {ME: NOW}
    assert state.deadline is None


@pytest.mark.parametrize("count", range(3))
def test_run_adds_to_participants_and_starts_last_call(count: int) -> None:
    state = _RendezvousState()
    add_participants(state, count)
    run_action(Action.ADD_TO_PARTICIPANTS, state, make_settings(count + 1, count + 2))
    assert state.deadline == NOW + RendezvousTimeout().last_call
    assert state.complete is False


@pytest.mark.parametrize("count", range(3))
def test_run_adds_to_participants_and_completes_at_max_nodes(count: int) -> None:
    state = _RendezvousState()
    add_participants(state, count)
    state.deadline = NOW
    run_action(Action.ADD_TO_PARTICIPANTS, state, make_settings(1, count + 1))
    expected = _RendezvousState()
    add_participants(expected, count, ranked=True)
    expected.participants[ME] = count  # "this_node" sorts after "dummy*".
    expected.last_heartbeats[ME] = NOW
    expected.complete = True
    assert vars(state) == vars(expected)


def test_run_adds_to_wait_list() -> None:
    state = _RendezvousState()
    state.redundancy_list.add(ME)
    run_action(Action.ADD_TO_WAIT_LIST, state)
    assert state.wait_list == {ME}
    assert state.redundancy_list == set()
    assert state.last_heartbeats == {ME: NOW}


def test_run_adds_to_redundancy_list() -> None:
    state = _RendezvousState()
    run_action(Action.ADD_TO_REDUNDANCY_LIST, state)
    assert state.redundancy_list == {ME}
    assert state.last_heartbeats == {ME: NOW}


@pytest.mark.parametrize(("complete", "deadline"), [(False, NOW), (True, None)])
def test_run_removes_from_participants(complete: bool, deadline: datetime | None) -> None:
    state = _RendezvousState()
    add_participants(state, 2)
    state.participants[ME] = 0
    state.last_heartbeats[ME] = NOW
    state.complete, state.deadline, state.round = complete, deadline, 1
    run_action(Action.REMOVE_FROM_PARTICIPANTS, state)
    expected = _RendezvousState()
    add_participants(expected, 2)
    expected.complete, expected.deadline, expected.round = complete, deadline, 1
    assert vars(state) == vars(expected)


def test_run_removes_last_participant_and_moves_to_next_round() -> None:
    state = _RendezvousState()
    state.participants[ME] = 0
    state.last_heartbeats[ME] = NOW
    state.complete, state.round = True, 1
    run_action(Action.REMOVE_FROM_PARTICIPANTS, state)
    expected = _RendezvousState()
    expected.round = 2
    assert vars(state) == vars(expected)


def test_run_removes_from_participants_and_clears_last_call() -> None:
    state = _RendezvousState()
    add_participants(state, 2)
    state.participants[ME] = 0
    state.last_heartbeats[ME] = NOW
    state.deadline = NOW
    run_action(Action.REMOVE_FROM_PARTICIPANTS, state, make_settings(3, 4))
    assert state.deadline is None
    assert ME not in state.participants


def test_run_removes_from_wait_list() -> None:
    state = _RendezvousState()
    state.wait_list.add(ME)
    state.last_heartbeats[ME] = NOW
    run_action(Action.REMOVE_FROM_WAIT_LIST, state)
    assert vars(state) == vars(_RendezvousState())


def test_run_removes_from_redundancy_list_and_renews_the_deadline() -> None:
    state = _RendezvousState()
    state.redundancy_list.add(ME)
    state.last_heartbeats[ME] = NOW
    renewed: list[Deadline] = []

    def renew() -> Deadline:
        renewed.append(Deadline(100))
        return renewed[-1]

    run_action(Action.REMOVE_FROM_REDUNDANCY_LIST, state, renew=renew)
    assert vars(state) == vars(_RendezvousState())
    assert len(renewed) == 1


def test_run_marks_rendezvous_complete_and_assigns_ranks_in_node_order() -> None:
    state = _RendezvousState()
    add_participants(state, 3)
    state.deadline = NOW
    run_action(Action.MARK_RENDEZVOUS_COMPLETE, state)
    assert state.complete is True
    assert state.deadline is None
    assert state.participants == {_NodeDesc(f"dummy{i}", 1, 1): i for i in range(3)}


def test_run_marks_rendezvous_closed() -> None:
    state = _RendezvousState()
    run_action(Action.MARK_RENDEZVOUS_CLOSED, state)
    expected = _RendezvousState()
    expected.closed = True
    assert vars(state) == vars(expected)


_PENDING = "of the rendezvous 'dummy_run_id'. Pending sync."


@pytest.mark.parametrize(
    ("action", "listed", "message"),
    [
        (
            Action.ADD_TO_PARTICIPANTS,
            "",
            f"The node '{ME}' added itself to the participants of round 3 {_PENDING}",
        ),
        (
            Action.ADD_TO_WAIT_LIST,
            "",
            f"The node '{ME}' added itself to the wait list of round 4 {_PENDING}",
        ),
        (
            Action.ADD_TO_REDUNDANCY_LIST,
            "",
            f"The node '{ME}' added itself to the redundancy list of round 4 {_PENDING}",
        ),
        (
            Action.REMOVE_FROM_PARTICIPANTS,
            "participants",
            f"The node '{ME}' removed itself from the participants of round 3 {_PENDING}",
        ),
        (
            Action.REMOVE_FROM_WAIT_LIST,
            "wait_list",
            f"The node '{ME}' removed itself from the wait list of round 4 {_PENDING}",
        ),
        (
            Action.REMOVE_FROM_REDUNDANCY_LIST,
            "redundancy_list",
            # PyTorch's wording: "redundant list".
            f"The node '{ME}' removed itself from the redundant list of round 4 {_PENDING}",
        ),
    ],
)
def test_run_records_pytorchs_message_of_each_change(
    action: Action, listed: str, message: str
) -> None:
    state = _RendezvousState()
    state.round = 3
    if listed == "participants":
        state.participants[ME] = 0
    elif listed:
        getattr(state, listed).add(ME)
    state.last_heartbeats[ME] = NOW
    seen: list[RdzvEvent] = []
    add_event_handler(seen.append)
    try:
        run_action(action, state, make_settings(1, 3))
    finally:
        remove_event_handler(seen.append)
    method = action.name.lower()
    assert [event.message for event in seen if event.name.endswith(f"._{method}")] == [message]


@pytest.mark.parametrize(
    ("action", "error"),
    [
        (Action.ERROR_CLOSED, RendezvousClosedError),
        (Action.ERROR_TIMEOUT, RendezvousTimeoutError),
    ],
)
def test_run_raises_on_error_actions(action: Action, error: type[Exception]) -> None:
    holder = FakeStateHolder()
    executor = OpExecutor(ME, holder, make_settings())
    with pytest.raises(error):
        executor.run(lambda ctx, dl: action, Deadline(100))
    assert holder.calls == ["sync"]


@pytest.mark.parametrize(
    ("op", "action", "error", "words"),
    [
        (JoinOp(), Action.ERROR_CLOSED, RendezvousClosedError, "is closed"),
        (
            JoinOp(),
            Action.ERROR_TIMEOUT,
            RendezvousTimeoutError,
            "join_timeout (600 s)",
        ),
        (
            ExitOp(),
            Action.ERROR_TIMEOUT,
            RendezvousTimeoutError,
            "join_timeout (600 s)",
        ),
        (
            CloseOp(),
            Action.ERROR_TIMEOUT,
            RendezvousTimeoutError,
            "close_timeout (30 s)",
        ),
        (
            KeepAliveOp(),
            Action.ERROR_TIMEOUT,
            RendezvousTimeoutError,
            "heartbeat_timeout (5 s)",
        ),
    ],
    ids=["closed", "join", "exit", "close", "keep-alive"],
)
def test_error_actions_name_the_run_and_the_limit(
    op: Callable[..., Action], action: Action, error: type[Exception], words: str
) -> None:
    executor = OpExecutor(ME, FakeStateHolder(), make_settings())
    # The operation's type tells the limit; its decision here is the error.
    decide = type(type(op).__name__, (type(op),), {"__call__": lambda self, ctx, dl: action})
    with pytest.raises(error) as raised:
        executor.run(decide(), Deadline(100))
    assert f"rendezvous '{make_settings().run_id}'" in str(raised.value)
    assert words in str(raised.value)
    assert str(ME) in str(raised.value)


def test_run_waits_for_a_change_on_sync() -> None:
    holder = run_action(Action.SYNC, _RendezvousState())
    assert holder.calls[0] == "sync"
    assert holder.calls[1][0] == "wait"
    assert holder.calls[2:] == ["sync"]
    # Nothing is due: the wait is capped by the keep-alive interval (30 s here).
    assert holder.calls[1][1] == pytest.approx(30, abs=0.1)


# -- when a waiting node wakes up ----------------------------------------------------------


def wait_time(state: _RendezvousState, deadline_in: float = 100.0, **settings: Any) -> float:
    """How long a node holding ``state`` with nothing to do waits for a change."""
    holder = run_action(Action.SYNC, state, make_settings(**settings), Deadline(deadline_in))
    ((_, timeout),) = [call for call in holder.calls if call[0] == "wait"]
    return float(timeout)


def test_wake_up_at_the_last_call_deadline() -> None:
    state = _RendezvousState()
    state.deadline = NOW + timedelta(seconds=2)
    assert wait_time(state) == pytest.approx(2.01, abs=0.01)


def test_wake_up_for_our_own_heartbeat() -> None:
    state = _RendezvousState()
    state.last_heartbeats[ME] = NOW - timedelta(seconds=4)
    assert wait_time(state, interval=timedelta(seconds=5)) == pytest.approx(1.01, abs=0.01)


def test_wake_up_when_another_nodes_heartbeat_expires() -> None:
    state = _RendezvousState()
    state.last_heartbeats[_NodeDesc("other", 1, 1)] = NOW - timedelta(seconds=13)
    # 3 attempts of 5 s: expires 15 s after its last heartbeat, capped at 5 s.
    assert wait_time(state, interval=timedelta(seconds=5)) == pytest.approx(2.01, abs=0.01)


def test_wake_up_at_the_operation_deadline() -> None:
    assert wait_time(_RendezvousState(), deadline_in=0.5) == pytest.approx(0.51, abs=0.01)


def test_events_in_the_past_do_not_cause_busy_waiting() -> None:
    state = _RendezvousState()
    state.deadline = NOW - timedelta(seconds=1)
    state.last_heartbeats[ME] = NOW - timedelta(seconds=60)
    assert wait_time(state, deadline_in=-1, interval=timedelta(seconds=5)) == pytest.approx(
        5.01, abs=0.01
    )


# -- the operations -------------------------------------------------------------------------


def next_action(
    op: Callable[[Context, Deadline], Action],
    state: _RendezvousState,
    *,
    min_nodes: int = 1,
    max_nodes: int = 2,
    deadline_in: float = 100.0,
) -> Action:
    settings = make_settings(min_nodes, max_nodes)
    ctx = Context(ME, state, settings, now=NOW)
    return op(ctx, Deadline(deadline_in))


def base_state() -> _RendezvousState:
    state = _RendezvousState()
    state.participants[_NodeDesc("dummy1", 1, 1)] = 1
    return state


def test_exit_op() -> None:
    state = base_state()
    assert next_action(ExitOp(), state) == Action.FINISH
    state.participants[ME] = 1
    assert next_action(ExitOp(), state) == Action.REMOVE_FROM_PARTICIPANTS
    assert next_action(ExitOp(), state, deadline_in=-1) == Action.ERROR_TIMEOUT


def test_exit_op_is_done_once_the_round_it_leaves_is_over() -> None:
    state = base_state()
    state.round, state.complete = 3, True
    state.participants[ME] = 1
    op = ExitOp()
    assert next_action(op, state) == Action.REMOVE_FROM_PARTICIPANTS
    assert next_action(op, state) == Action.REMOVE_FROM_PARTICIPANTS  # Not out yet.
    # A batch took the node out of round 3 and admitted it to round 4 in one write.
    state.round = 4
    assert next_action(op, state) == Action.FINISH


def join(state: _RendezvousState, **kwargs: Any) -> Action:
    return next_action(JoinOp(), state, **kwargs)


def test_join_raises_closed_if_rendezvous_is_closed() -> None:
    state = base_state()
    state.closed = True
    assert join(state) == Action.ERROR_CLOSED


def test_join_exits_gracefully_if_closed_while_redundant() -> None:
    state = base_state()
    state.closed = True
    state.redundancy_list.add(ME)
    with pytest.raises(RendezvousGracefulExitError, match="is closed, terminating pending"):
        join(state)


def test_join_finishes_if_complete_and_participant() -> None:
    state = base_state()
    state.participants[ME] = 0
    state.complete = True
    assert join(state) == Action.FINISH


def assert_waits(state: _RendezvousState, **kwargs: Any) -> None:
    """Keep-alive once the interval (30 s) passed, else wait for a change."""
    for age, expected in ((30, Action.KEEP_ALIVE), (29, Action.SYNC)):
        state.last_heartbeats[ME] = NOW - timedelta(seconds=age)
        assert join(state, **kwargs) == expected


def test_join_adds_to_redundancy_list_if_complete_and_full() -> None:
    state = base_state()
    state.complete = True
    assert join(state, max_nodes=1) == Action.ADD_TO_REDUNDANCY_LIST


def test_join_waits_while_redundant_and_full_even_past_deadline() -> None:
    state = base_state()
    state.complete = True
    state.redundancy_list.add(ME)
    assert_waits(state, max_nodes=1)
    assert_waits(state, max_nodes=1, deadline_in=-100)


def test_join_leaves_redundancy_list_once_there_is_room() -> None:
    state = base_state()
    state.complete = True
    state.redundancy_list.add(ME)
    assert join(state, max_nodes=2) == Action.REMOVE_FROM_REDUNDANCY_LIST


def test_join_waits_for_next_round_if_in_wait_list() -> None:
    state = base_state()
    state.complete = True
    state.wait_list.add(ME)
    assert_waits(state)


def test_join_adds_to_wait_list_if_complete_with_room() -> None:
    state = base_state()
    state.complete = True
    assert join(state) == Action.ADD_TO_WAIT_LIST


def test_join_adds_to_participants_if_not_complete() -> None:
    assert join(base_state()) == Action.ADD_TO_PARTICIPANTS


def test_join_completes_after_last_call() -> None:
    state = base_state()
    state.participants[ME] = 0
    state.deadline = NOW - timedelta(seconds=1)
    assert join(state) == Action.MARK_RENDEZVOUS_COMPLETE


def test_join_waits_during_last_call() -> None:
    state = base_state()
    state.participants[ME] = 0
    state.deadline = NOW + timedelta(seconds=1)
    assert_waits(state)


def test_join_waits_for_min_nodes() -> None:
    state = base_state()
    state.participants[ME] = 0
    assert_waits(state, min_nodes=3, max_nodes=4)


def test_join_rolls_back_after_deadline() -> None:
    state = base_state()
    state.participants[ME] = 0
    assert join(state, deadline_in=-1) == Action.REMOVE_FROM_PARTICIPANTS
    del state.participants[ME]
    state.complete = True
    state.wait_list.add(ME)
    assert join(state, deadline_in=-1) == Action.REMOVE_FROM_WAIT_LIST


class Monotonic:
    """A monotonic clock that the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_join_times_out_after_rollback_period() -> None:
    clock = Monotonic()
    op, deadline = JoinOp(clock), Deadline(10, clock=clock)
    ctx = Context(ME, base_state(), make_settings(1, 2), now=NOW)
    ctx.state.participants[ME] = 0
    assert op(ctx, deadline) == Action.SYNC
    clock.now += 11
    assert op(ctx, deadline) == Action.REMOVE_FROM_PARTICIPANTS  # 1 s into the rollback
    clock.now += 5
    assert op(ctx, deadline) == Action.ERROR_TIMEOUT  # 6 s past the deadline
    assert join(base_state(), deadline_in=-1) == Action.ERROR_TIMEOUT


def test_close_op() -> None:
    state = base_state()
    assert next_action(CloseOp(), state) == Action.MARK_RENDEZVOUS_CLOSED
    assert next_action(CloseOp(), state, deadline_in=-1) == Action.ERROR_TIMEOUT
    state.closed = True
    assert next_action(CloseOp(), state) == Action.FINISH


def test_keep_alive_op() -> None:
    state = base_state()
    op = KeepAliveOp()
    assert next_action(op, state) == Action.FINISH  # No heartbeat of ours yet.
    state.last_heartbeats[ME] = NOW - timedelta(seconds=30)
    assert next_action(op, state) == Action.KEEP_ALIVE
    assert next_action(op, state, deadline_in=-1) == Action.ERROR_TIMEOUT
    state.last_heartbeats[ME] = NOW - timedelta(seconds=29)
    assert next_action(op, state) == Action.FINISH


# -- handlers, several nodes in threads -----------------------------------------------------


def make_handler(
    backend: RendezvousBackend,
    store: DictStore,
    min_nodes: int,
    max_nodes: int,
    *,
    run_id: str = "run",
    interval: timedelta = timedelta(seconds=5),
    attempts: int = 3,
    join_timeout: float = 10.0,
    last_call: float = 0.2,
    close: float = 5.0,
    addr: str = "127.0.0.1",
) -> DynamicRendezvousHandler:
    settings = make_settings(
        min_nodes,
        max_nodes,
        interval=interval,
        attempts=attempts,
        run_id=run_id,
        timeout=RendezvousTimeout(
            join=timedelta(seconds=join_timeout),
            last_call=timedelta(seconds=last_call),
            close=timedelta(seconds=close),
            heartbeat=timedelta(seconds=5),
        ),
    )
    node = _NodeDesc(addr, os.getpid(), next(_LOCAL_IDS))
    holder = BackendStateHolder(backend, settings)
    handler = DynamicRendezvousHandler(node, settings, backend.name, store, holder)
    _NODES[handler] = node
    return handler


#: The local ids of the nodes :func:`make_handler` makes (a handler's own generator's
#: start at 0 in each process: these start far above), and the node of each handler.
_LOCAL_IDS = itertools.count(10_000)
_NODES: weakref.WeakKeyDictionary[DynamicRendezvousHandler, _NodeDesc] = weakref.WeakKeyDictionary()


def node_of(handler: DynamicRendezvousHandler) -> _NodeDesc:
    """The node of a handler :func:`make_handler` made."""
    return _NODES[handler]


class Joiner:
    """Runs ``handler.next_rendezvous()`` in a thread and keeps the outcome."""

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self.handler = handler
        self.result: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self.handler.next_rendezvous()
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()

    def join(self, timeout: float = 15.0) -> RendezvousInfo:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "next_rendezvous did not return"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def done(self) -> bool:
        return not self._thread.is_alive()


@pytest.fixture
def handlers() -> Iterator[list[DynamicRendezvousHandler]]:
    """Handlers to stop at the end of the test (heartbeat threads only; no closing)."""
    created: list[DynamicRendezvousHandler] = []
    yield created
    for handler in created:
        handler.close()


@pytest.mark.parametrize("backend_type", [MemoryBackend, PollingBackend])
def test_four_nodes_rendezvous(
    backend_type: type[MemoryBackend], handlers: list[DynamicRendezvousHandler]
) -> None:
    backend, store = backend_type(), DictStore()
    handlers.extend(make_handler(backend, store, 4, 4) for _ in range(4))
    started = time.monotonic()
    infos = [joiner.join() for joiner in [Joiner(h) for h in handlers]]
    assert time.monotonic() - started < 3
    assert sorted(info.rank for info in infos) == [0, 1, 2, 3]
    assert {info.world_size for info in infos} == {4}
    # Ranks follow the node order, as in PyTorch.
    by_node = sorted(zip(handlers, infos), key=lambda pair: node_of(pair[0]))
    assert [info.rank for _, info in by_node] == [0, 1, 2, 3]
    # The store is round-scoped; rank 0 published the bootstrap address there.
    assert store.data["torch.rendezvous.run.0/MASTER_ADDR"] == b"127.0.0.1"
    port = int(store.data["torch.rendezvous.run.0/MASTER_PORT"])
    for info in infos:
        assert info.bootstrap_store_info is not None
        assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
            "127.0.0.1",
            port,
        )
    state = backend.load()
    assert state.complete
    assert state.round == 0
    assert state.deadline is None


def test_waiting_node_wakes_up_on_the_write_not_on_a_poll(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 2, 2) for _ in range(2))
    first = Joiner(handlers[0])
    # The first node wrote itself into the state and now waits for the second.
    wait_until(lambda: len(backend.writes) >= 1 and backend.calls["wait"] >= 1)
    second = Joiner(handlers[1])
    first.join()
    second.join()
    completed_at = next(at for at, state in backend.writes if state.complete)
    assert first.finished_at is not None
    assert first.finished_at - completed_at < 0.3  # A poll would take up to 1 s.


def test_last_call_completes_with_min_nodes(handlers: list[DynamicRendezvousHandler]) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 2, 3, last_call=0.3) for _ in range(2))
    started = time.monotonic()
    infos = [joiner.join() for joiner in [Joiner(h) for h in handlers]]
    elapsed = time.monotonic() - started
    assert {info.world_size for info in infos} == {2}
    assert 0.3 <= elapsed < 2


def test_late_node_waits_and_joins_the_next_round(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 2, 3, last_call=0.5) for _ in range(3))
    first = [Joiner(h) for h in handlers[:2]]
    assert {j.join().world_size for j in first} == {2}
    late = Joiner(handlers[2])
    wait_until(lambda: handlers[0].num_nodes_waiting() == 1)
    assert not late.done()
    # The agents of the running group see the waiting node and re-rendezvous.
    again = [Joiner(h) for h in handlers[:2]]
    infos = [j.join() for j in [*again, late]]
    assert {info.world_size for info in infos} == {3}
    assert sorted(info.rank for info in infos) == [0, 1, 2]
    assert backend.load().round == 1
    assert handlers[0].num_nodes_waiting() == 0
    assert "torch.rendezvous.run.1/MASTER_ADDR" in store.data


def test_redundant_node_exits_gracefully_on_close(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 2, 2) for _ in range(3))
    for joiner in [Joiner(h) for h in handlers[:2]]:
        joiner.join()
    spare = Joiner(handlers[2])
    wait_until(lambda: node_of(handlers[2]) in backend.load().redundancy_list)
    assert handlers[0].num_nodes_waiting() == 0  # Redundant nodes do not trigger a round.
    handlers[0].set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        spare.join()


def test_closed_rendezvous_refuses_joins(handlers: list[DynamicRendezvousHandler]) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 1, 2, last_call=0.1) for _ in range(2))
    Joiner(handlers[0]).join()
    assert handlers[0].is_closed() is False
    assert handlers[0].shutdown() is True
    assert handlers[1].is_closed() is True
    with pytest.raises(RendezvousClosedError):
        Joiner(handlers[1]).join()


def test_join_times_out(handlers: list[DynamicRendezvousHandler]) -> None:
    backend, store = MemoryBackend(), DictStore()
    handlers.append(make_handler(backend, store, 2, 2, join_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        Joiner(handlers[0]).join()
    assert time.monotonic() - started < 3
    # It rolled back: it is no longer a participant.
    assert backend.load().participants == {}


def test_dead_node_is_removed_after_its_heartbeats_lapse(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend, store = MemoryBackend(), DictStore()
    interval = timedelta(milliseconds=100)
    handlers.extend(
        make_handler(backend, store, 1, 2, interval=interval, attempts=2, last_call=1.0)
        for _ in range(2)
    )
    for joiner in [Joiner(h) for h in handlers]:
        joiner.join()
    dead, survivor = handlers
    dead.close()  # As if its process was killed: its heartbeats stop.
    lifetime = interval * 2

    def lapsed() -> bool:  # (the survivor's heartbeat may have dropped it already)
        beat = backend.load().last_heartbeats.get(node_of(dead))
        return beat is None or datetime.now(timezone.utc) - beat > lifetime

    wait_until(lapsed)
    # Without removal the dead node would stay a participant and the survivor would
    # wait for it; with it, the survivor forms a round of its own.
    info = Joiner(survivor).join()
    assert info.world_size == 1
    state = backend.load()
    assert node_of(dead) not in state.participants
    assert node_of(dead) not in state.last_heartbeats
    assert state.round == 1


# -- heartbeats ------------------------------------------------------------------------------


def keep_alive_threads(handler: DynamicRendezvousHandler) -> list[threading.Thread]:
    name = f"RendezvousKeepAliveTimer_{node_of(handler).local_id}"
    return [t for t in threading.enumerate() if t.name == name]


def last_heartbeat(backend: MemoryBackend, handler: DynamicRendezvousHandler) -> datetime:
    return backend.load().last_heartbeats[node_of(handler)]


def test_heartbeats_run_and_stop_on_shutdown(handlers: list[DynamicRendezvousHandler]) -> None:
    backend, store = MemoryBackend(), DictStore()
    handler = make_handler(backend, store, 1, 1, interval=timedelta(milliseconds=50))
    handlers.append(handler)
    assert keep_alive_threads(handler) == []
    Joiner(handler).join()
    (thread,) = keep_alive_threads(handler)
    assert thread.daemon
    first = last_heartbeat(backend, handler)
    wait_until(lambda: last_heartbeat(backend, handler) > first)
    assert handler.shutdown() is True
    assert not thread.is_alive()
    assert keep_alive_threads(handler) == []  # the only heartbeat writer is gone
    handler.close()  # Stopping them again is harmless.


class HeldHeartbeatBackend(MemoryBackend):
    """Holds a keep-alive thread's write of the state while :attr:`gate` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        keep_alive = threading.current_thread().name.startswith("RendezvousKeepAliveTimer")
        if keep_alive and not self.gate.is_set():
            self.held.set()
            self.gate.wait()
        return super().set_state(state, token)


def test_close_waits_for_a_heartbeat_that_outlived_shutdown(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    """A heartbeat still writing when shutdown() gives up on it is waited for by close():
    otherwise it could write the state after close() released the backend (on etcd's v3
    API, a write on a lease the connection then revokes, taking the state with it)."""
    backend, store = HeldHeartbeatBackend(), DictStore()
    handler = make_handler(backend, store, 1, 1, interval=timedelta(milliseconds=50), close=0.2)
    handlers.append(handler)
    Joiner(handler).join()
    (thread,) = keep_alive_threads(handler)
    backend.gate.clear()
    wait_until(backend.held.is_set, what="a heartbeat to be held")
    assert handler.shutdown() is False  # the heartbeat holds the backend past its deadline
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (handler.close(), closed.set()), daemon=True)
    closer.start()
    assert not closed.wait(0.5), "close() returned while a heartbeat was still writing"
    backend.gate.set()
    assert closed.wait(10)
    assert not thread.is_alive()


def test_heartbeats_survive_transient_errors(handlers: list[DynamicRendezvousHandler]) -> None:
    backend, store = MemoryBackend(), DictStore()
    handler = make_handler(backend, store, 1, 1, interval=timedelta(milliseconds=50))
    handlers.append(handler)
    Joiner(handler).join()
    (thread,) = keep_alive_threads(handler)
    backend.failures.extend(
        [
            RendezvousConnectionError("etcd is down"),
            RuntimeError("unexpected"),
            RendezvousConnectionError("still down"),
        ]
    )
    wait_until(lambda: not backend.failures)
    before = last_heartbeat(backend, handler)
    wait_until(lambda: last_heartbeat(backend, handler) > before)
    assert thread.is_alive()


def test_garbage_collected_handler_stops_its_heartbeats() -> None:
    import gc

    backend, store = MemoryBackend(), DictStore()
    handler = make_handler(backend, store, 1, 1, interval=timedelta(milliseconds=50))
    Joiner(handler).join()
    (thread,) = keep_alive_threads(handler)
    del handler
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


# -- stores and bootstrap ----------------------------------------------------------------------


def test_prefix_store_joins_keys_like_c10d() -> None:
    store = DictStore()
    prefixed = PrefixStore("torch.rendezvous.run.3", store)
    prefixed.set("a", "1")
    assert store.data == {"torch.rendezvous.run.3/a": b"1"}
    assert prefixed.get("a") == b"1"
    assert prefixed.add("n", 2) == 2
    assert store.data["torch.rendezvous.run.3/n"] == b"2"
    assert prefixed.check(["a", "n"]) is True
    assert prefixed.check(["b"]) is False
    prefixed.wait(["a"])
    prefixed.wait(["a"], timedelta(seconds=1))
    assert prefixed.underlying_store is store
    assert prefix_store("p", store).__class__ is PrefixStore


@pytest.mark.torch
def test_prefix_store_matches_torchs() -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    hash_store = dist.HashStore()
    dist.PrefixStore("torch.rendezvous.run.0", hash_store).set("k", "theirs")
    wrapped = prefix_store("torch.rendezvous.run.0", hash_store)
    assert isinstance(wrapped, dist.PrefixStore)  # A torch store gets torch's wrapper.
    assert wrapped.get("k") == b"theirs"
    # Ours writes the same key torch's reads.
    PrefixStore("torch.rendezvous.run.0", hash_store).set("j", "ours")  # type: ignore[arg-type]
    assert dist.PrefixStore("torch.rendezvous.run.0", hash_store).get("j") == b"ours"
    assert hash_store.get("torch.rendezvous.run.0/j") == b"ours"


def test_use_agent_store_follows_pytorchs_env_var(
    monkeypatch: pytest.MonkeyPatch, handlers: list[DynamicRendezvousHandler]
) -> None:
    handler = make_handler(MemoryBackend(), DictStore(), 1, 1)
    assert handler.use_agent_store is False  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(_dynamic_handler, "torch_available", lambda: True)
    assert handler.use_agent_store is True
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    assert handler.use_agent_store is True
    monkeypatch.setattr(_dynamic_handler, "torch_available", lambda: False)
    assert handler.use_agent_store is False  # No TCPStore without PyTorch.


def test_shared_tcp_store_port_is_published_by_rank_0(
    monkeypatch: pytest.MonkeyPatch, handlers: list[DynamicRendezvousHandler]
) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(_dynamic_handler, "torch_available", lambda: True)
    created: list[tuple[str, int]] = []

    class FakeServer:
        port = 29555

    def create(self: DynamicRendezvousHandler, addr: str, port: int) -> FakeServer:
        created.append((addr, port))
        return FakeServer()

    monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server", create)
    backend, store = MemoryBackend(), DictStore()
    handlers.extend(make_handler(backend, store, 2, 2) for _ in range(2))
    infos = [j.join() for j in [Joiner(h) for h in handlers]]
    assert created == [("127.0.0.1", 0)]  # Only rank 0 hosts it.
    for info in infos:
        assert info.bootstrap_store_info is not None
        assert info.bootstrap_store_info.master_port == 29555


def test_rank_0_keeps_its_tcp_store_port_across_rounds_and_stops_the_old_server(
    monkeypatch: pytest.MonkeyPatch, handlers: list[DynamicRendezvousHandler]
) -> None:
    """PyTorch's nodes other than rank 0 keep the port of their first round: rank 0's
    server of each round is a new, empty one on the same port, the old one stopped."""
    dist = pytest.importorskip("torch.distributed", reason="needs PyTorch")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    backend = MemoryBackend()
    handler = make_handler(backend, DictStore(), 1, 1)
    handlers.append(handler)
    first = handler.next_rendezvous().bootstrap_store_info
    assert first is not None
    old_server = weakref.ref(handler._shared_tcp_store_server)
    client = dist.TCPStore(
        first.master_addr, first.master_port, is_master=False, timeout=timedelta(seconds=5)
    )
    client.set("gloo/rank0", "the first world's address")

    second = handler.next_rendezvous().bootstrap_store_info  # the node re-joins: round 1
    assert second is not None
    assert backend.load().round == 1
    assert (second.master_addr, second.master_port) == (first.master_addr, first.master_port)
    assert old_server() is None  # no reference left: torch has stopped that server
    with pytest.raises(dist.DistError):
        client.get("gloo/rank0")  # its connection went with it
    fresh = dist.TCPStore(
        second.master_addr, second.master_port, is_master=False, timeout=timedelta(seconds=5)
    )
    assert not fresh.check(["gloo/rank0"])  # the new server holds nothing of the old world


def test_rank_0_takes_a_new_tcp_store_port_when_the_old_one_is_taken(
    monkeypatch: pytest.MonkeyPatch,
    handlers: list[DynamicRendezvousHandler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(_dynamic_handler, "torch_available", lambda: True)
    created: list[int] = []
    free_ports = iter([29555, 29600])

    class FakeServer:
        def __init__(self, port: int) -> None:
            self.port = port

    def create(self: DynamicRendezvousHandler, addr: str, port: int) -> FakeServer:
        created.append(port)
        if port == 29555:
            raise RuntimeError("EADDRINUSE: address already in use")
        return FakeServer(port or next(free_ports))

    monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server", create)
    handler = make_handler(MemoryBackend(), DictStore(), 1, 1)
    handlers.append(handler)
    with caplog.at_level("WARNING", logger=dr.__name__):
        ports = [handler.next_rendezvous().bootstrap_store_info.master_port for _ in range(3)]  # type: ignore[union-attr]
    # Round 0 binds a free port; round 1 tries it again, finds it taken, takes another;
    # round 2 gets that one again.
    assert created == [0, 29555, 0, 29600]
    assert ports == [29555, 29600, 29600]
    assert "could not start the shared TCPStore on 127.0.0.1:29555 again" in caplog.text


def test_rank_0_takes_a_new_tcp_store_port_while_its_old_server_is_still_referenced(
    monkeypatch: pytest.MonkeyPatch,
    handlers: list[DynamicRendezvousHandler],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch shares one server per port in a process: a server on the old port while
    the old one lives would be the old one, with the last world's keys."""
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setattr(_dynamic_handler, "torch_available", lambda: True)
    created: list[int] = []
    servers: list[Any] = []  # a reference the handler does not own
    free_ports = iter([29555, 29600])

    class FakeServer:
        def __init__(self, port: int) -> None:
            self.port = port

    def create(self: DynamicRendezvousHandler, addr: str, port: int) -> FakeServer:
        created.append(port)
        servers.append(FakeServer(port or next(free_ports)))
        return servers[-1]

    monkeypatch.setattr(DynamicRendezvousHandler, "_create_tcp_store_server", create)
    handler = make_handler(MemoryBackend(), DictStore(), 1, 1)
    handlers.append(handler)
    with caplog.at_level("WARNING", logger=dr.__name__):
        ports = [handler.next_rendezvous().bootstrap_store_info.master_port for _ in range(2)]  # type: ignore[union-attr]
    assert created == [0, 0]
    assert ports == [29555, 29600]
    assert "on port 29555 is still referenced elsewhere" in caplog.text


def test_importing_the_module_does_not_import_torch() -> None:
    code = (
        "import sys, etcd_rendezvous.dynamic_rendezvous\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_use_agent_store_with_torch_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    assert make_handler(MemoryBackend(), DictStore(), 1, 1).use_agent_store is True


# -- construction --------------------------------------------------------------------------


def params(**config: Any) -> RendezvousParameters:
    return RendezvousParameters("memory", "localhost", "run-9", 2, 4, "10.0.0.1", **config)


def test_create_handler_reads_the_options() -> None:
    handler = dr.create_handler(
        DictStore(),
        MemoryBackend(),
        params(
            join_timeout="11",
            last_call_timeout="12",
            close_timeout=13,
            heartbeat_timeout="14",
            keep_alive_interval="6",
            keep_alive_max_attempt="7",
        ),
    )
    settings = handler.settings
    assert (settings.run_id, settings.min_nodes, settings.max_nodes) == ("run-9", 2, 4)
    assert settings.timeout.join == timedelta(seconds=11)
    assert settings.timeout.last_call == timedelta(seconds=12)
    assert settings.timeout.close == timedelta(seconds=13)
    assert settings.timeout.heartbeat == timedelta(seconds=14)
    assert settings.keep_alive_interval == timedelta(seconds=6)
    assert settings.keep_alive_max_attempt == 7
    assert handler.get_backend() == "memory"
    assert handler.get_run_id() == "run-9"
    # The node is known by its local_addr: the events it records name it.
    seen: list[RdzvEvent] = []
    add_event_handler(seen.append)
    try:
        handler.set_closed()
    finally:
        remove_event_handler(seen.append)
    assert {event.hostname for event in seen} == {"10.0.0.1"}


def test_create_handler_defaults() -> None:
    settings = dr.create_handler(DictStore(), MemoryBackend(), params()).settings
    assert settings.timeout.join == timedelta(seconds=600)
    assert settings.keep_alive_interval == timedelta(seconds=5)
    assert settings.keep_alive_max_attempt == 3


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"keep_alive_interval": None}, TypeError, "keep_alive_interval=None"),
        ({"keep_alive_max_attempt": None}, TypeError, "keep_alive_max_attempt=None"),
        ({"join_timeout": "0"}, ValueError, r"The join timeout \(0:00:00\) must be positive"),
        ({"close_timeout": "x"}, ValueError, "'close_timeout' does not represent a valid integer"),
    ],
)
def test_create_handler_rejects_bad_options(
    config: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        dr.create_handler(DictStore(), MemoryBackend(), params(**config))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (make_settings(run_id=""), "The run id must be a non-empty string."),
        (make_settings(0, 1), r"The minimum number of nodes \(0\) must be greater than zero."),
        (make_settings(3, 2), r"The maximum number of nodes \(2\) must be greater than or equal"),
    ],
)
def test_handler_validates_settings(settings: RendezvousSettings, message: str) -> None:
    holder = BackendStateHolder(MemoryBackend(), settings)
    with pytest.raises(ValueError, match=message):
        DynamicRendezvousHandler(ME, settings, "memory", DictStore(), holder)


# -- a mixed fleet in one process ----------------------------------------------------------


@pytest.mark.torch
def test_mixed_fleet_with_pytorchs_handler(handlers: list[DynamicRendezvousHandler]) -> None:
    """Two PyTorch 2.13 handlers and two of ours share one state and one store."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dr

    backend, store = MemoryBackend(), dist.HashStore()
    timeout = torch_dr.RendezvousTimeout(join=timedelta(seconds=20))
    theirs = [
        torch_dr.DynamicRendezvousHandler.from_backend(
            "mixed", store, backend, 4, 4, "127.0.0.1", timeout
        )
        for _ in range(2)
    ]
    # Another address: in one process, their node ids and ours would collide.
    handlers.extend(
        make_handler(backend, store, 4, 4, run_id="mixed", addr="localhost")  # type: ignore[arg-type]
        for _ in range(2)
    )
    joiners = [Joiner(h) for h in [*theirs, *handlers]]
    try:
        infos = [joiner.join(30) for joiner in joiners]
    finally:
        for handler in theirs:
            handler._stop_heartbeats()
    assert sorted(info.rank for info in infos) == [0, 1, 2, 3]
    assert {info.world_size for info in infos} == {4}
    addresses = {
        (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port)
        for info in infos
        if info.bootstrap_store_info is not None
    }
    assert len(addresses) == 1
    # One round-scoped store: a key set through ours is read through theirs.
    infos[2].store.set("from-ours", b"1")
    assert infos[0].store.get("from-ours") == b"1"
    assert store.get("torch.rendezvous.mixed.0/from-ours") == b"1"


class KeyedMemoryBackend(MemoryBackend, BoardRegistry):
    """An in-memory backend with this package's backend's interface: node keys, the
    aggregator lock and a progress key too, calls that take a deadline, a connection."""

    def __init__(self) -> None:
        BoardRegistry.__init__(self, Clock())
        MemoryBackend.__init__(self)  # its call counts take in the registry's too
        #: The deadline of each call of the state.
        self.deadlines: list[Deadline | None] = []

    def get_state(self, *, deadline: Deadline | None = None) -> tuple[bytes, Any] | None:
        self.deadlines.append(deadline)
        return MemoryBackend.get_state(self)

    def set_state(
        self, state: bytes, token: Any = None, *, deadline: Deadline | None = None
    ) -> tuple[bytes, Any, bool] | None:
        self.deadlines.append(deadline)
        return MemoryBackend.set_state(self, state, token)

    def wait_for_change(
        self, token: Any, timeout: float, *, deadline: Deadline | None = None
    ) -> None:
        MemoryBackend.wait_for_change(self, token, timeout)

    @property
    def connection(self) -> Any:
        return types.SimpleNamespace(clock=ServerClock())


def test_only_a_backend_that_keeps_node_keys_gets_batched_admission() -> None:
    plain, keyed = MemoryBackend(), KeyedMemoryBackend()
    for backend in (plain, keyed):
        with DynamicRendezvousHandler.from_backend("run", DictStore(), backend, 1, 1) as handler:
            assert handler.next_rendezvous().world_size == 1
    # The keyed node announced itself, was admitted in a batch (its own) and deleted its
    # key when closed; the plain one wrote itself into the state, as in PyTorch.
    assert (keyed.calls["announce"], keyed.calls["withdraw"]) == (1, 1)
    assert len(keyed.load().participants) == len(plain.load().participants) == 1
    assert "announce" not in plain.calls


def test_the_holder_passes_the_callers_deadline_to_this_packages_backend_only() -> None:
    """This package's backend gets the deadline of each call; a backend with PyTorch's
    interface (whose get_state() and set_state() take none) is called as PyTorch does."""
    keyed, plain, deadline = KeyedMemoryBackend(), MemoryBackend(), Deadline(10)
    for backend in (keyed, plain):
        holder = make_holder(backend)
        holder.sync(deadline)
        holder.mark_dirty()
        holder.sync(deadline)
    assert keyed.deadlines == [deadline, deadline]
    assert (plain.calls["get"], plain.calls["set"]) == (1, 1)


def test_the_first_waiting_node_takes_out_a_participant_whose_key_expired() -> None:
    """With node keys: a complete round that lists a dead participant (its key expired)
    while we wait for the next round loses it in one write by the first waiting node."""
    dead, other = _NodeDesc("dead", 1, 1), _NodeDesc("zzz_waiting", 1, 1)
    registry, clock = MemoryRegistry(), Clock()
    for node in (dead, ME, other):
        registry.announce_node(node, 15)
    registry.lifetimes[dead] = 3
    state = _RendezvousState()
    state.round, state.complete = 3, True
    state.participants[dead] = 0
    state.wait_list.update({ME, other})
    state.last_heartbeats.update({dead: NOW, ME: NOW, other: NOW})
    holder = FakeStateHolder(state)
    settings = make_settings(1, 3, interval=timedelta(seconds=5))
    keys = Admission(registry, ME, settings, clock, state_clock=holder.clock, progress_key=False)
    executor = OpExecutor(ME, holder, settings, keys)
    waits = 0

    def op(ctx: Context, deadline: Deadline) -> Action:
        nonlocal waits
        if dead not in ctx.state.participants:
            return Action.FINISH
        waits += 1
        assert waits < 5, "the dead participant was never taken out"
        if waits == 2:
            registry.keys.pop(dead)  # its key expired while we waited
            clock.now += 2.3
        return Action.SYNC

    executor.run(op, Deadline(100))

    # First look: the key lives 3 s more; we wait until then (whole seconds: 2.3 s).
    assert holder.calls[1][0] == "wait"
    assert holder.calls[1][1] == pytest.approx(2 + 0.3 + 0.01, abs=0.05)
    # Second look (the wait is over in this fake): the key is gone; the write takes the
    # dead node out, and the round (now empty) ends.
    assert holder.calls[2:] == ["sync", "mark", "sync"]
    assert dead not in state.participants
    assert dead not in state.last_heartbeats
    assert (state.round, state.complete) == (4, False)
    assert registry.calls["list"] == 2


def test_only_the_first_of_the_wait_list_looks_at_the_keys() -> None:
    dead, first = _NodeDesc("dead", 1, 1), _NodeDesc("a_first", 1, 1)
    registry = MemoryRegistry()
    state = _RendezvousState()
    state.round, state.complete = 3, True
    state.participants[dead] = 0
    state.wait_list.update({ME, first})
    state.last_heartbeats.update({dead: NOW, ME: NOW, first: NOW})
    holder = FakeStateHolder(state)
    settings = make_settings(1, 3)
    keys = Admission(registry, ME, settings, state_clock=holder.clock, progress_key=False)
    executor = OpExecutor(ME, holder, settings, keys)
    actions = iter([Action.SYNC, Action.FINISH])
    executor.run(lambda ctx, dl: next(actions), Deadline(100))
    assert "list" not in registry.calls
    assert holder.calls[1][0] == "wait"


# -- the clock of the state's times -------------------------------------------------------------


def test_the_aggregator_never_moves_another_nodes_heartbeat_back() -> None:
    """The fold sets the heartbeats of the nodes with a live key to the state's time now,
    but never back: a later one (written by a node whose clock was ahead) stays."""
    ahead, behind = _NodeDesc("ahead", 1, 1), _NodeDesc("behind", 1, 1)
    registry, monotonic = MemoryRegistry(), Clock()
    settings = make_settings(1, 3, interval=timedelta(seconds=5))
    state = _RendezvousState()
    holder = FakeStateHolder(state)
    keys = Admission(
        registry, ME, settings, monotonic, state_clock=holder.clock, progress_key=False
    )
    # Announced and admitted: the first admitter aggregates.
    assert keys.join(Action.ADD_TO_PARTICIPANTS, state, None, Deadline(10)) is CHANGED
    for node in (ahead, behind):
        registry.announce_node(node, 15)
    state.complete = True
    state.participants = {ahead: 0, behind: 1, ME: 2}
    later = NOW + timedelta(seconds=20)
    state.last_heartbeats = {ahead: later, behind: NOW - timedelta(seconds=4), ME: NOW}
    executor = OpExecutor(ME, holder, settings, keys)
    monotonic.now += 5  # the next tick is due
    executor.run(lambda ctx, dl: Action.FINISH, Deadline(100))
    assert holder.calls[:3] == ["sync", "mark", "sync"]  # the fold was written
    assert holder.state.last_heartbeats == {ahead: later, behind: NOW, ME: NOW}


def test_the_state_holders_clock_is_the_one_every_part_reads() -> None:
    """One clock: the holder's. The heartbeat written, the last-call deadline, the
    expiry of other nodes' heartbeats and the operations' view of the time all follow it."""
    clock = FixedClock(NOW + timedelta(hours=1))
    state = _RendezvousState()
    state.last_heartbeats[_NodeDesc("stale", 1, 1)] = NOW  # an hour old on this clock
    backend = MemoryBackend()
    backend.store(state)
    settings = make_settings(1, 2)
    holder = BackendStateHolder(backend, settings, 0, clock)
    seen: list[datetime] = []

    def op(ctx: Context, deadline: Deadline) -> Action:
        seen.append(ctx.now)
        return Action.FINISH if ME in ctx.state.participants else Action.ADD_TO_PARTICIPANTS

    OpExecutor(ME, holder, settings).run(op, Deadline(100))
    written = backend.load()
    assert written.last_heartbeats == {ME: clock.at}
    assert written.deadline == clock.at + settings.timeout.last_call
    assert set(seen) == {clock.at}


class DroppingStore(DictStore):
    """A store whose wait for rank 0's address gives up, as :class:`EtcdStore`'s does at
    its timeout, after another node took rank 0 out of the round meanwhile: once both
    nodes wait for the address (each saw the round complete; a node dropped before it
    did would wait for the next round instead)."""

    def __init__(self, backend: MemoryBackend) -> None:
        super().__init__()
        self._backend = backend
        self._dropped = False
        self._waiting = 0

    def get(self, key: str) -> bytes:
        if not key.endswith("MASTER_ADDR"):
            return super().get(key)
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._waiting >= 2 or self._dropped, 10)
            if not self._dropped:
                state = self._backend.load()
                rank_0 = min(state.participants, key=state.participants.__getitem__)
                del state.participants[rank_0]
                del state.last_heartbeats[rank_0]
                self._backend.store(state)
                self._dropped = True
                self._cond.notify_all()
        raise LookupError(f"Key {key!r} not found in EtcdStore '/store/' within 1.2 s.")


def test_a_failed_address_exchange_says_who_left_the_round(
    handlers: list[DynamicRendezvousHandler],
) -> None:
    backend = MemoryBackend()
    store = DroppingStore(backend)
    handlers.extend(make_handler(backend, store, 2, 2, join_timeout=30) for _ in range(2))
    joiners = [Joiner(h) for h in handlers]
    errors: dict[int, str] = {}
    for joiner in joiners:
        with pytest.raises(RendezvousTimeoutError) as caught:
            joiner.join()
        errors[node_of(joiner.handler) == min(node_of(h) for h in handlers)] = str(caught.value)
    assert all("(store key 'torch.rendezvous.run.0/MASTER_ADDR')" in e for e in errors.values())
    common = r"within 1\.2 s\. Rank 0 of round 0 publishes its address once the round completed\. "
    assert re.search(
        common + r"This node is no longer a participant of round 0 of the rendezvous 'run' "
        r"\(its state is at round 0\): it was dropped",
        errors[True],  # rank 0
    ), errors
    assert re.search(
        common + r"Rank 0 of round 0, the node '127\.0\.0\.1_\d+_\d+', is no longer one of its "
        r"participants",
        errors[False],
    ), errors


class LosingStateHolder(FakeStateHolder):
    """Every write loses its race (another node wrote first), as under a flood of
    PyTorch's nodes' own heartbeats."""

    def sync(self, deadline: Deadline) -> bool | None:
        self.calls.append("sync")
        self._dirty, dirty = None, self._dirty
        return None if dirty is None else False


def test_the_aggregators_fold_ends_at_the_operations_deadline() -> None:
    """A fold whose writes keep losing their race is tried again at once on the newer
    state, but not past the deadline: the operation then decides (here: finishes)."""
    other = _NodeDesc("other", 1, 1)
    registry, monotonic = MemoryRegistry(), Clock()
    settings = make_settings(1, 3, interval=timedelta(seconds=5))
    state = _RendezvousState()
    holder = LosingStateHolder(state)
    keys = Admission(
        registry, ME, settings, monotonic, state_clock=holder.clock, progress_key=False
    )
    assert keys.join(Action.ADD_TO_PARTICIPANTS, state, None, Deadline(10)) is CHANGED
    registry.announce_node(other, 15)
    state.complete = True
    state.participants = {other: 0, ME: 1}
    state.last_heartbeats = {other: NOW, ME: NOW}
    monotonic.now += 5  # the next tick is due
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (
            OpExecutor(ME, holder, settings, keys).run(lambda c, d: Action.FINISH, Deadline(0.2)),
            done.set(),
        ),
        daemon=True,
    )
    thread.start()
    assert done.wait(5), f"the fold still retries: {holder.calls.count('sync')} syncs"
    assert holder.calls.count("mark") >= 2  # it did retry on the newer state


def test_a_node_not_in_the_state_it_holds_does_not_take_the_aggregator_lock() -> None:
    """A joiner waiting for another node's batch holds a state without itself (an empty
    one, before its first read): at its tick it refreshes its key, but does not take the
    free lock, whose fold would refresh nobody while keeping the others from taking it."""
    older = _NodeDesc("older", 1, 1)
    registry, monotonic = MemoryRegistry(), Clock()
    settings = make_settings(2, 3, interval=timedelta(seconds=5))
    registry.announce_node(older, 15)  # announced first: its batch admits us
    keys = Admission(
        registry, ME, settings, monotonic, state_clock=FixedClock(), progress_key=False
    )
    keys.begin()  # next_rendezvous() started
    outcome = keys.join(Action.ADD_TO_PARTICIPANTS, _RendezvousState(), None, Deadline(10))
    assert outcome is not CHANGED  # waits for the older node's batch
    monotonic.now += 5  # the tick is due
    assert not keys.fold(_RendezvousState(), False, Deadline(10))
    assert "claim" not in registry.calls
    assert registry.calls.get("refresh", 0) >= 1


def test_the_progress_line_says_what_the_node_waits_for() -> None:
    """The line a waiting node logs describes its own place: a complete round it is in
    is its call returning (nothing to say), not a round "without this node"."""
    me, other = _NodeDesc("a", 1, 0), _NodeDesc("b", 1, 0)
    settings = RendezvousSettings("run", 2, 3, RendezvousTimeout(), timedelta(seconds=5), 3)
    line = _dynamic_handler.progress_line
    state = _RendezvousState()
    state.participants = {other: 0}
    assert line(state, me, settings, 12.4) == (
        "Rendezvous 'run' round 0: 1 of 2 nodes joined (max 3), waiting for 1 more; 12 s left"
    )
    state.participants = {me: 0, other: 1}
    assert "in its last call" in (line(state, me, settings, 5.0) or "")
    state.complete = True
    assert line(state, me, settings, 5.0) is None
    state.participants = {other: 0, _NodeDesc("c", 1, 0): 1}
    assert "complete with 2 nodes without this node" in (line(state, me, settings, 5.0) or "")
    state.redundancy_list = {me}
    assert "this node is on the redundancy list" in (line(state, me, settings, 5.0) or "")
    state.closed = True
    assert line(state, me, settings, 5.0) is None


class _ReadAfresh(FakeStateHolder):
    """A holder whose next sync after :meth:`invalidate` reads ``fresh`` (what a batch
    wrote meanwhile)."""

    def __init__(self, fresh: _RendezvousState) -> None:
        super().__init__(_RendezvousState())
        self._fresh = fresh

    def invalidate(self) -> None:
        self.calls.append("invalidate")
        self._state = self._fresh


def _timing_out_with_a_key(
    fresh: _RendezvousState,
) -> tuple[_ReadAfresh, MemoryRegistry, Callable[[], None]]:
    """Our node, announced (its key written), about to time out waiting for a batch:
    the returned call runs PyTorch's join past its deadline on a held state without it;
    the state read afresh after the key's deletion is ``fresh``."""
    registry = MemoryRegistry()
    holder = _ReadAfresh(fresh)
    settings = make_settings(2, 2, interval=timedelta(seconds=5))
    keys = Admission(registry, ME, settings, state_clock=holder.clock, progress_key=False)
    keys.announce(Deadline(10))
    assert ME in registry.keys
    executor = OpExecutor(ME, holder, settings, keys)
    return holder, registry, lambda: executor.run(JoinOp(), Deadline(0))


def test_a_timed_out_join_deletes_its_key_then_writes_the_state_as_a_fence() -> None:
    """Not admitted: it writes the state as it is (a batch listed before the deletion
    then fails its compare-and-swap), and times out."""
    holder, registry, join = _timing_out_with_a_key(_RendezvousState())
    with pytest.raises(RendezvousTimeoutError):
        join()
    assert ME not in registry.keys
    assert holder.calls.index("invalidate") < holder.calls.index("mark")
    assert holder.calls[-1] == "sync"  # the write


def test_a_timed_out_join_finds_itself_admitted_and_returns_with_its_key() -> None:
    """A batch completed the round with the node meanwhile: it returns, as PyTorch's join
    does past its deadline, and writes its key again (a participant of ours has one)."""
    fresh = _RendezvousState()
    fresh.participants.update({ME: 0, _NodeDesc("other", 1, 1): 1})
    fresh.last_heartbeats.update(dict.fromkeys(fresh.participants, NOW))
    fresh.complete = True
    holder, registry, join = _timing_out_with_a_key(fresh)
    join()
    assert "invalidate" in holder.calls
    assert "mark" not in holder.calls  # nothing to write
    assert registry.calls["withdraw"] == 1
    assert ME in registry.keys  # written again


def test_a_timed_out_join_takes_itself_out_of_a_batch_that_admitted_it() -> None:
    fresh = _RendezvousState()
    fresh.participants.update({ME: 0})
    fresh.last_heartbeats[ME] = NOW
    holder, registry, join = _timing_out_with_a_key(fresh)
    with pytest.raises(RendezvousTimeoutError):
        join()
    assert ME not in registry.keys
    assert ME not in holder.state.participants  # PyTorch's roll back, written
    assert "mark" in holder.calls


def test_a_timed_out_join_that_finds_the_rendezvous_closed_says_so() -> None:
    fresh = _RendezvousState()
    fresh.closed = True
    holder, registry, join = _timing_out_with_a_key(fresh)
    with pytest.raises(RendezvousClosedError):
        join()
    assert ME not in registry.keys
    assert "mark" not in holder.calls  # a closed rendezvous admits nobody: no fence
