"""Waiting on a condition under a monotonic deadline, never with a fixed sleep."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from etcd_rendezvous._transport.interface import Node, Transport
from etcd_rendezvous.api import Deadline

__all__ = ["each_version", "wait_for_state", "wait_for_value", "wait_until"]


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` (which itself queries something) until it holds; raise
    :class:`AssertionError` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def wait_for_value(
    conn: Transport, key: str, predicate: Callable[[str | None], bool], timeout: float = 30.0
) -> str | None:
    """Watch ``key`` until ``predicate`` holds for its value (``None``: no key); return it."""
    deadline = time.monotonic() + timeout
    while True:
        node = conn.try_get(key)
        value = node.value if node is not None else None
        if predicate(value):
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{key} never matched; last value: {value!r}")
        conn.watch(key, conn.last_index + 1, Deadline(min(remaining, 1.0)))


def wait_for_state(
    conn: Transport,
    key: str,
    predicate: Callable[[dict[str, Any] | None], bool],
    timeout: float = 30.0,
) -> dict[str, Any] | None:
    """Watch ``key`` until ``predicate`` holds for its JSON value (``None``: no key or an
    empty value); return that value decoded."""

    def decoded(value: str | None) -> dict[str, Any] | None:
        return json.loads(value) if value else None

    return decoded(wait_for_value(conn, key, lambda value: predicate(decoded(value)), timeout))


def each_version(conn: Transport, key: str, timeout: float = 30.0) -> Iterator[Node]:
    """Yield ``key``'s node now and after each later write (watching from the index seen
    + 1, so that no version is skipped), until the caller stops; raise
    :class:`AssertionError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    node = conn.get(key)
    while True:
        yield node
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no version of {key} ended the wait in {timeout} s")
        change = conn.watch(key, node.modified_index + 1, Deadline(min(remaining, 5.0)))
        node = change if change is not None else conn.get(key)
