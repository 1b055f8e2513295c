"""Waiting for a final version of the legacy ``etcd`` rendezvous to end, in a constant
number of etcd requests per worker.

A worker that finds the rendezvous ``final`` (it came late, or it re-enters after its
job failed) waits for that version to end: its state changes or is deleted, or one of
its members stops renewing the keep-alive key listed in ``keep_alives``, in which case
the waiting workers delete the state so that a new version starts. PyTorch's workers
wait with one watch request per change below ``rdzv/``, and after each change read the
state and list the version directory again: with N workers waiting and N of them
announcing themselves (each one a change), that is O(N) requests per worker.

Ours read the state and list the version directory once, then follow one watch stream
over ``rdzv/`` whose events carry what changed: the state (its new value comes with the
event), and the deletion or expiry of a member's keep-alive key. Other changes (the
key-value store of the running job, keep-alive keys of other versions, workers
announcing themselves) cost nothing but their delivery. Keep-alive refreshes notify no
watcher on either API. The outcome is PyTorch's: the same state is deleted on the same
evidence, so PyTorch's waiting workers and ours end the version together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ._retry import Deadline
from ._transport import KeyNotFoundError, Node, Transport, WatchHistoryLostError, WatchStream
from .layout import LegacyLayout, normalize_key

__all__ = ["ENDINGS", "await_end_of_final"]

logger = logging.getLogger(__name__)

#: Watch actions by which a key stops existing.
ENDINGS = frozenset({"delete", "expire", "compareAndDelete"})


class _FinalVersion:
    """The final state being waited on, and the keep-alive keys it names."""

    def __init__(self, node: Node, state: dict[str, Any], version: str) -> None:
        self.node = node
        self.state = state
        self.version = version
        self.keep_alives = {normalize_key(key) for key in state.get("keep_alives", [])}

    @property
    def ongoing(self) -> bool:
        return bool(self.state["status"] == "final" and self.state["version"] == self.version)


def await_end_of_final(
    conn: Transport,
    layout: LegacyLayout,
    version: str,
    *,
    parse: Callable[[Node], dict[str, Any]],
    on_lapse: Callable[[str], None],
    deadline: Deadline,
    timeout_error: Callable[[], Exception],
) -> None:
    """Return once the final ``version`` ended (see the module docstring).

    When a member's keep-alive key lapsed, ``on_lapse(key)`` is called, then the state is
    deleted if it is still the one that named the key.

    Raises:
        RendezvousStateError: the state is corrupt (``parse`` says so).
        the error of ``timeout_error``: ``deadline`` passed first.
    """
    while True:
        # The stream first, from now, then the reads: a stream opened from the index of
        # a read would, on v2, cost a request per change made since (many workers are
        # announcing themselves just then). Changes between the two are in both.
        try:
            with conn.watch_stream(layout.rdzv_dir, 0, recursive=True) as stream:
                try:
                    final = _observe(conn, layout, version, parse, on_lapse)
                except KeyNotFoundError:
                    return  # the state is gone: the version ended
                if final is None or _follow(conn, stream, layout, final, parse, on_lapse, deadline):
                    return
        except WatchHistoryLostError:
            logger.info("etcd no longer holds the changes below %s; reading again", layout.rdzv_dir)
            continue
        raise timeout_error()


def _observe(
    conn: Transport,
    layout: LegacyLayout,
    version: str,
    parse: Callable[[Node], dict[str, Any]],
    on_lapse: Callable[[str], None],
) -> _FinalVersion | None:
    """Read the state and list the version directory: the final version to wait on, or
    ``None`` if it already ended (ended by us if a keep-alive key is missing).

    Raises:
        KeyNotFoundError: there is no state.
    """
    node = conn.get(layout.state_key)
    final = _FinalVersion(node, parse(node), version)
    if not final.ongoing:
        return None
    try:
        alive = {
            normalize_key(child.key)
            for child in conn.list_dir(layout.version_dir(version)).children
        }
    except KeyNotFoundError:
        alive = set()
    lapsed = sorted(final.keep_alives - alive)
    if lapsed:
        _end(conn, final, lapsed[0], on_lapse)
        return None
    return final


def _follow(
    conn: Transport,
    stream: WatchStream,
    layout: LegacyLayout,
    final: _FinalVersion,
    parse: Callable[[Node], dict[str, Any]],
    on_lapse: Callable[[str], None],
    deadline: Deadline,
) -> bool:
    """Take in the changes below ``rdzv/`` until the version ended (``True``) or the
    deadline passed (``False``)."""
    state_key = normalize_key(layout.state_key)
    while not deadline.expired():
        event = stream.next(deadline.remaining())
        if event is None:
            continue
        key = normalize_key(event.key)
        if key == state_key:
            if event.modified_index <= final.node.modified_index:
                continue  # made before our read
            if event.action in ENDINGS or event.value is None:
                return True
            final = _FinalVersion(event, parse(event), final.version)
            if not final.ongoing:
                return True
        elif key in final.keep_alives and event.action in ENDINGS:
            _end(conn, final, key, on_lapse)
            return True
    return False


def _end(
    conn: Transport, final: _FinalVersion, lapsed: str, on_lapse: Callable[[str], None]
) -> None:
    """A member's keep-alive key ``lapsed``: delete the state if it did not change."""
    on_lapse(lapsed)
    if conn.compare_and_delete(final.node.key, final.node):
        logger.info("Destroyed rendezvous version %s successfully.", final.version)
