"""Unit tests of the node-key protocol (:mod:`etcd_rendezvous._dynamic.admission`) through
the admission's interface (what the executor asks it, on a state), with an in-memory
registry of keys and fake clocks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from etcd_rendezvous._dynamic.admission import (
    _REAP_STEP,
    _STAGGER_CAP,
    _TAIL_JITTER,
    ADMISSION_GRACE,
    ADMIT_GATHER,
    ADMIT_STAGGER,
    CHANGED,
    EXIT_GATHER,
    Admission,
    Changed,
    Refresh,
    Wait,
    grace_wait,
    stagger_wait,
)
from etcd_rendezvous._dynamic.keys import AnnouncedNode, Progress
from etcd_rendezvous._dynamic.ops import Action, rollback_action
from etcd_rendezvous._dynamic.progress import (
    PROGRESS_SILENCE,
    Heard,
    concerns,
    refusal_verdict,
)
from etcd_rendezvous._transport.limits import Refusal, Verdict
from etcd_rendezvous._transport.retry import Deadline
from etcd_rendezvous.api import RequestTooLargeError
from etcd_rendezvous.dynamic_rendezvous import (
    NodeDesc,
    RendezvousSettings,
    RendezvousState,
    RendezvousTimeout,
)

NOW = datetime(2000, 1, 1, tzinfo=timezone.utc)
A, B, C, D = (NodeDesc("host", 1, i) for i in range(4))


class MemoryRegistry:
    """Node keys and the aggregator lock in a dict; counts the calls."""

    def __init__(self) -> None:
        # Keys a listing still shows after they were deleted (as a lagging listing may).
        self.lingering: set[NodeDesc] = set()
        self.keys: dict[NodeDesc, int] = {}
        self.leaving: dict[NodeDesc, int] = {}
        self.lock: NodeDesc | None = None
        self.lock_ttl: int | None = None
        #: What ``expires_in`` answers for a node (unknown if absent).
        self.lifetimes: dict[NodeDesc, int | None] = {}
        self.index = 0
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def announce_node(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> int:
        self._count("announce")
        if node not in self.keys:
            self.index += 1
            self.keys[node] = self.index
        return self.keys[node]

    def refresh_node(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        self._count("refresh")
        return node in self.keys

    def withdraw_node(self, node: NodeDesc, deadline: Deadline | None = None) -> None:
        self._count("withdraw")
        self.keys.pop(node, None)
        self.leaving.pop(node, None)

    def mark_leaving(
        self, node: NodeDesc, round_: int, ttl: int, deadline: Deadline | None = None
    ) -> None:
        self._count("mark")
        self.announce_node(node, ttl)
        self.leaving[node] = round_

    def list_nodes(self, deadline: Deadline | None = None) -> list[AnnouncedNode]:
        self._count("list")
        keys = sorted(self.keys.items(), key=lambda e: e[1])
        return [AnnouncedNode(n, i, self.leaving.get(n)) for n, i in keys]

    def expires_in(self, node: NodeDesc, deadline: Deadline | None = None) -> int | None:
        self._count("expires_in")
        return self.lifetimes.get(node, 15) if node in self.keys else None

    def remove_expired(self, node: NodeDesc, deadline: Deadline | None = None) -> bool:
        self._count("remove_expired")
        if node not in self.lingering:
            self.keys.pop(node, None)
            self.leaving.pop(node, None)
        return True

    def aggregator(self, deadline: Deadline | None = None) -> NodeDesc | None:
        self._count("aggregator")
        return self.lock

    def claim_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        self._count("claim")
        self.lock_ttl = ttl
        if self.lock is None:
            self.lock = node
            return True
        return False

    def renew_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        self._count("renew")
        return self.lock == node

    def release_aggregator(self, node: NodeDesc, deadline: Deadline | None = None) -> None:
        if self.lock == node:
            self.lock = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def settings(interval: int = 5, attempts: int = 3) -> RendezvousSettings:
    return RendezvousSettings(
        "run", 1, 8, RendezvousTimeout(), timedelta(seconds=interval), attempts
    )


#: The time on the clock of the state's times while a test runs: the heartbeats a batch or
#: a fold writes carry it.
STATE_NOW = NOW + timedelta(microseconds=1)


class StateClock:
    """The clock of the state's times, standing at :data:`STATE_NOW`."""

    def now(self) -> datetime:
        return STATE_NOW


def keys_of(node: NodeDesc, registry: MemoryRegistry, clock: Clock, **kw: int) -> Admission:
    """``node``'s admission over ``registry``: it follows the progress key if the
    registry keeps one (a :class:`BoardRegistry`), else it waits for the keys older than
    its own (as it always does to leave a round)."""
    board = isinstance(registry, BoardRegistry)
    return Admission(
        registry, node, settings(**kw), clock, state_clock=StateClock(), progress_key=board
    )


def deadline() -> Deadline:
    return Deadline(60)


Outcome = list[NodeDesc] | Wait | Refresh


def admit(
    keys: Admission, *admitted: NodeDesc, token: int | None = None, others: int = 0
) -> Outcome:
    """The node of ``keys`` asks to join round 0 (incomplete) whose participants are
    ``admitted``, and ``others`` nodes without keys (more of them: others were admitted,
    progress). Returns the participants (but the others) once it made the batch, or else
    how long it waits for another node to make it, or :class:`Refresh`."""
    state = RendezvousState()
    state.participants.update(dict.fromkeys(admitted, 0))
    state.participants.update((NodeDesc("elsewhere", 9, i), 0) for i in range(others))
    outcome = keys.join(Action.ADD_TO_PARTICIPANTS, state, token, deadline())
    if outcome is not CHANGED:
        assert isinstance(outcome, (Wait, Refresh)), outcome
        return outcome
    return [node for node in state.participants if node.addr != "elsewhere"]


def leave(
    keys: Admission, round_: int, *participants: NodeDesc, waiting: Iterable[NodeDesc] = ()
) -> RendezvousState | Wait:
    """The node of ``keys`` asks to leave the complete round ``round_`` of
    ``participants`` (``waiting`` wait for the next): the state once it made the batch
    (those it took out are on the wait list), or else how long it waits for another node
    to make it."""
    state = RendezvousState()
    state.round, state.complete = round_, True
    state.participants.update(dict.fromkeys(participants, 0))
    state.wait_list.update(waiting)
    outcome = keys.join(Action.REMOVE_FROM_PARTICIPANTS, state, None, deadline())
    if outcome is not CHANGED:
        assert isinstance(outcome, Wait), outcome
        return outcome
    return state


def reap(keys: Admission, node: NodeDesc, round_: int, *blockers: NodeDesc) -> Outcome:
    """``node`` (of ``keys``) alone waits for the next round while ``blockers`` are the
    participants of the complete round ``round_``: those it took out, or how long it
    waits before looking again."""
    state = RendezvousState()
    state.round, state.complete = round_, True
    for blocker in blockers:
        state.participants[blocker] = 0
        state.last_heartbeats[blocker] = NOW
    state.wait_list.add(node)
    outcome = keys.reap(state, deadline())
    if outcome is not CHANGED:
        assert isinstance(outcome, Wait), outcome
        return outcome
    return [blocker for blocker in blockers if blocker not in state.participants]


