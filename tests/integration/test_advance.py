"""``Transport.advance``, the monotone write of a small summary key, on real etcd servers
(v2 and v3): a value at least as new is kept, an older one is swapped out, a race lost
to another write is read again, a remembered index saves the read.

Values here are numbers: a value holds something "at least as new" when it is a number
at least ours. Every request the operation sends is traced (``get``, ``cas``,
``create``), and another connection's write can be slipped in right after a read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from etcd_rendezvous._transport.interface import Node, Transport
from support.transports import Connect

OURS = 5


def _at_least_ours(node: Node) -> bool:
    return (node.value or "").isdigit() and int(node.value or "") >= OURS


class Traced:
    """``conn`` with its reads and conditional writes recorded in :attr:`sent`; after
    each read, the next of :attr:`interleaved` (if any) runs: another writer's turn."""

    def __init__(self, conn: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
        self.conn = conn
        self.sent: list[str] = []
        self.interleaved: list[Callable[[], Any]] = []
        for name, label in (("try_get", "get"), ("compare_and_swap", "cas"), ("create", "create")):
            monkeypatch.setattr(conn, name, self._traced(getattr(conn, name), label))

    def _traced(self, call: Callable[..., Any], label: str) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            self.sent.append(label)
            result = call(*args, **kwargs)
            if label == "get" and self.interleaved:
                self.interleaved.pop(0)()
            return result

        return traced

    def advance(self, key: str, **kwargs: Any) -> Node | None:
        return self.conn.advance(key, str(OURS), holds_newer=_at_least_ours, **kwargs)


@pytest.fixture
def other(connect: Connect) -> Transport:
    """Another writer's connection."""
    return connect()


@pytest.fixture
def traced(connect: Connect, monkeypatch: pytest.MonkeyPatch) -> Traced:
    return Traced(connect(), monkeypatch)


def test_an_absent_key_is_created_with_the_ttl(traced: Traced, other: Transport, key: str) -> None:
    written = traced.advance(key, ttl=30)
    assert written is not None
    stored = other.get(key)
    assert (stored.value, stored.modified_index) == (str(OURS), written.modified_index)
    ttl = other.time_to_live(stored)
    assert ttl is not None
    assert 0 < ttl <= 30
    assert traced.sent == ["get", "create"]


def test_an_older_value_is_swapped_out_keeping_a_ttl(
    traced: Traced, other: Transport, key: str
) -> None:
    other.set(key, "3")
    written = traced.advance(key, ttl=30)
    assert written is not None
    stored = other.get(key)
    assert (stored.value, stored.modified_index) == (str(OURS), written.modified_index)
    assert other.time_to_live(stored) is not None
    assert traced.sent == ["get", "cas"]


@pytest.mark.parametrize("held", ["7", str(OURS)])
def test_a_value_at_least_as_new_is_left(
    traced: Traced, other: Transport, key: str, held: str
) -> None:
    before = other.set(key, held)
    assert traced.advance(key) is None
    stored = other.get(key)
    assert (stored.value, stored.modified_index) == (held, before.modified_index)
    assert traced.sent == ["get"]


def test_a_race_lost_to_an_older_write_is_read_again_and_won(
    traced: Traced, other: Transport, key: str
) -> None:
    other.set(key, "3")
    traced.interleaved.append(lambda: other.set(key, "4"))  # between our read and our swap
    written = traced.advance(key)
    assert written is not None
    assert other.get(key).value == str(OURS)
    assert traced.sent == ["get", "cas", "get", "cas"]


def test_a_race_lost_to_a_newer_write_leaves_it(traced: Traced, other: Transport, key: str) -> None:
    traced.interleaved.append(lambda: other.set(key, "9"))  # the key was absent when read
    assert traced.advance(key) is None
    assert other.get(key).value == "9"
    assert traced.sent == ["get", "create", "get"]


def test_a_key_deleted_between_the_read_and_the_swap_is_created(
    traced: Traced, other: Transport, key: str
) -> None:
    other.set(key, "3")
    traced.interleaved.append(lambda: other.delete(key))
    assert traced.advance(key) is not None
    assert other.get(key).value == str(OURS)
    assert traced.sent == ["get", "cas", "create"]


@pytest.mark.parametrize("tries", [1, 3])
def test_when_every_try_loses_its_race_nothing_is_written(
    traced: Traced, other: Transport, key: str, tries: int
) -> None:
    other.set(key, "0")
    traced.interleaved.extend(
        functools.partial(other.set, key, str(n)) for n in range(1, tries + 1)
    )
    assert traced.advance(key, tries=tries) is None
    assert other.get(key).value == str(tries)  # the last older write stands
    assert traced.sent == ["get", "cas"] * tries


def test_a_remembered_index_is_written_on_without_a_read(
    traced: Traced, other: Transport, key: str
) -> None:
    held = other.set(key, "3")
    written = traced.advance(key, expected=held.modified_index, ttl=30)
    assert written is not None
    stored = other.get(key)
    assert (stored.value, stored.modified_index) == (str(OURS), written.modified_index)
    assert other.time_to_live(stored) is not None
    assert traced.sent == ["cas"]


@pytest.mark.parametrize(
    ("later", "stands", "sent"),
    [
        ("4", str(OURS), ["cas", "get", "cas"]),  # older than ours: swapped out
        ("8", "8", ["cas", "get"]),  # newer: left
    ],
)
def test_a_stale_remembered_index_falls_back_to_a_read(
    traced: Traced, other: Transport, key: str, later: str, stands: str, sent: list[str]
) -> None:
    stale = other.set(key, "3")
    other.set(key, later)
    written = traced.advance(key, expected=stale.modified_index)
    assert (written is not None) is (stands == str(OURS))
    assert other.get(key).value == stands
    assert traced.sent == sent


def test_expected_zero_creates_without_a_read_and_reads_if_the_key_exists(
    traced: Traced, other: Transport, key: str
) -> None:
    assert traced.advance(key, expected=0, tries=1) is not None
    assert traced.sent == ["create"]
    traced.sent.clear()
    other.set(key, "2")
    assert traced.advance(key, expected=0) is not None
    assert other.get(key).value == str(OURS)
    assert traced.sent == ["create", "get", "cas"]


def test_a_remembered_index_of_a_deleted_key_creates_it(
    traced: Traced, other: Transport, key: str
) -> None:
    held = other.set(key, "3")
    other.delete(key)
    assert traced.advance(key, expected=held.modified_index, tries=1) is not None
    assert other.get(key).value == str(OURS)
    assert traced.sent == ["cas", "create"]
