"""Unit tests of the counting of waiting workers (etcd_rendezvous._legacy.waiting):
plain functions of the state and of the wait keys a worker saw."""

from __future__ import annotations

from typing import Any

import pytest

from etcd_rendezvous._legacy.admission import ADMISSION_GRACE, grace
from etcd_rendezvous._legacy.state import WAITING, torch_waiting, waiters_of
from etcd_rendezvous._legacy.waiting import GATHER, count_step, plan_count
from etcd_rendezvous.layout import new_waiter_name

A, B, C = (new_waiter_name(i) for i in (1, 2, 3))


def final(waiting: int = 0, counted: list[str] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "status": "final",
        "version": "1",
        "participants": [0, 1],
        "keep_alives": ["/p/run_r/rdzv/v_1/rank_0", "/p/run_r/rdzv/v_1/rank_1"],
        "num_workers_waiting": waiting,
    }
    if counted is not None:
        state[WAITING] = counted
    return state


def test_counting_adds_every_uncounted_wait_key_once() -> None:
    counted = plan_count(final(), {A: 10, B: 11})
    assert counted is not None
    assert counted["num_workers_waiting"] == 2
    assert counted[WAITING] == sorted([A, B])
    # Nothing else of the state changes.
    assert {k: v for k, v in counted.items() if k not in (WAITING, "num_workers_waiting")} == {
        k: v for k, v in final().items() if k != "num_workers_waiting"
    }


def test_counting_adds_to_pytorch_workers_increments_and_skips_counted_keys() -> None:
    state = final(waiting=3, counted=[A])  # two PyTorch workers and our A
    counted = plan_count(state, {A: 10, B: 11, C: 12})
    assert counted is not None
    assert counted["num_workers_waiting"] == 5
    assert waiters_of(counted) == {A, B, C}


def test_nothing_to_count_writes_nothing() -> None:
    assert plan_count(final(1, [A]), {A: 10}) is None
    assert plan_count(final(), {}) is None


def test_the_oldest_uncounted_waiter_counts_once_its_key_aged_the_gathering_time() -> None:
    assert count_step(final(), {A: 10, B: 11}, A, quiet_for=0.0, waited_for=0.0) == GATHER
    assert count_step(final(), {A: 10, B: 11}, A, quiet_for=0.0, waited_for=0.04) == GATHER - 0.04
    assert count_step(final(), {A: 10, B: 11}, A, quiet_for=0.0, waited_for=GATHER) == 0.0


def test_a_younger_waiter_waits_the_grace_for_the_older_ones_then_counts() -> None:
    waiting = {A: 10, B: 11, C: 12}
    assert count_step(final(), waiting, B, quiet_for=0.0, waited_for=5.0) == ADMISSION_GRACE
    assert count_step(final(), waiting, C, quiet_for=0.5, waited_for=5.0) == grace(2) - 0.5
    assert count_step(final(), waiting, C, quiet_for=grace(2), waited_for=5.0) == 0.0


def test_older_keys_already_counted_do_not_hold_a_waiter_back() -> None:
    assert count_step(final(1, [A]), {A: 10, B: 11}, B, quiet_for=0.0, waited_for=1.0) == 0.0


def test_a_counted_waiter_or_one_without_a_key_has_nothing_to_do() -> None:
    assert count_step(final(1, [A]), {A: 10}, A, quiet_for=0.0, waited_for=1.0) is None
    assert count_step(final(), {A: 10}, None, quiet_for=0.0, waited_for=1.0) is None
    assert count_step(final(), {A: 10}, B, quiet_for=0.0, waited_for=1.0) is None


@pytest.mark.parametrize(
    ("state", "torch"),
    [
        ({"num_workers_waiting": 0}, 0),
        ({"num_workers_waiting": 2, "waiting": ["wait_a", "wait_b"]}, 0),  # ours alone
        ({"num_workers_waiting": 3, "waiting": ["wait_a", "wait_b"]}, 1),
        ({"num_workers_waiting": 1}, 1),  # PyTorch's alone: no names
        ({"num_workers_waiting": "garbage"}, 0),
        ({}, 0),
    ],
)
def test_the_waiting_workers_that_are_pytorchs(state, torch):
    assert torch_waiting(state) == torch