def tick(keys: Admission, state: RendezvousState, clock: Clock) -> set[NodeDesc]:
    """The heartbeat of the node of ``keys``, once due: the nodes whose heartbeats in
    ``state`` its fold refreshed (none unless it aggregates)."""
    clock.now += keys.seconds_to_tick() or 0.0
    keys.fold(state, False, deadline())
    return {node for node, beat in state.last_heartbeats.items() if beat == STATE_NOW}


def hear(keys: Admission, timeout: float, token: int) -> Heard:
    """What the node of ``keys``, holding an empty state of ``token``, hears on the
    progress key within ``timeout``."""
    return keys.wait(RendezvousState(), token, timeout, deadline())


def wrote(keys: Admission, token: int, state: RendezvousState) -> None:
    """The node of ``keys`` wrote ``state``, its token ``token``."""
    keys.synced(state, token, True, False, deadline())


def read(keys: Admission, token: int, state: RendezvousState) -> None:
    """The node of ``keys`` read ``state``, its token ``token``."""
    keys.synced(state, token, None, True, deadline())


def waits(outcome: object) -> float:
    """The seconds of a :class:`Wait` (fails on anything else)."""
    assert isinstance(outcome, Wait), outcome
    return outcome.seconds


def test_the_oldest_waiting_node_admits_everyone_announced() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a, b = keys_of(A, registry, clock), keys_of(B, registry, clock)
    registry.announce_node(A, 15)  # A's key is the oldest (its answer was lost, say).
    assert waits(admit(b)) == pytest.approx(ADMISSION_GRACE)
    registry.announce_node(C, 15)  # Announced, not asking yet: admitted all the same.
    assert admit(a) == [A, B, C]
    assert registry.calls["list"] == 2  # One listing each, none more for the admitter.


def test_a_node_waits_until_its_predecessors_are_admitted() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a, b = keys_of(A, registry, clock), keys_of(B, registry, clock)
    assert admit(a) == [A]
    # A was admitted before: B does not wait (its batch lists A; the caller skips it).
    assert admit(b, A) == [A, B]
    c = keys_of(C, registry, clock)
    assert waits(admit(c, A)) == pytest.approx(ADMISSION_GRACE)
    clock.now += 1
    assert admit(c, A, B) == [A, B, C]


def test_a_predecessor_stuck_for_the_grace_period_is_admitted_with_the_others() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(D, 15)  # Slow: announced, but never makes its batch.
    a, b = keys_of(A, registry, clock), keys_of(B, registry, clock)
    assert waits(admit(a)) == pytest.approx(ADMISSION_GRACE)
    assert waits(admit(b)) == pytest.approx(ADMISSION_GRACE)
    clock.now += ADMISSION_GRACE / 2
    assert waits(admit(a)) == pytest.approx(ADMISSION_GRACE / 2)
    clock.now += ADMISSION_GRACE / 2
    # Its key is alive: D is slow, not dead. A admits it with everyone, in one batch.
    assert admit(a) == [D, A, B]


def test_admissions_of_others_reset_the_grace_period() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(D, 15)
    b = keys_of(B, registry, clock)
    assert waits(admit(b)) == pytest.approx(ADMISSION_GRACE)
    clock.now += ADMISSION_GRACE - 0.1
    # Another node was admitted meanwhile (by a batch of its own): progress.
    assert waits(admit(b, others=1)) == pytest.approx(ADMISSION_GRACE)
    clock.now += ADMISSION_GRACE - 0.1
    assert waits(admit(b, others=1)) == pytest.approx(0.1)


def test_a_predecessor_whose_key_is_gone_no_longer_blocks_after_the_grace_period() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(D, 15)
    b = keys_of(B, registry, clock)
    assert isinstance(admit(b), Wait)
    registry.withdraw_node(D)
    clock.now += ADMISSION_GRACE
    assert admit(b) == [B]


def test_a_leaving_node_marks_its_key_once_per_round() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a = keys_of(A, registry, clock)
    # It lets the others of the round ask too before it lists the keys.
    assert waits(leave(a, 3, A, B)) == pytest.approx(EXIT_GATHER)
    assert waits(leave(a, 3, A, B)) == pytest.approx(EXIT_GATHER)
    assert registry.calls == {"announce": 2, "mark": 1}  # Announced, then marked.
    assert registry.leaving == {A: 3}
    leave(a, 4, A, B)
    assert registry.calls["mark"] == 2
    assert registry.leaving == {A: 4}
    a.withdraw(deadline())
    assert registry.leaving == {}


def test_the_oldest_leaving_node_takes_out_everyone_who_asked() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a, b, c = (keys_of(n, registry, clock) for n in (A, B, C))
    for node, keys in zip((A, B, C), (a, b, c)):
        keys.begin()
        registry.announce_node(node, 15)
    assert waits(leave(c, 3, A, B, C)) == pytest.approx(EXIT_GATHER)
    assert waits(leave(b, 3, A, B, C)) == pytest.approx(EXIT_GATHER)
    assert "list" not in registry.calls
    clock.now += EXIT_GATHER
    # C sees B asking to leave: B makes the batch.
    assert waits(leave(c, 3, A, B, C)) == pytest.approx(ADMISSION_GRACE)
    # B sees nobody older asking (A is a participant that stays): its batch takes out
    # everyone whose key says it leaves; they wait for the next round.
    state = leave(b, 3, A, B, C)
    assert isinstance(state, RendezvousState)
    assert list(state.participants) == [A]
    assert state.wait_list == {B, C}


class MarkAfterFirstListing(MemoryRegistry):
    """A registry in which node A asks to leave round 3 just after the first listing."""

    def list_nodes(self, deadline: Deadline | None = None) -> list[AnnouncedNode]:
        listing = super().list_nodes()
        if self.calls["list"] == 1:
            self.leaving[A] = 3
        return listing


def test_an_older_node_asking_to_leave_after_our_listing_makes_the_batch() -> None:
    registry, clock = MarkAfterFirstListing(), Clock()
    registry.announce_node(A, 15)
    registry.announce_node(D, 15)  # Waits for its admission.
    b = keys_of(B, registry, clock)
    assert waits(leave(b, 3, A, B)) == pytest.approx(EXIT_GATHER)
    clock.now += EXIT_GATHER
    assert waits(leave(b, 3, A, B)) == pytest.approx(ADMISSION_GRACE)  # D's turn.
    # D was admitted (to the wait list). The attempt's listing showed A staying; the
    # listing taken for the batch shows it leaving: A makes the batch.
    assert waits(leave(b, 3, A, B, waiting=[D])) == pytest.approx(ADMISSION_GRACE)
    assert registry.calls["list"] == 2
    a = keys_of(A, registry, clock)
    assert waits(leave(a, 3, A, B, waiting=[D])) == pytest.approx(EXIT_GATHER)
    clock.now += EXIT_GATHER
    # A and B leave: the round ends, and the batch admits everyone to the next one, D
    # (which waited) first.
    state = leave(a, 3, A, B, waiting=[D])
    assert isinstance(state, RendezvousState)
    assert (state.round, list(state.participants)) == (4, [D, A, B])


