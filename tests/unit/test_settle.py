"""How a conditional write whose answer was lost is settled (``Connection._settle``),
without a server: the history lookup is replaced. The same, on real servers and past
the caller's deadline, is in ``tests/integration/test_settle.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from etcd_rendezvous._transport.attempt import Attempt, Outcome
from etcd_rendezvous._transport.interface import (
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    WatchHistoryLostError,
)
from etcd_rendezvous._transport.retry import Deadline
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.api import RendezvousConnectionError, RequestTooLargeError


@pytest.fixture
def conn() -> Iterator[Any]:
    """A v3 connection to a port nothing listens on (never contacted by these tests)."""
    connection = EtcdV3Connection([("127.0.0.1", 9)], read_timeout=60, sleep=lambda _: None)
    yield connection
    connection.close()


def _node(value: str, index: int, action: str = "compareAndSwap", created: int = 1) -> Node:
    return Node("/k", value, index, created, index, None, False, (), action)


def _refused(error: Exception | None = None) -> Attempt[Node]:
    refusal = error or CompareFailedError("/k", 9)
    return Attempt[Node](Outcome.REFUSED, refusal=refusal, after_unknown=True)


def _lookup(result: Node | Exception | None, asked: list[int]) -> Callable[[str, int], Node | None]:
    def lookup(_key: str, index: int) -> Node | None:
        asked.append(index)
        if isinstance(result, Exception):
            raise result
        return result

    return lookup


@pytest.mark.parametrize(
    ("first_change", "applied", "unknown_because"),
    [
        (_node("ours", 6), True, None),  # our lost copy was the first change
        (_node("theirs", 6), False, ""),  # another write came first: not ours
        (_node("ours", 6, "expire"), False, ""),  # the key expired: not a write
        (WatchHistoryLostError("/k", 6), False, "no longer holds the history"),
        (None, False, "could not be checked in time"),  # etcd did not answer in time
        (RendezvousConnectionError("etcd unreachable"), False, "etcd unreachable"),
    ],
)
def test_a_swap_after_a_lost_answer_is_settled_by_the_first_change_after_prev(
    conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    first_change: Node | Exception | None,
    applied: bool,
    unknown_because: str | None,
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(conn, "_lookup_change", _lookup(first_change, asked))
    if applied:
        assert conn._settle("compare-and-swap", "/k", "ours", 5, _refused()) == first_change
        assert asked == [5]
        return
    with pytest.raises(CompareFailedError) as excinfo:
        conn._settle("compare-and-swap", "/k", "ours", 5, _refused())
    assert asked == [5]
    assert excinfo.value.outcome_unknown is bool(unknown_because)
    assert unknown_because is not None
    assert unknown_because in excinfo.value.unknown_because


@pytest.mark.parametrize("first_change", [_node("ours", 6), _node("theirs", 6), None])
def test_a_swap_refused_for_its_size_after_a_lost_answer_is_settled_too(
    conn: Any, monkeypatch: pytest.MonkeyPatch, first_change: Node | None
) -> None:
    """A member with a larger --max-request-bytes (during a rolling change of the flag)
    may have applied the copy whose answer was lost before another refused the next one
    for its size: the key's history tells; if it cannot, the refusal stands."""
    asked: list[int] = []
    monkeypatch.setattr(conn, "_lookup_change", _lookup(first_change, asked))
    too_large = RequestTooLargeError("too large: --max-request-bytes", key="/k", size=9000)
    if first_change is not None and first_change.value == "ours":
        assert (
            conn._settle("compare-and-swap", "/k", "ours", 5, _refused(too_large)) == first_change
        )
        return
    with pytest.raises(RequestTooLargeError) as excinfo:
        conn._settle("compare-and-swap", "/k", "ours", 5, _refused(too_large))
    assert excinfo.value is too_large
    assert asked == [5]


def test_a_copy_applied_after_a_lost_answer_is_the_result_without_a_lookup(
    conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(conn, "_lookup_change", _lookup(None, asked))
    written = _node("ours", 7)
    resent = Attempt[Node](Outcome.APPLIED, result=written, after_unknown=True)
    assert conn._settle("compare-and-swap", "/k", "ours", 5, resent) == written
    assert asked == []
    assert conn.last_index == 7


def test_a_write_without_a_lost_answer_is_not_looked_up(
    conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(conn, "_lookup_change", _lookup(None, asked))
    refused = Attempt[Node](Outcome.REFUSED, refusal=CompareFailedError("/k", 9))
    with pytest.raises(CompareFailedError) as excinfo:
        conn._settle("compare-and-swap", "/k", "ours", 5, refused)
    assert (asked, excinfo.value.outcome_unknown) == ([], False)


@pytest.mark.parametrize(
    ("current", "first_change", "applied", "asked"),
    [
        # Not changed since it was created: the current version is the creating write.
        (_node("ours", 6, "get", created=6), None, True, []),
        (_node("theirs", 6, "get", created=6), None, False, []),
        # Changed since: the change at its creation index tells.
        (_node("later", 8, "get", created=6), _node("ours", 6, "create", created=6), True, [5]),
        (_node("later", 8, "get", created=6), _node("theirs", 6, "create", created=6), False, [5]),
    ],
)
def test_a_create_after_a_lost_answer_is_settled_by_the_write_that_created_the_key(
    conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    current: Node,
    first_change: Node | None,
    applied: bool,
    asked: list[int],
) -> None:
    looked_up: list[int] = []
    monkeypatch.setattr(conn, "_lookup_change", _lookup(first_change, looked_up))
    monkeypatch.setattr(conn, "get", lambda _key: current)
    refused = _refused(KeyExistsError("/k", 9))
    if applied:
        assert conn._settle("create", "/k", "ours", None, refused).value == "ours"
    else:
        with pytest.raises(KeyExistsError) as excinfo:
            conn._settle("create", "/k", "ours", None, refused)
        assert not excinfo.value.outcome_unknown
    assert looked_up == asked


def _key_gone(key: str) -> Node:
    raise KeyNotFoundError(key, 10)


#: What the settling of a refused create finds, and what its error then says.
_UNSETTLED_CREATES = {
    "history-gone": (
        {
            "_lookup_change": _lookup(WatchHistoryLostError("/k", 6), []),
            "get": lambda _key: _node("later", 8, "get", created=6),
        },
        "no longer holds",
    ),
    "key-deleted": ({"get": _key_gone}, "deleted"),
}


@pytest.mark.parametrize("found", _UNSETTLED_CREATES)
def test_a_create_that_cannot_be_settled_is_refused_as_unknown(
    conn: Any, monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    patches, because = _UNSETTLED_CREATES[found]
    for name, replacement in patches.items():
        monkeypatch.setattr(conn, name, replacement)
    with pytest.raises(KeyExistsError) as excinfo:
        conn._settle("create", "/k", "ours", None, _refused(KeyExistsError("/k", 9)))
    assert excinfo.value.outcome_unknown
    assert because in excinfo.value.unknown_because


def test_the_history_lookup_outlives_an_expired_caller_deadline(
    conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []

    def wait_for_change(_key: str, index: int, wait: Deadline, *, recursive: bool) -> None:
        # What the watch gets: a deadline of its own, which the thread's scope does not
        # cap.
        seen.append(wait.remaining())

    monkeypatch.setattr(conn, "_wait_for_change", wait_for_change)
    with conn.bounded_by(Deadline(0.0)):
        assert conn._lookup_change("/k", 5) is None
        assert conn._endpoints.budget().expired()  # the caller's scope is unchanged
    assert seen[0] >= conn._endpoints.last_chance() * 0.9
    # With time left, a lookup waits request_timeout at most.
    seen.clear()
    conn._lookup_change("/k", 5)
    assert conn._endpoints.last_chance() * 0.9 <= seen[0] <= conn.request_timeout