def state_with(*nodes: NodeDesc, age: float = 0.0) -> RendezvousState:
    state = RendezvousState()
    for node in nodes:
        state.participants[node] = 0
        state.last_heartbeats[node] = NOW - timedelta(seconds=age)
    return state


def test_ticks_refresh_the_key_and_the_aggregator_folds_live_keys() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a = keys_of(A, registry, clock)
    assert not a.tick_due()
    admit(a)
    assert registry.lock == A  # The first admitter aggregates from the start.
    registry.announce_node(B, 15)
    assert a.seconds_to_tick() == pytest.approx(5)
    clock.now += 5
    assert a.tick_due()
    pytorch_node = NodeDesc("torch-host", 2, 0)  # No key: it heartbeats itself.
    state = state_with(A, B, pytorch_node, age=7)
    assert tick(a, state, clock) == {A, B}
    assert registry.lock == A
    assert a.seconds_to_tick() == pytest.approx(5)
    # Ticks renew the lock without reading it.
    clock.now += 5
    assert tick(a, state_with(A, B, age=1), clock) == {A, B}
    assert registry.calls["aggregator"] == 1
    assert registry.calls["renew"] == 2


def test_a_node_whose_heartbeat_falls_due_between_ticks_takes_over_a_lapsed_lock() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(A, 15)
    registry.lock = A
    b = keys_of(B, registry, clock)
    admit(b, A)
    assert tick(b, state_with(A, B, age=4), clock) == set()  # A folds.
    clock.now += 1
    assert not b.tick_due()
    period = b.heartbeat_period(timedelta(seconds=5)).total_seconds()
    # Not due yet: nothing until the next tick.
    assert not b.fold(state_with(A, B, age=period - 0.5), False, deadline())
    # A died: its lock lapses before B's heartbeat falls due (the lock lives 7 s of the
    # 7.5 s at which the earliest node writes its own), so B, looking at the lock first,
    # takes over and folds everyone instead of writing its own heartbeat.
    registry.lock = None
    state = state_with(A, B, age=period)
    assert b.fold(state, False, deadline())
    assert registry.lock == B
    assert registry.lock_ttl is not None
    assert 5 < registry.lock_ttl < 1.5 * 5
    assert {n for n, beat in state.last_heartbeats.items() if beat == STATE_NOW} == {A, B}


def test_nobody_looks_at_the_lock_while_its_heartbeat_is_fresh() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(A, 15)
    registry.lock = A
    b = keys_of(B, registry, clock)
    admit(b, A)
    registry.calls.clear()
    assert tick(b, state_with(A, B, age=5), clock) == set()
    assert "aggregator" not in registry.calls
    assert registry.calls["refresh"] == 1
    # Late: it looks, finds the lock held, and leaves it be.
    assert tick(b, state_with(A, B, age=8), clock) == set()
    assert registry.calls["aggregator"] == 1
    # The holder is gone (its lock lapsed): it takes over.
    registry.lock = None
    assert tick(b, state_with(A, B, age=8), clock) == {A, B}
    assert registry.lock == B


def test_a_node_dropped_from_the_state_deletes_its_key() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a = keys_of(A, registry, clock)
    admit(a)
    assert registry.lock == A  # The first admitter aggregates.
    assert tick(a, state_with(B), clock) == set()
    assert A not in registry.keys
    assert registry.lock is None
    assert not a.announced
    assert a.seconds_to_tick() is None


def test_a_joining_node_keeps_its_key_and_an_expired_key_is_recreated() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a = keys_of(A, registry, clock)
    a.begin()
    admit(a)
    del registry.keys[A]  # Expired.
    assert tick(a, state_with(), clock) == set()
    assert A in registry.keys
    a.end()


def test_the_heartbeat_period_of_a_node_with_a_key() -> None:
    registry, clock = MemoryRegistry(), Clock()
    interval = timedelta(seconds=5)
    a = keys_of(A, registry, clock, attempts=3)
    assert a.heartbeat_period(interval) == interval
    admit(a)
    assert 1.5 * interval <= a.heartbeat_period(interval) <= 2 * interval
    # Never later than a PyTorch node's worst case (two intervals), however long the
    # heartbeat lives.
    c = keys_of(C, registry, clock, attempts=5)
    admit(c)
    assert 1.5 * interval <= c.heartbeat_period(interval) <= 2 * interval
    # Drawn per node: the nodes do not all write at once when the aggregator dies.
    periods = {keys_of(D, registry, clock).heartbeat_period(interval) for _ in range(2)}
    assert periods == {interval}  # (no key yet)
    drawn = set()
    for i in range(8):
        node = keys_of(NodeDesc("many", 1, i), registry, clock)
        admit(node)
        drawn.add(node.heartbeat_period(interval))
    assert len(drawn) > 1
    b = keys_of(B, registry, clock, attempts=1)
    admit(b)
    assert b.heartbeat_period(interval) == interval


def test_a_node_with_a_key_looks_at_its_heartbeat_when_it_falls_due() -> None:
    registry, clock = MemoryRegistry(), Clock()
    a = keys_of(A, registry, clock, interval=5, attempts=3)
    assert a.heartbeat_due(state_with(A, age=4.0), STATE_NOW) is None  # no key
    admit(a)
    period = a.heartbeat_period(timedelta(seconds=5)).total_seconds()
    # Due within the next interval: the timer runs again then.
    age = period - 2.0
    due = a.heartbeat_due(state_with(A, age=age), NOW)
    assert due == pytest.approx(2.0)
    # Due later than the next interval, or not in the state: the timer keeps its
    # interval.
    assert a.heartbeat_due(state_with(A, age=period - 6.0), NOW) is None
    assert a.heartbeat_due(state_with(B, age=age), NOW) is None
    # Already due (it fell due since the run looked): at once.
    assert a.heartbeat_due(state_with(A, age=period + 1.0), NOW) == 0.0
    # With keep_alive_max_attempt < 3, PyTorch's rule: one interval, every interval.
    b = keys_of(B, registry, clock, interval=5, attempts=2)
    admit(b)
    assert b.heartbeat_due(state_with(B, age=4.0), NOW) is None


def test_the_first_waiting_node_takes_out_a_participant_whose_key_expired() -> None:
    registry, clock = MemoryRegistry(), Clock()
    for node in (A, B, C):
        registry.announce_node(node, 15)
    registry.lifetimes[C] = 9
    b = keys_of(B, registry, clock)
    # Round 3 is complete; A and B left it and wait; C did not ask (it died).
    # C's key has 9 s to live: look again when it may have expired (whole seconds, so
    # up to one second early, and then every _REAP_STEP seconds).
    assert waits(reap(b, B, 3, C)) == pytest.approx(8 + _REAP_STEP)
    assert registry.calls["list"] == 1
    # A state change in between does not make it list again.
    clock.now += 4
    assert waits(reap(b, B, 3, C)) == pytest.approx(4 + _REAP_STEP)
    assert registry.calls["list"] == 1
    clock.now += 4 + _REAP_STEP
    registry.keys.pop(C)  # expired
    assert reap(b, B, 3, C) == [C]


@pytest.mark.parametrize("lifetime", [0, None], ids=["v3-last-second", "v2-past-expiry"])
def test_a_listed_key_without_a_whole_second_left_counts_as_gone(lifetime: int | None) -> None:
    registry, clock = MemoryRegistry(), Clock()
    for node in (B, C):
        registry.announce_node(node, 15)
    registry.lifetimes[C] = lifetime
    b = keys_of(B, registry, clock)
    assert reap(b, B, 3, C) == [C]


def test_a_participant_never_listed_with_a_key_is_left_to_its_heartbeat() -> None:
    registry, clock = MemoryRegistry(), Clock()
    registry.announce_node(B, 15)
    b = keys_of(B, registry, clock, interval=5)
    # D is PyTorch's node (no key): not judged; B looks again every interval.
    assert waits(reap(b, B, 3, D)) == pytest.approx(5)
    clock.now += 5
    assert waits(reap(b, B, 3, D)) == pytest.approx(5)


def test_reaping_reads_at_most_two_lifetimes_and_looks_each_interval_for_the_rest() -> None:
    registry, clock = MemoryRegistry(), Clock()
    for node in (A, B, C, D):
        registry.announce_node(node, 15)
    registry.lifetimes.update({A: 14, C: 14, D: 2})
    b = keys_of(B, registry, clock, interval=5)
    # A and C are probed (14 s left); D, which would expire first, is not: the interval.
    assert waits(reap(b, B, 3, A, C, D)) == pytest.approx(5)
    assert registry.calls["expires_in"] == 2
    # A new round starts afresh.
    assert waits(reap(b, B, 4, D)) == pytest.approx(1 + _REAP_STEP)


def test_a_reaped_key_is_deleted_so_that_no_other_node_admits_its_node() -> None:
    registry, clock = MemoryRegistry(), Clock()
    for node in (A, B, C):
        registry.announce_node(node, 15)
    registry.lifetimes[C] = 0
    a, b = keys_of(A, registry, clock), keys_of(B, registry, clock)
    # B, first of the wait list, takes C out; A makes the next round's batch from a
    # listing of its own, which must not show C.
    assert reap(b, B, 3, C) == [C]
    assert registry.calls["remove_expired"] == 1
    assert admit(a) == [A, B]


def _c_reaped_by_b_but_still_listed() -> tuple[MemoryRegistry, Admission]:
    """B and C announced; C's key read 0 s left, and B's delete of it did not remove the
    key listings show (etcd had not deleted it yet, or C renewed it in between)."""
    registry = MemoryRegistry()
    for node in (B, C):
        registry.announce_node(node, 15)
    registry.lifetimes[C] = 0
    registry.lingering.add(C)
    b = keys_of(B, registry, Clock())
    assert reap(b, B, 3, C) == [C]
    return registry, b


def test_a_key_taken_for_dead_is_left_out_of_batches_until_etcd_deletes_it() -> None:
    registry, b = _c_reaped_by_b_but_still_listed()
    # etcd still lists C's key: the next round's batch must not admit C again.
    assert admit(b) == [B]
    # Once etcd deleted it, a key C announces again (a new index) is C's to use.
    registry.keys.pop(C)
    assert admit(b) == [B]
    registry.announce_node(C, 15)
    assert admit(b) == [B, C]


def test_a_key_taken_for_dead_that_is_renewed_after_all_is_admitted_again() -> None:
    """A v3 lease reading 0 s had under a second left: its node may still renew it."""
    registry, b = _c_reaped_by_b_but_still_listed()
    # Still at 0 s when the next listing probes it: still left out.
    probes = registry.calls["expires_in"]
    assert admit(b) == [B]
    assert registry.calls["expires_in"] == probes + 1
    # C renewed its key in its last second (same key, same index): admitted again.
    registry.lifetimes[C] = 15
    assert admit(b) == [B, C]
    # Forgiven for good: no more probes of it when listing.
    probes = registry.calls["expires_in"]
    assert admit(b) == [B, C]
    assert registry.calls["expires_in"] == probes


# -- the progress key and the candidate admitters ----------------------------------------


class BoardRegistry(MemoryRegistry):
    """A registry with a progress key: its value, and the changes a watch would deliver
    (``None`` for garbage or a deletion); ``listed_at`` is the index of the last listing."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.progress: Progress | None = None
        self.exists = False
        self.progress_index = 0
        self.changes: list[tuple[Progress | None, int]] = []
        self.written: list[Progress] = []
        self.listed_at = 0
        #: The index at which the last read of the state found none (``None``: found one).
        self.absent_at: int | None = None
        #: etcd's request limit, in bytes (``None``: none).
        self.limit: int | None = None

    def list_nodes(self, deadline: Deadline | None = None) -> list[AnnouncedNode]:
        self.listed_at = self.index
        return super().list_nodes()

    def read_progress(
        self, deadline: Deadline | None = None
    ) -> tuple[Progress | None, int | None, int]:
        self._count("read_progress")
        return self.progress, self.progress_index if self.exists else None, self.index

    def create_progress(self, progress: Progress, deadline: Deadline | None = None) -> int | None:
        if self.exists:
            return None
        return self._put(progress)

    def write_progress(
        self, progress: Progress, index: int, deadline: Deadline | None = None
    ) -> int | None:
        self._count("write_progress")
        held = self.progress if self.exists and index != self.progress_index else None
        if held is not None and held.newness >= progress.newness:
            return None  # a summary at least as new: kept
        return self._put(progress)

    def replace_progress(
        self, progress: Progress, index: int, deadline: Deadline | None = None
    ) -> int | None:
        self._count("replace_progress")
        if self.exists and index != self.progress_index:
            return None
        return self._put(progress)

    def _put(self, progress: Progress) -> int:
        self.index += 1
        self.progress, self.exists, self.progress_index = progress, True, self.index
        self.written.append(progress)
        return self.index

    def wait_progress(
        self, after: int, timeout: float, deadline: Deadline | None = None
    ) -> list[tuple[Progress | None, int]]:
        self._count("wait_progress")
        changes, self.changes = self.changes, []
        if not changes:
            self.clock.now += timeout  # nothing came: the wait lasted its timeout
        return changes

    def stop_waiting(self) -> None:
        self._count("stop_waiting")

    def check_size(self, size: int, deadline: Deadline | None = None) -> None:
        """etcd accepts ``size`` bytes unless ``limit`` (bytes) is below it."""
        self._count("check_size")
        if self.limit is not None and size > self.limit:
            raise RequestTooLargeError(f"{size} bytes: too large", key="/state", size=size)

    def publish(self, progress: Progress) -> None:
        """Another node wrote ``progress``: the key holds it and watches deliver it
        (written after the state and the listing it describes, as etcd orders them)."""
        self.index = max(self.index, progress.token, progress.decided_upto) + 1
        self.progress, self.exists, self.progress_index = progress, True, self.index
        self.changes.append((progress, self.index))


def summary(token: int, decided: int, *, complete: bool = False, count: int = 0) -> Progress:
    return Progress(token, 0, complete, False, decided, count, 0)


def joining(node: NodeDesc, registry: BoardRegistry, clock: Clock) -> Admission:
    keys = keys_of(node, registry, clock)
    keys.begin()
    return keys


def test_the_stagger_grows_with_the_distance_and_is_capped() -> None:
    # The oldest: after a moment to gather the nodes arriving with it.
    assert stagger_wait(created=12, decided_upto=10, idle=0.0) == pytest.approx(ADMIT_GATHER)
    assert stagger_wait(created=12, decided_upto=10, idle=ADMIT_GATHER) == 0.0
    second = stagger_wait(created=13, decided_upto=10, idle=0.0)
    assert second == pytest.approx(ADMIT_GATHER + ADMIT_STAGGER)
    assert stagger_wait(created=13, decided_upto=10, idle=ADMIT_GATHER + ADMIT_STAGGER) == 0.0
    far = stagger_wait(created=10_000, decided_upto=10, idle=0.0, jitter=0.5)
    assert far == pytest.approx(ADMIT_GATHER + _STAGGER_CAP * ADMIT_STAGGER + 0.5 * _TAIL_JITTER)


def test_a_node_far_behind_never_lists_while_batches_are_made() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    for _ in range(30):  # other nodes' keys: A is far behind the decided index
        registry.index += 1
    decided = registry.index
    registry.publish(summary(5, decided))
    far = joining(B, registry, clock)
    registry.index += 40  # forty more nodes announce after the decided index, before B
    registry.keys.pop(B, None)
    registry.announce_node(B, 15)
    for token in range(6, 16):  # a batch every half step: progress all the time
        outcome = admit(far, token=token)
        assert isinstance(outcome, Wait)
        assert outcome.seconds > 0
        clock.now += ADMIT_STAGGER / 2
        registry.publish(summary(token + 1, decided))
        assert hear(far, 1.0, token) is Heard.KEEP
    assert registry.calls.get("list", 0) == 0
    del keys


def test_a_summary_of_the_same_state_deciding_more_keys_moves_a_candidate_up() -> None:
    """A relay of a batch's state may reach the progress key before the batch's own
    summary, with the decided index the relay knew; the batch's summary of the same state
    then decides more keys. A candidate waiting far behind hears that at once (without
    waiting out its stagger), and takes its turn as the first key after the index."""
    clock = Clock()
    registry = BoardRegistry(clock)
    registry.publish(summary(5, 1))
    keys = joining(A, registry, clock)
    registry.index += 40  # forty nodes announce before A, after the decided index
    far = waits(admit(keys, token=5))
    assert far >= ADMIT_GATHER + _STAGGER_CAP * ADMIT_STAGGER
    registry.publish(summary(50, 1))  # a relay of the batch's state
    assert hear(keys, far, 5) is Heard.KEEP
    registry.publish(summary(50, 46))  # the batch's own: its listing decided A's elders
    heard_at = clock.now
    assert hear(keys, far, 5) is Heard.KEEP
    assert clock.now == heard_at  # at once, not at the end of the stagger
    assert waits(admit(keys, token=5)) == pytest.approx(ADMIT_GATHER)


def test_a_slow_head_is_admitted_by_its_successor() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    head, next_ = joining(A, registry, clock), joining(B, registry, clock)
    # A creates the progress key, then both announce: A's key is the oldest undecided.
    assert waits(admit(head, token=0)) == pytest.approx(ADMIT_GATHER)
    clock.now += 2 * ADMIT_GATHER
    assert admit(head, token=0) == [A]
    registry.keys.pop(A)  # start over: A announced, but is slow to make its batch
    registry.keys[A] = registry.index
    assert waits(admit(next_, token=0)) > 0
    clock.now += ADMIT_STAGGER * (_STAGGER_CAP + 2)  # no progress from A all that time
    assert admit(next_, token=0) == [A, B]
    assert not any("dead" in name for name in registry.calls)


def test_a_candidate_holding_an_older_state_than_the_hint_reads_it_first() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    registry.publish(summary(7, 7))  # a state newer than the one A read (token 3)
    keys = joining(A, registry, clock)
    assert isinstance(admit(keys, token=3), Wait)
    clock.now += 2 * ADMIT_GATHER
    assert admit(keys, token=3) == Refresh()
    assert admit(keys, token=7) == [A]


def test_the_hint_is_never_trusted_over_the_state() -> None:
    state = RendezvousState()
    state.round = 2
    # A summary of an older (or the same) state than the one held tells nothing.
    assert not concerns(summary(5, 100, complete=True), 5, state, A, 10, 2)
    assert not concerns(summary(4, 100, complete=True), 5, state, A, 10, 2)
    # A newer one that completes the round, or starts the last call: read the state.
    newer = Progress(6, 2, True, False, 100, 2, 0)
    assert concerns(newer, 5, state, A, 10, 2)
    assert concerns(Progress(6, 2, False, False, 0, 2, 0), 5, state, A, 10, 2)
    # Our key decided while the round is incomplete: wait for the round to complete.
    assert not concerns(Progress(6, 2, False, False, 100, 1, 0), 5, state, A, 10, 2)


def test_a_silent_progress_key_sends_the_node_to_the_key_then_the_state() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    admit(keys, token=0)
    assert hear(keys, 0.5, 0) is Heard.KEEP
    clock.now += PROGRESS_SILENCE
    assert hear(keys, 0.5, 0) is Heard.READ
    # Garbage (or a deletion) in the key is no change: silence again, then the state.
    registry.changes.append((None, registry.index + 1))
    assert hear(keys, 0.5, 0) is Heard.KEEP
    # The next silence is drawn between one and two PROGRESS_SILENCE (nodes spread out).
    assert hear(keys, 2 * PROGRESS_SILENCE, 0) is Heard.READ


def test_a_watch_lagging_behind_the_key_is_caught_up_by_a_read_of_the_key() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    admit(keys, token=0)
    registry.progress = summary(9, 0)  # written, but the watch has not delivered it
    registry.index = registry.progress_index = 20
    clock.now += PROGRESS_SILENCE
    assert hear(keys, 0.5, 0) is Heard.KEEP  # not ours
    registry.progress = Progress(10, 0, True, False, 0, 1, 0)
    registry.index = registry.progress_index = 21
    clock.now += 2 * PROGRESS_SILENCE
    assert hear(keys, 0.5, 0) is Heard.READ  # complete


def test_a_state_the_key_does_not_describe_is_relayed_and_ours_summarised() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    admit(keys, token=0)
    decided = registry.listed_at
    state = RendezvousState()
    state.participants[A] = 0
    wrote(keys, 20, state)  # our batch: it decided up to its listing
    assert registry.written[-1] == Progress(20, 0, False, False, decided, 1, 0)
    read(keys, 20, state)  # read, and the key describes it: nothing
    assert len(registry.written) == 2
    read(keys, 25, state)  # PyTorch's worker wrote 25: relay it
    assert registry.written[-1] == Progress(25, 0, False, False, decided, 1, 0)
    registry.publish(Progress(27, 0, True, False, decided + 5, 1, 0))  # not heard yet
    read(keys, 27, state)  # a relay never overwrites a newer summary
    assert registry.progress == Progress(27, 0, True, False, decided + 5, 1, 0)
    keys.end()
    read(keys, 30, state)  # not following the key: no relay
    assert registry.written[-1].token == 25
    assert registry.calls["stop_waiting"] == 1


def test_each_summary_publishes_the_writers_heartbeat_lifetime() -> None:
    """The operator commands judge a run by how long its nodes may stay silent: every
    summary a node writes says it (``keep_alive_interval`` x ``keep_alive_max_attempt``).
    Readers of an older version ignore the field; a summary of an older writer, without
    it, reads as the same summary, with no lifetime."""
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = keys_of(A, registry, clock, interval=7, attempts=4)
    keys.begin()
    admit(keys, token=0)
    state = RendezvousState()
    state.participants[A] = 0
    wrote(keys, 20, state)
    written = registry.written[-1]
    assert written.lifetime == 28
    value = json.loads(written.encode())
    assert value["lifetime"] == 28
    assert Progress.decode(written.encode()) == written
    decoded = Progress.decode(written.encode())
    assert decoded is not None
    assert decoded.lifetime == 28
    del value["lifetime"]
    older = Progress.decode(json.dumps(value))
    assert older == written
    assert older is not None
    assert older.lifetime == 0
    for garbage in ("7", -1, True, 2.5):
        garbled = Progress.decode(json.dumps({**value, "lifetime": garbage}))
        assert garbled == written  # the summary stands; its lifetime is not said
        assert garbled is not None
        assert garbled.lifetime == 0


def test_a_summary_beyond_its_own_write_is_never_heard() -> None:
    """A summary claims a state (or a listing) written after the summary itself: garbage
    that reads as one. A candidate does not wait for it: it makes its batch."""
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    assert isinstance(admit(keys, token=0), Wait)
    registry.index += 1
    lie = Progress(10**12, 0, False, False, 10**12, 0, 0)
    registry.progress, registry.progress_index = lie, registry.index
    registry.changes.append((lie, registry.index))
    assert hear(keys, 1.0, 0) is Heard.KEEP
    clock.now += 2 * ADMIT_GATHER
    assert admit(keys, token=0) == [A]


def test_a_summary_of_a_state_no_read_finds_is_dropped_after_a_read() -> None:
    """A summary written after the token it claims, but of no state a read finds (a token
    above the state's): the read of the state drops it, and what it said was decided; the
    candidate makes its batch, and the key is relayed the state read."""
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    assert isinstance(admit(keys, token=3), Wait)
    registry.index += 1000
    lie = Progress(registry.index - 1, 0, False, False, registry.index - 1, 0, 0)
    registry.publish(lie)
    hear(keys, 1.0, 3)
    outcomes = []
    for _ in range(5):  # wait, read the state when told (or after a silence), ask again
        outcome = admit(keys, token=3)
        outcomes.append(outcome)
        if isinstance(outcome, list):
            break
        if isinstance(outcome, Wait):
            clock.now += outcome.seconds
            hear(keys, outcome.seconds, 3)
        read(keys, 3, RendezvousState())
    assert isinstance(outcomes[-1], list), outcomes
    assert A in outcomes[-1]
    # The read replaced the lie with a summary of the state it found.
    assert registry.progress is not None
    assert registry.progress.token == 3


def test_a_summary_is_forgotten_for_a_state_found_absent_only_by_a_member_that_is_not_behind() -> (
    None
):
    """A read that finds no state drops the summary of a state (that state was deleted
    since), unless the read was served at an index older than the summary's state: a
    member behind the others, which has not seen the state yet, proves nothing, and
    dropping the summary would write one of no state over it, for every node to
    relay back."""
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining(A, registry, clock)
    assert isinstance(admit(keys, token=0), Wait)
    held = summary(40, 30)
    registry.publish(held)
    hear(keys, 1.0, 0)
    written = len(registry.written)
    registry.absent_at = 12  # a member behind: it has not seen the state of 40 yet
    keys.synced(RendezvousState(), None, None, True, deadline())
    assert registry.progress == held
    assert len(registry.written) == written
    registry.absent_at = registry.index + 1  # the state was deleted after that write
    keys.synced(RendezvousState(), None, None, True, deadline())
    assert registry.progress is not None
    assert registry.progress.token == 0


# -- reports of a batch refused for its size -------------------------------------------------


def report(
    token: int,
    upto: int,
    *,
    count: int = 4,
    round_: int = 0,
    complete: bool = False,
    decided: int = 0,
) -> Progress:
    """The summary of the state of ``token`` reporting that etcd refused a batch on it of
    ``count`` participants, made from a listing at ``upto``."""
    answer = "etcdserver: request is too large (gRPC code 3, HTTP 400)"
    refusal = Refusal(
        upto, count, False, "the node 'maker'", "/state", 5000, "http://e", answer, "v3"
    )
    return Progress(token, round_, complete, False, decided, 2, 0, refused=refusal)


def joining_round(node: NodeDesc, registry: BoardRegistry, clock: Clock) -> Admission:
    """``node`` joining a round of at least 4 nodes (at most 8)."""
    at_least_4 = RendezvousSettings("run", 4, 8, RendezvousTimeout(), timedelta(seconds=5), 3)
    keys = Admission(registry, node, at_least_4, clock, state_clock=StateClock())
    keys.begin()
    return keys


def round_state(round_: int = 0, complete: bool = False, *admitted: NodeDesc) -> RendezvousState:
    state = RendezvousState()
    state.round, state.complete = round_, complete
    state.participants.update(dict.fromkeys(admitted, 0))
    return state


@pytest.mark.parametrize(
    ("the_report", "token", "state", "created", "expected"),
    [
        pytest.param(report(5, 30), 5, round_state(), 20, Verdict.FAIL, id="cannot-complete"),
        pytest.param(report(5, 30), 0, round_state(), 20, Verdict.FAIL, id="fresh-node"),
        pytest.param(report(5, 30), 5, round_state(), 45, Verdict.VERIFY, id="late-checks-etcd"),
        pytest.param(
            report(5, 30, count=5), 5, round_state(), 20, Verdict.FAIL, id="in-the-refused-batch"
        ),
        pytest.param(
            report(5, 30, count=5, decided=25),
            5,
            round_state(),
            20,
            Verdict.IGNORE,
            id="decided-and-the-round-can-complete",
        ),
        pytest.param(
            report(5, 10, count=5), 5, round_state(), 20, Verdict.IGNORE, id="not-in-the-batch"
        ),
        pytest.param(
            report(5, 30), 9, round_state(1), 20, Verdict.IGNORE, id="a-later-round-ignores-it"
        ),
        pytest.param(
            report(5, 30), 9, round_state(0, True), 20, Verdict.IGNORE, id="the-round-completed"
        ),
        pytest.param(
            report(5, 30),
            9,
            round_state(),
            20,
            Verdict.FAIL,
            id="a-heartbeat-since-changes-nothing",
        ),
        pytest.param(
            report(5, 30, count=5),
            9,
            round_state(0, False, A),
            20,
            Verdict.IGNORE,
            id="admitted-since-by-a-smaller-batch",
        ),
        pytest.param(
            report(5, 30, complete=True, count=9),
            5,
            round_state(0, True),
            20,
            Verdict.FAIL,
            id="a-wait-list-addition-refused",
        ),
        pytest.param(report(5, 30), 5, round_state(), None, Verdict.IGNORE, id="not-announced"),
        pytest.param(
            Progress(5, 0, False, False, 0, 2, 0), 5, round_state(), 20, Verdict.IGNORE, id="plain"
        ),
    ],
)
def test_refusal_verdict(
    the_report: Progress,
    token: int,
    state: RendezvousState,
    created: int | None,
    expected: Verdict,
) -> None:
    """What node A, joining a round of at least 4 with its key created at ``created`` and
    holding ``state`` (read with ``token``), does about a report written at index 40 of a
    refused batch listed up to ``upto``, of 4 participants (the round cannot complete)
    unless said (5: a round of 4 might)."""
    assert refusal_verdict(the_report, 40, token, state, A, created, 4) is expected


def test_a_waiting_node_raises_a_report_that_concerns_it() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining_round(A, registry, clock)
    assert isinstance(admit(keys, token=0), Wait)
    registry.publish(report(0, registry.index))
    with pytest.raises(RequestTooLargeError, match="--max-request-bytes") as info:
        hear(keys, 1.0, 0)
    assert "request is too large" in str(info.value)
    assert "the node 'maker'" in str(info.value)
    assert registry.calls.get("check_size", 0) == 0  # it was there: no need to ask etcd


def test_a_node_that_arrives_after_a_report_asks_etcd_then_writes_it_again() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    registry.index = 30
    registry.publish(report(0, 30))
    registry.limit = 4096  # under the refused size: etcd still refuses it
    keys = joining_round(B, registry, clock)
    assert isinstance(admit(keys, token=0), Wait)
    with pytest.raises(RequestTooLargeError):
        hear(keys, 1.0, 0)
    assert registry.calls["check_size"] == 1
    assert registry.progress == report(0, 30)
    assert registry.progress_index > registry.keys[B]  # for those who came with B


def test_a_report_etcd_no_longer_confirms_is_dropped() -> None:
    """etcd's limit was raised since (and the run started again): the report left in the
    key fails nobody, and is replaced by the summary alone."""
    clock = Clock()
    registry = BoardRegistry(clock)
    registry.index = 30
    registry.publish(report(0, 30))
    keys = joining_round(B, registry, clock)
    assert isinstance(admit(keys, token=0), Wait)
    hear(keys, 1.0, 0)
    hear(keys, 1.0, 0)
    assert registry.calls["check_size"] == 1
    assert registry.progress == dataclasses.replace(report(0, 30), refused=None)


def test_a_refused_batch_is_reported_with_the_summary_of_the_state_it_replaced() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining_round(A, registry, clock)
    admit(keys, token=0)
    held = round_state(0, False, C)
    read(keys, 7, held)
    clock.now += 2 * ADMIT_GATHER
    assert admit(keys, token=7) == [A]
    refused = RequestTooLargeError("refused", key="/state", size=9000, endpoint="e", api="v3")
    # The state refused would have had 5 participants, the round incomplete.
    would_have = round_state(0, False, A, B, C, D, NodeDesc("more", 1, 0))
    keys.refused(refused, would_have, 7, deadline())
    written = registry.written[-1]
    assert dataclasses.replace(written, refused=None) == Progress.of(7, held, 0)
    assert written.refused is not None
    assert (written.refused.upto, written.refused.count, written.refused.size) == (
        registry.listed_at,
        5,
        9000,
    )
    assert Progress.decode(written.encode()) == written
    # A second refusal on the same state, from a later listing, is reported too.
    assert Progress.of(7, held, 0).newness < written.newness < report(7, 10**6).newness


@pytest.mark.parametrize(
    "garbage", ["x", {"upto": 0}, {"upto": 3, "count": 1, "completing": 1, "size": 1}, []]
)
def test_a_garbled_report_leaves_the_summary_without_one(garbage: Any) -> None:
    plain = Progress(5, 0, False, False, 3, 2, 0)
    value = json.loads(plain.encode())
    value["refused"] = garbage
    assert Progress.decode(json.dumps(value)) == plain


def test_a_report_claiming_a_listing_after_its_own_write_is_never_heard() -> None:
    clock = Clock()
    registry = BoardRegistry(clock)
    keys = joining_round(A, registry, clock)
    admit(keys, token=0)
    registry.index += 1
    lie = report(0, 10**12)
    registry.progress, registry.progress_index = lie, registry.index
    registry.changes.append((lie, registry.index))
    assert hear(keys, 1.0, 0) is Heard.KEEP


def test_a_node_whose_join_timed_out_takes_itself_out_wherever_a_batch_put_it() -> None:
    state = RendezvousState()
    assert rollback_action(state, A) == Action.ERROR_TIMEOUT  # In none: the fence.
    state.participants[A] = 0
    assert rollback_action(state, A) == Action.REMOVE_FROM_PARTICIPANTS
    state.complete = True
    assert rollback_action(state, A) == Action.FINISH  # As PyTorch's join past its deadline.
    state.wait_list.add(B)
    assert rollback_action(state, B) == Action.REMOVE_FROM_WAIT_LIST
    state.redundancy_list.add(C)
    # Not left waiting for a place with no deadline: the join is over.
    assert rollback_action(state, C) == Action.REMOVE_FROM_REDUNDANCY_LIST
    state.closed = True
    assert rollback_action(state, A) == Action.ERROR_CLOSED


def round_3_keys(clock: Clock, *nodes: NodeDesc) -> BoardRegistry:
    """A registry in which ``nodes``, the participants of the complete round 3, have keys
    that were all decided, and the progress key describes that state, written at 10."""
    registry = BoardRegistry(clock)
    for node in nodes:
        registry.announce_node(node, 15)
    registry.publish(Progress(10, 3, True, False, registry.index, len(nodes), 0))
    return registry


def member(node: NodeDesc, registry: BoardRegistry, clock: Clock) -> Admission:
    """``node``'s admission, a participant of round 3 (see :func:`round_3_keys`) whose
    agent polled ``num_nodes_waiting()`` (which read the progress key)."""
    keys = keys_of(node, registry, clock)
    assert keys.waiting_hint(10, deadline()) is not None
    return keys


def ask_to_leave(keys: Admission, state: RendezvousState, token: int) -> Changed | Wait | Refresh:
    """The node of ``keys`` asks to leave the round of ``state`` (read with ``token``)."""
    return keys.join(Action.REMOVE_FROM_PARTICIPANTS, state, token, deadline())


def round_3(*participants: NodeDesc, waiting: Iterable[NodeDesc] = ()) -> RendezvousState:
    """The complete round 3 of ``participants``; ``waiting`` wait for the next."""
    state = RendezvousState()
    state.round, state.complete = 3, True
    for node in participants:
        state.participants[node] = 0
        state.last_heartbeats[node] = NOW
    state.wait_list.update(waiting)
    return state


def test_a_node_blocked_by_a_batch_that_missed_it_reads_the_state_when_that_batch_lands() -> None:
    """A, the oldest, asks to leave and lists before B and C ask: its batch takes out only
    A. B and C, whose listings show A leaving, wait for A's batch. When the progress key
    tells of a state with other admissions, B reads it and makes the next batch, instead
    of waiting out the grace (after which every waiting node made a batch of its own at
    once: each a state write, all but one lost)."""
    clock = Clock()
    registry = round_3_keys(clock, A, B, C)
    a, b, c = (member(node, registry, clock) for node in (A, B, C))
    held = round_3(A, B, C)
    assert waits(ask_to_leave(a, held, 10)) > 0
    clock.now += EXIT_GATHER
    batch_of_a = round_3(A, B, C)
    assert ask_to_leave(a, batch_of_a, 10) is CHANGED
    assert (list(batch_of_a.participants), batch_of_a.wait_list) == ([B, C], {A})
    for keys in (b, c):  # B and C ask now; their listings show A leaving
        assert waits(ask_to_leave(keys, held, 10)) > 0
    clock.now += EXIT_GATHER
    assert waits(ask_to_leave(b, held, 10)) == (pytest.approx(ADMISSION_GRACE))
    # A's batch lands: its summary tells of one participant fewer and one more waiting.
    registry.publish(Progress.of(11, batch_of_a, 3))
    assert b.wait(held, 10, ADMISSION_GRACE, deadline()) is Heard.KEEP
    waited_from = clock.now
    assert ask_to_leave(b, held, 10) == Refresh()
    # On the state A wrote, nobody older than B leaves: B takes out B and C, which ends
    # the round, and everyone is admitted to the next one, A (which waited) first.
    assert ask_to_leave(b, batch_of_a, 11) is CHANGED
    assert (batch_of_a.round, list(batch_of_a.participants)) == (4, [A, B, C])
    assert clock.now == waited_from


def test_a_blocked_node_does_not_read_the_state_for_a_fold_of_heartbeats() -> None:
    """A summary of a newer state with the same admissions (the aggregator's fold) tells
    a node blocked by an older leaving node nothing: it keeps waiting for the batch."""
    clock = Clock()
    registry = round_3_keys(clock, A, B, C)
    b = member(B, registry, clock)
    registry.mark_leaving(A, 3, 15)
    held = round_3(A, B, C)
    assert waits(ask_to_leave(b, held, 10)) > 0
    clock.now += EXIT_GATHER
    assert waits(ask_to_leave(b, held, 10)) == (pytest.approx(ADMISSION_GRACE))
    clock.now += 0.5
    registry.publish(Progress.of(11, round_3(A, B, C), 3))
    assert b.wait(held, 10, ADMISSION_GRACE, deadline()) is Heard.KEEP
    assert waits(ask_to_leave(b, held, 10)) == (pytest.approx(ADMISSION_GRACE - 0.5))


def test_the_grace_grows_with_the_nodes_still_waiting_ahead_and_is_capped() -> None:
    assert grace_wait(1, 0.0) == ADMISSION_GRACE
    assert grace_wait(0, 0.0) == ADMISSION_GRACE  # listed before they all left
    assert grace_wait(3, 0.0) == pytest.approx(ADMISSION_GRACE + 2 * ADMIT_STAGGER)
    assert grace_wait(3, ADMISSION_GRACE) == pytest.approx(2 * ADMIT_STAGGER)
    assert grace_wait(3, 10.0) == 0.0
    capped = ADMISSION_GRACE + _STAGGER_CAP * ADMIT_STAGGER
    assert grace_wait(100, 0.0) == pytest.approx(capped)
    assert grace_wait(100, 0.0, jitter=0.5) == pytest.approx(capped + 0.5 * _TAIL_JITTER)


def test_of_the_nodes_behind_a_frozen_leaving_node_the_next_one_makes_the_batch() -> None:
    """A, the oldest, asked to leave and froze before its batch. After the grace, B (held
    up by A alone) takes out everyone who asked; C and D, held up by more nodes, wait a
    step more each, and hear of B's batch before their turn: one state write, not one per
    node."""
    clock = Clock()
    nodes = (A, B, C, D)
    registry = round_3_keys(clock, *nodes)
    b, c, d = (member(node, registry, clock) for node in (B, C, D))
    registry.mark_leaving(A, 3, 15)  # and then A froze
    held = round_3(*nodes)
    for keys in (b, c, d):
        assert waits(ask_to_leave(keys, held, 10)) > 0
    clock.now += EXIT_GATHER
    for keys in (b, c, d):  # each lists the keys: the older ones ask to leave too
        assert waits(ask_to_leave(keys, held, 10)) == (pytest.approx(ADMISSION_GRACE))
    clock.now += ADMISSION_GRACE
    turns = [ask_to_leave(keys, held, 10) for keys in (c, d)]
    assert [waits(turn) for turn in turns] == pytest.approx([ADMIT_STAGGER, 2 * ADMIT_STAGGER])
    batch_of_b = round_3(*nodes)
    assert ask_to_leave(b, batch_of_b, 10) is CHANGED
    assert (batch_of_b.round, list(batch_of_b.participants)) == (4, [A, B, C, D])
    registry.publish(Progress.of(11, batch_of_b, 3))
    assert c.wait(held, 10, ADMIT_STAGGER, deadline()) is Heard.READ  # the round ended


def test_a_blocked_node_that_found_no_state_on_a_member_behind_the_summary_waits() -> None:
    """A read served by a member behind the others finds no state: it proves nothing, so
    the node keeps the summary it heard (see
    ``test_a_summary_is_forgotten_for_a_state_found_absent_only_by_a_member_that_is_not_behind``).
    A node blocked by an older leaving node does not take that summary for a batch it
    missed (it has no state to compare it with): it waits for its grace, instead of
    reading the state again at once, for as long as that member lags."""
    clock = Clock()
    registry = round_3_keys(clock, A, B, C)
    b = member(B, registry, clock)
    registry.mark_leaving(A, 3, 15)  # and then A froze
    held = round_3(A, B, C)
    assert waits(ask_to_leave(b, held, 10)) > 0
    clock.now += EXIT_GATHER
    assert waits(ask_to_leave(b, held, 10)) == (pytest.approx(ADMISSION_GRACE))
    registry.absent_at = 5  # a member behind: it has not seen the state of 10 yet
    b.synced(RendezvousState(), None, None, True, deadline())
    assert waits(b.join(Action.ADD_TO_PARTICIPANTS, RendezvousState(), None, deadline())) == (
        pytest.approx(ADMISSION_GRACE)  # the state it holds changed: the grace starts again
    )


def test_a_leaving_node_reads_a_newer_state_before_it_makes_the_batch() -> None:
    """B, the oldest that asks to leave, makes the batch; a heartbeat fold wrote the state
    since B read it (the progress key says so): B reads it first, as a candidate does,
    rather than make a large write bound to lose."""
    clock = Clock()
    registry = round_3_keys(clock, A, B, C)
    b = member(B, registry, clock)
    held = round_3(A, B, C)
    assert waits(ask_to_leave(b, held, 10)) > 0
    registry.publish(Progress.of(11, round_3(A, B, C), 3))  # the aggregator's fold
    assert b.wait(held, 10, EXIT_GATHER, deadline()) is Heard.KEEP
    clock.now += EXIT_GATHER
    assert ask_to_leave(b, held, 10) == Refresh()
    folded = round_3(A, B, C)
    assert ask_to_leave(b, folded, 11) is CHANGED
    assert (list(folded.participants), folded.wait_list) == ([A, C], {B})
