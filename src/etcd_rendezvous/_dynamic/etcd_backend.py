"""The ``etcd-v2`` backend of the dynamic rendezvous (public as
:mod:`etcd_rendezvous.etcd_rendezvous_backend`): one run's state key, as PyTorch 2.13's
backend keeps it, plus this package's node keys, aggregator lock and progress key (the
:class:`~.keys.KeyedBackend` interface), and :func:`create_backend`. See
docs/how-it-works.rst, section "The dynamic rendezvous".

Every call takes the deadline of the operation that makes it (optional in PyTorch's
``get_state()`` and ``set_state()``, whose callers never pass one) and passes it to each
of its requests; without one, the connection's ``read_timeout`` bounds each request.
"""

from __future__ import annotations

import binascii
import json
import logging
import threading
from base64 import b64decode, b64encode
from typing import Any

from .._transport.connect import as_transport
from .._transport.interface import (
    ADVANCE_TRIES,
    DELETE_ACTIONS,
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    Transport,
    WatchHistoryLostError,
    WatchStream,
)
from .._transport.options import create_etcd_connection, seconds
from .._transport.retry import REWATCH, Deadline
from ..api import RendezvousParameters, RendezvousStateError
from ..etcd_store import EtcdStore
from ..layout import (
    ETCD_V2_STATE_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    etcd_v2_state_key,
    parse_node_key_name,
)
from ..metrics import record_metric
from .backend import RendezvousBackend, Token
from .keys import AnnouncedNode, Progress
from .state import NodeDesc

__all__ = ["EtcdRendezvousBackend", "create_backend"]

#: The backend logs under the public module's name, where users import it from.
LOGGER_NAME = "etcd_rendezvous.etcd_rendezvous_backend"

logger = logging.getLogger(LOGGER_NAME)

# How much of a corrupt value to quote in an error message.
_PREVIEW_CHARS = 60
#: The field of a node key's value naming the complete round the node leaves.
_LEAVING = "leaving"
# The dynamic rendezvous's default join timeout, in seconds.
_DEFAULT_JOIN_TIMEOUT = 600.0


class EtcdRendezvousBackend(RendezvousBackend):
    """Represents an etcd-based rendezvous backend.

    The fencing token is the etcd ``modifiedIndex`` of the state it was read with.

    The backend releases the connection it owns on :meth:`close` (or leaving a ``with``
    block): the one it opened itself from an ``etcd.Client``, or one handed over with
    ``owns_connection=True`` (as :func:`create_backend` does). A connection it was merely
    given stays open for its owner.

    Args:
        client: the :class:`~etcd_rendezvous._transport.v2.EtcdConnection` to use, or a
            python-etcd ``etcd.Client`` (converted with
            :meth:`~etcd_rendezvous._transport.v2.EtcdConnection.from_client`).
        run_id: the run id of the rendezvous.
        key_prefix: the path under which to store the rendezvous state in etcd; the
            key is ``<key_prefix>/<run_id>`` (just ``run_id`` without a prefix).
        ttl: the TTL of the rendezvous state, in seconds. If not specified (or not
            positive), defaults to two hours.
        owns_connection: whether :meth:`close` closes ``client`` when it is an
            :class:`~etcd_rendezvous._transport.v2.EtcdConnection`; a connection converted from
            an ``etcd.Client`` is always the backend's own. An owned connection is also
            closed if the constructor raises.

    Raises:
        ValueError: ``run_id`` is empty.
        TypeError: ``client`` is neither kind of client.
    """

    _DEFAULT_TTL = 7200  # 2 hours

    def __init__(
        self,
        client: Any,
        run_id: str,
        key_prefix: str | None = None,
        ttl: int | None = None,
        *,
        owns_connection: bool = False,
    ) -> None:
        conn = as_transport(client, param="client")
        self._owns_conn = owns_connection or conn is not client
        self._conn = conn
        self._close_lock = threading.Lock()
        self._closed = False
        # The watch stream on the state key (opened by the first wait_for_change).
        self._stream: WatchStream | None = None
        # The watch stream on the progress key (see ``wait_progress``).
        self._progress_stream: WatchStream | None = None
        self._watch_lock = threading.Lock()
        if not run_id:
            self.close()
            raise ValueError("The run id must be a non-empty string.")
        self._key = etcd_v2_state_key(run_id, key_prefix)
        self._nodes = EtcdV2NodesLayout(run_id, key_prefix)
        #: The v3 lease of each node key we wrote (0 on v2), to refresh it without a read.
        self._node_leases: dict[str, int] = {}
        # The node keys of the last listing (for ``expires_in``).
        self._listed_keys: dict[NodeDesc, Node] = {}
        self._ttl = ttl if ttl and ttl > 0 else self._DEFAULT_TTL
        # What the last read or write saw: the state's modifiedIndex (``None``: no
        # state) and the etcd index of that answer, from which a watch misses nothing.
        self._observed: tuple[int | None, int] | None = None
        # The etcd index at which the last listing of the node keys was served.
        self._listed_at = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self._key!r}, endpoints={self._conn.endpoints!r})"

    def __enter__(self) -> EtcdRendezvousBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection if the backend owns it (see the class docs). Idempotent.

        The rendezvous state is left in etcd.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for stream in (self._stream, self._progress_stream):
            if stream is not None:
                stream.close()
        self._stream = self._progress_stream = None
        if self._owns_conn:
            self._conn.close()

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v2"

    @property
    def key(self) -> str:
        """The etcd key holding the rendezvous state."""
        return self._key

    @property
    def state_key(self) -> str:
        """See base class: the etcd key holding the state (:attr:`key`)."""
        return self._key

    @property
    def reports_changes(self) -> bool:
        """See base class: yes, from the watch stream on the state key."""
        return True

    @property
    def ttl(self) -> int:
        """The TTL given to the state key on every write, in seconds."""
        return self._ttl

    @property
    def connection(self) -> Transport:
        """The connection the backend sends its requests through."""
        return self._conn

    def get_state(self, *, deadline: Deadline | None = None) -> tuple[bytes, Token] | None:
        """Return the state and its token, or ``None`` if there is no state.

        Args:
            deadline: when to stop retrying etcd's failures; the dynamic handler passes
                its operation's, PyTorch's callers none (then ``read_timeout`` bounds it).

        Raises:
            RendezvousConnectionError: etcd could not be reached.
            RendezvousStateError: the key does not hold base64 (or is a directory).
        """
        record_metric("rendezvous.state_reads", backend="etcd-v2")
        try:
            node = self._conn.get(self._key, deadline=deadline)
        except KeyNotFoundError as exc:
            self._note_absent(exc)
            return None
        self._observed = (node.modified_index, node.etcd_index)
        return self._decode(node), node.modified_index

    def set_state(
        self, state: bytes, token: Token | None = None, *, deadline: Deadline | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is current (or, without a token, if there is none).

        Returns the state now stored, its token and whether it is ours; ``None`` if
        the state was deleted (or expired) in the meantime. A token that is not an
        etcd index (e.g. ``"invalid"``) never matches. ``deadline`` as in
        :meth:`get_state`.

        Raises:
            RendezvousConnectionError: etcd could not be reached; the write may or may
                not have been applied.
            RendezvousStateError: the stored value does not decode.
        """
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"state: expected bytes, got {type(state).__name__}.")
        index: int | None = None
        if token:
            try:
                index = int(token)
            except (TypeError, ValueError):
                return self._current_state(deadline)
        value = b64encode(state).decode()
        try:
            # PyTorch's pickle has no room for a tag; equal bytes are an equal state.
            if index:
                node = self._conn.compare_and_swap(
                    self._key, value, index, ttl=self._ttl, deadline=deadline
                )
            else:
                node = self._conn.create(self._key, value, ttl=self._ttl, deadline=deadline)
        except (CompareFailedError, KeyExistsError, KeyNotFoundError):
            return self._current_state(deadline)
        self._observed = (node.modified_index, node.etcd_index)
        return bytes(state), node.modified_index, True

    def wait_for_change(
        self, token: Token | None, timeout: float, *, deadline: Deadline | None = None
    ) -> tuple[bytes, Token] | None:
        """Block until the state changes after ``token``, or for ``timeout`` seconds
        (its requests, to open the watch, retried until ``deadline``).

        ``token`` is the token of the state the caller last saw (``None``: it saw no
        state). Returns the newest state and its token as soon as a change after
        ``token`` is known (at once if one already happened), or ``None`` when
        ``timeout`` passed, or when the state was deleted (the caller re-reads it). The
        changes come from one watch stream on the state key, opened at the first call
        (from right after ``token``, so no change can slip between the caller's read
        and the wait) and kept open until :meth:`close`: one etcd request for every wait
        of the rendezvous, unless the stream breaks. A spurious early return is possible
        and harmless.

        Raises:
            RendezvousConnectionError: etcd was unreachable for longer than the read
                timeout.
            RendezvousStateError: the new value does not decode.
        """
        expected: int | None = None
        if token:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                return None
        rewatch = REWATCH.start(max(0.0, timeout))
        until = rewatch.deadline
        with self._watch_lock:
            if timeout <= 0 and self._stream is None:
                return None  # Nothing watched, nothing known: no stream to open for that.
            while True:
                if self._stream is None:
                    changed, node = self._open_stream(expected, deadline)
                    if changed:
                        return None if node is None else self._as_state(node)
                change = self._next_change(until)
                if change is not None and (expected is None or change.modified_index > expected):
                    return self._as_state(change)
                if until.expired():
                    return None
                if self._stream is None:
                    # The stream lost the history it needed: read, then watch again.
                    rewatch.pause()

    # -- node keys (see etcd_rendezvous._dynamic.admission) ------------------------------
    # The calls of the KeyedBackend interface. ``deadline`` as in get_state().

    @property
    def nodes_layout(self) -> EtcdV2NodesLayout:
        """Where the keys of our nodes and the aggregator lock live."""
        return self._nodes

    def announce_node(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> int:
        """Create the key of ``node`` (its descriptor as JSON) with ``ttl``; return the
        etcd index at which it was created. A key already there is ours (same process,
        same local id: from an earlier attempt whose answer was lost): its TTL is
        restarted and its index returned."""
        key = self._node_key(node)
        while True:
            try:
                created = self._conn.create(key, _node_value(node), ttl=ttl, deadline=deadline)
            except KeyExistsError:
                pass
            else:
                self._node_leases[key] = created.lease
                return created.created_index
            try:
                self._node_leases[key] = self._conn.refresh(key, ttl, deadline=deadline).lease
                return self._conn.get(key, deadline=deadline).created_index
            except KeyNotFoundError:
                continue  # Expired in between: create it again.

    def refresh_node(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        """Restart the TTL of the key of ``node`` (a v3 lease keep-alive); ``False`` if
        the key is gone."""
        key = self._node_key(node)
        try:
            # Only this node writes its key: on v3 its lease is kept alive without a read.
            lease = self._node_leases.get(key, 0)
            refreshed = self._conn.refresh(key, ttl, lease=lease, deadline=deadline)
        except KeyNotFoundError:
            self._node_leases.pop(key, None)
            return False
        self._node_leases[key] = refreshed.lease
        return True

    def withdraw_node(self, node: NodeDesc, deadline: Deadline | None = None) -> None:
        """Delete the key of ``node`` (nothing if it is gone)."""
        key = self._node_key(node)
        self._conn.delete(key, deadline=deadline)
        self._node_leases.pop(key, None)  # (kept if the deletion failed: a retry uses it)

    def mark_leaving(
        self, node: NodeDesc, round_: int, ttl: int, deadline: Deadline | None = None
    ) -> None:
        """Rewrite the key of ``node`` with ``"leaving": round_`` added to its descriptor,
        keeping its place in created order (one request: on v3 with the lease of our last
        write of the key, on v2 restarting its TTL); a key that is gone is created with
        ``ttl``."""
        key = self._node_key(node)
        value = _node_value(node, leaving=round_)
        lease = self._node_leases.get(key, 0)
        try:
            written = self._conn.update(key, value, ttl=ttl, lease=lease, deadline=deadline)
        except KeyNotFoundError:
            written = self._conn.set(key, value, ttl=ttl, deadline=deadline)
        self._node_leases[key] = written.lease

    def list_nodes(self, deadline: Deadline | None = None) -> list[AnnouncedNode]:
        """The node keys of the run, oldest (lowest created index) first. Keys whose
        names are not spelled as a node key's are left out."""
        try:
            listing = self._conn.list_dir(self._nodes.nodes_dir, deadline=deadline)
        except KeyNotFoundError:
            return []
        nodes = []
        self._listed_keys = {}
        self._listed_at = listing.etcd_index
        for child in listing.children:
            # The name spells the node (cheaper than its value, at a few hundred nodes).
            fields = None if child.is_dir else parse_node_key_name(child.key.rsplit("/", 1)[-1])
            if fields is not None:
                leaving = _leaving(child.value)
                nodes.append(AnnouncedNode(NodeDesc(*fields), child.created_index, leaving))
                self._listed_keys[nodes[-1].node] = child
        nodes.sort(key=lambda entry: entry.created_index)
        return nodes

    def expires_in(self, node: NodeDesc, deadline: Deadline | None = None) -> int | None:
        """Whole seconds until the key of ``node`` expires: on v2 as the last listing
        reported it, on v3 read from its lease (one request); ``None`` if the last
        listing did not have the key, or its lease is gone."""
        key = self._listed_keys.get(node)
        if key is None:
            return None
        return self._conn.time_to_live(key, deadline=deadline)

    def remove_expired(self, node: NodeDesc, deadline: Deadline | None = None) -> bool:
        """Delete the key of ``node`` if it is still as the last listing showed it (its
        modification index); whether it is gone now."""
        listed = self._listed_keys.get(node)
        if listed is None:
            return True
        if self._conn.compare_and_delete(listed.key, listed, deadline=deadline):
            self._node_leases.pop(listed.key, None)
            return True
        return self._conn.try_get(listed.key, deadline=deadline) is None

    def aggregator(self, deadline: Deadline | None = None) -> NodeDesc | None:
        """The node holding the aggregator lock (``None``: nobody, or not a node)."""
        lock = self._conn.try_get(self._nodes.aggregator_key, deadline=deadline)
        return None if lock is None else _parse_node(lock)

    def claim_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        """Create the aggregator lock for ``node`` with ``ttl``; ``False`` if it exists."""
        try:
            value = _node_value(node)
            self._conn.create(self._nodes.aggregator_key, value, ttl=ttl, deadline=deadline)
        except KeyExistsError:
            return False
        return True

    def renew_aggregator(self, node: NodeDesc, ttl: int, deadline: Deadline | None = None) -> bool:
        """Restart the TTL of the aggregator lock if ``node`` holds it; ``False`` if it
        is gone or another node's (one request on v2, two on v3, as unconditionally)."""
        key = self._nodes.aggregator_key
        try:
            self._conn.compare_and_refresh(key, _node_value(node), ttl, deadline=deadline)
        except (KeyNotFoundError, CompareFailedError):
            return False
        return True

    def release_aggregator(self, node: NodeDesc, deadline: Deadline | None = None) -> None:
        """Delete the aggregator lock if ``node`` holds it."""
        lock = self._conn.try_get(self._nodes.aggregator_key, deadline=deadline)
        if lock is not None and _parse_node(lock) == node:
            self._conn.compare_and_delete(self._nodes.aggregator_key, lock, deadline=deadline)

    # -- the progress key (see etcd_rendezvous._dynamic.progress.ProgressKey) ------------

    @property
    def listed_at(self) -> int:
        """The etcd index at which the last :meth:`list_nodes` was served."""
        return self._listed_at

    @property
    def absent_at(self) -> int | None:
        """The etcd index at which the last read of the state found none (``None``:
        the last read found one, or none was made)."""
        observed = self._observed
        return observed[1] if observed is not None and observed[0] is None else None

    def read_progress(
        self, deadline: Deadline | None = None
    ) -> tuple[Progress | None, int | None, int]:
        """The summary the progress key holds (``None``: absent or not a summary), the
        key's modification index (``None``: absent), and the etcd index of the answer:
        its next change comes after it (never an older index, which etcd may no longer
        have the history of)."""
        try:
            node = self._conn.get(self._nodes.progress_key, deadline=deadline)
        except KeyNotFoundError as exc:
            index = exc.etcd_index if exc.etcd_index is not None else self._conn.last_index
            return None, None, index
        index = max(node.etcd_index, node.modified_index)
        return Progress.decode(node.value), node.modified_index, index

    def create_progress(self, progress: Progress, deadline: Deadline | None = None) -> int | None:
        """Create the progress key with ``progress`` and the state's TTL (never a key that
        outlives the run); the write's modification index, or ``None`` if it exists."""
        return self._advance_progress(progress, 0, deadline, tries=1)

    def write_progress(
        self, progress: Progress, index: int, deadline: Deadline | None = None
    ) -> int | None:
        """Write ``progress`` into the progress key (the state's TTL) unless it holds the
        summary of a newer state: compare-and-swap on its modification index ``index``
        (``0``: create it), and on a failure read it and try again while it holds an
        older summary (or garbage). The write's modification index, or ``None`` if the
        key holds a summary at least as new (or others kept writing first)."""
        return self._advance_progress(progress, index, deadline)

    def replace_progress(
        self, progress: Progress, index: int, deadline: Deadline | None = None
    ) -> int | None:
        """Write ``progress`` into the progress key only if it was not written since its
        modification index ``index`` (or, if it is gone or ``index`` is ``0``, create
        it); the write's modification index, or ``None`` if it did not write."""
        return self._advance_progress(progress, index, deadline, tries=1)

    def _advance_progress(
        self,
        progress: Progress,
        index: int,
        deadline: Deadline | None,
        tries: int = ADVANCE_TRIES,
    ) -> int | None:
        """Advance the progress key to ``progress`` (see :meth:`Transport.advance`) from
        its modification index ``index``; the write's modification index, or ``None``."""
        node = self._conn.advance(
            self._nodes.progress_key,
            progress.encode(),
            holds_newer=lambda held: _holds_summary_since(held, progress),
            ttl=self._ttl,
            expected=index,
            tries=tries,
            deadline=deadline,
        )
        return None if node is None else node.modified_index

    def wait_progress(
        self, after: int, timeout: float, deadline: Deadline | None = None
    ) -> list[tuple[Progress | None, int]]:
        """The changes of the progress key after the etcd index ``after`` (each summary,
        ``None`` for a deletion or garbage, with its modification index), waiting up to
        ``timeout`` seconds for the first; one stream, opened at the first call. If etcd
        no longer has the history, the key is read instead, and the stream reopened from
        that read (not from ``after`` again: that history is gone for good)."""
        until = Deadline(max(timeout, 0.0))
        key = self._nodes.progress_key
        with self._watch_lock:
            if self._progress_stream is None:
                self._progress_stream = self._conn.watch_stream(key, after + 1, deadline=deadline)
            stream = self._progress_stream
            changes: list[tuple[Progress | None, int]] = []
            try:
                change = stream.next(until)
                while change is not None:
                    value = None if change.action in DELETE_ACTIONS else change.value
                    changes.append((Progress.decode(value), change.modified_index))
                    change = stream.next(Deadline(0.0))
            except WatchHistoryLostError:
                self._progress_stream = None
                stream.close()
                progress, version, index = self.read_progress(deadline)
                self._progress_stream = self._conn.watch_stream(key, index + 1, deadline=deadline)
                return [(progress, version if version is not None else index)]
            except BaseException:
                self._progress_stream = None
                stream.close()
                raise
            return changes

    def check_size(self, size: int, deadline: Deadline | None = None) -> None:
        """Ask etcd whether it accepts a write of ``size`` bytes below the run's nodes
        directory (nothing is written; see :meth:`Transport.check_size
        <etcd_rendezvous._transport.interface.Transport.check_size>`).

        Raises:
            RequestTooLargeError: etcd refused it for its size.
        """
        self._conn.check_size(self._nodes.nodes_dir, size, deadline=deadline)

    def stop_waiting(self) -> None:
        """Close the watches of the state and of the progress key (reopened on demand)."""
        with self._watch_lock:
            self._drop_stream()
            stream, self._progress_stream = self._progress_stream, None
            if stream is not None:
                stream.close()

    def _node_key(self, node: NodeDesc) -> str:
        return self._nodes.node_key(node.addr, node.pid, node.local_id)

    # -- internals ------------------------------------------------------------------------

    def _open_stream(
        self, expected: int | None, deadline: Deadline | None
    ) -> tuple[bool, Node | None]:
        """Open the watch stream from right after the state ``expected`` (its token;
        ``None``: no state) was seen, its requests by ``deadline``. If that takes a read,
        and the read shows that the state changed, return ``(True, the new node or None
        if deleted)`` instead."""
        observed = self._observed
        if observed is None or observed[0] != expected:
            node: Node | None = None
            try:
                node = self._conn.get(self._key, deadline=deadline)
            except KeyNotFoundError as exc:
                self._note_absent(exc)
            else:
                self._observed = (node.modified_index, node.etcd_index)
            observed = self._observed
            if observed is None or observed[0] != expected:
                return True, node
        self._stream = self._conn.watch_stream(self._key, observed[1] + 1, deadline=deadline)
        return False, None

    def _next_change(self, deadline: Deadline) -> Node | None:
        """The newest change the stream has by ``deadline`` (waiting for the first one,
        taking the others already received), or ``None``. Drops the stream if it failed
        (and for lost history, forgets what was observed, so that the next opening
        reads the key)."""
        stream = self._stream
        if stream is None:
            return None
        change = None
        try:
            newest = stream.next(deadline)
            while newest is not None:
                change, newest = newest, stream.next(Deadline(0.0))
        except WatchHistoryLostError:
            self._drop_stream()
            self._observed = None
        except BaseException:
            self._drop_stream()
            raise
        return change

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _as_state(self, node: Node) -> tuple[bytes, Token] | None:
        """The state a change (or a read) carries; ``None`` for a deletion or expiry."""
        if node.value is None or node.action in DELETE_ACTIONS:
            self._observed = (None, node.modified_index)
            return None
        state = self._decode(node)
        self._observed = (node.modified_index, max(node.modified_index, node.etcd_index))
        return state, node.modified_index

    def _note_absent(self, exc: KeyNotFoundError) -> None:
        index = exc.etcd_index if exc.etcd_index is not None else self._conn.last_index
        self._observed = (None, index)

    def _current_state(self, deadline: Deadline | None) -> tuple[bytes, Token, bool] | None:
        result = self.get_state(deadline=deadline)
        if result is None:
            return None
        return result[0], result[1], False

    def _decode(self, node: Node) -> bytes:
        if node.is_dir or node.value is None:
            raise RendezvousStateError(
                f"The rendezvous state key {self._key!r} is an etcd directory, not a value; "
                "another program wrote keys below it."
            )
        try:
            return b64decode(node.value, validate=True)
        except (binascii.Error, ValueError):
            preview = repr(node.value)
            if len(preview) > _PREVIEW_CHARS:
                preview = preview[:_PREVIEW_CHARS] + "..."
            raise RendezvousStateError(
                f"The rendezvous state key {self._key!r} holds {preview}, which is not "
                "base64: it was not written by a rendezvous backend. The key was left "
                "untouched."
            ) from None


def _node_value(node: NodeDesc, *, leaving: int | None = None) -> str:
    """The value of a node key: the node descriptor as JSON, and the complete round the
    node leaves, if it asked to (see :meth:`EtcdRendezvousBackend.mark_leaving`)."""
    fields: dict[str, object] = {"addr": node.addr, "pid": node.pid, "local_id": node.local_id}
    if leaving is not None:
        fields[_LEAVING] = leaving
    return json.dumps(fields)


def _leaving(value: str | None) -> int | None:
    """The round a node key's value says the node leaves (``None``: it does not say)."""
    if not value or f'"{_LEAVING}"' not in value:
        return None  # Most keys: no need to parse them.
    try:
        leaving = json.loads(value).get(_LEAVING)
    except (ValueError, AttributeError):
        return None
    return leaving if type(leaving) is int else None


def _holds_summary_since(held: Node, progress: Progress) -> bool:
    """Whether the progress key ``held`` holds a summary at least as new as ``progress``
    (see :attr:`Progress.newness`)."""
    summary = Progress.decode(held.value)
    return summary is not None and summary.newness >= progress.newness


def _parse_node(key: Node) -> NodeDesc | None:
    """The node descriptor a node key holds, or ``None`` if it holds something else."""
    try:
        fields = json.loads(key.value or "")
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    addr, pid, local_id = fields.get("addr"), fields.get("pid"), fields.get("local_id")
    if type(addr) is not str or type(pid) is not int or type(local_id) is not int:
        return None
    return NodeDesc(addr, pid, local_id)


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Create a new :class:`EtcdRendezvousBackend` and its store from ``params``.

    ``params.endpoint`` may list several etcd endpoints, comma-separated. Options (as
    values or strings, e.g. from torchrun's ``--rdzv-conf``):

    ===============  ==========================================================  =======
    option           meaning                                                     default
    ===============  ==========================================================  =======
    join_timeout     creation, too, ends within it (see below)                   600
    read_timeout     the longest one etcd request may wait, and how long         60
                     failures are retried outside a deadline
    request_timeout  seconds one etcd request waits for an answer (then the      3
                     next endpoint is tried)
    silence_timeout  seconds a wait may hear nothing from its member (then it    10
                     is re-armed on the next endpoint)
    connect_timeout  seconds to connect to one endpoint                          5
    protocol         ``http`` or ``https``                                       http
    ssl_cert         client certificate file (https)
    ssl_cert_key     private key of ``ssl_cert`` (https)
    ca_cert          CA bundle that verifies the server (https)
    username         etcd user (with ``password``)
    password         password of ``username``
    ===============  ==========================================================  =======

    The state is kept under ``/torch/elastic/rendezvous/<run_id>`` and the store under
    ``/torch/elastic/store``, as in PyTorch. The endpoints are contacted once, so a
    wrong address fails here rather than in the first rendezvous: within
    ``connect_timeout`` for an endpoint that refuses connections or never answers, and
    within ``join_timeout`` (plus about a second) however etcd fails. With a
    ``username``, etcd is also asked whether the user may write the store (a
    conditional write that cannot apply), so that a role without it is refused here,
    before the rendezvous writes anything.

    Both share one connection, owned by the backend: :meth:`EtcdRendezvousBackend.close`
    releases it (the store borrows it and its ``close()`` leaves it open). Pass
    ``owns_backend=True`` to :func:`~etcd_rendezvous.dynamic_rendezvous.create_handler`
    to have the handler close the backend in turn.

    Raises:
        ValueError: an option or the endpoint is invalid; the message names it.
        RendezvousConnectionError: etcd cannot be reached at any endpoint (or does not
            serve the v2 API); the message names the endpoints. Or the user lacks a
            permission on the state key or the store; the message names the key.
    """
    deadline = Deadline(seconds(params, "join_timeout", _DEFAULT_JOIN_TIMEOUT))
    conn = create_etcd_connection(
        params,
        cert_option="ssl_cert",
        key_option="ssl_cert_key",
        cacert_option="ca_cert",
        deadline=deadline,
    )
    backend = EtcdRendezvousBackend(
        conn, params.run_id, key_prefix=ETCD_V2_STATE_PREFIX, owns_connection=True
    )
    try:
        # Fail early, as PyTorch's client does when it connects: one read of the key.
        conn.try_get(backend.key, deadline=deadline)
        if params.get("username") is not None:
            # A user whose role misses the store (shared by all runs, so easily
            # forgotten) learns it now, before the rendezvous writes anything.
            conn.check_writable(ETCD_V2_STORE_PREFIX, deadline=deadline)
    except BaseException:
        backend.close()
        raise
    return backend, EtcdStore(conn, ETCD_V2_STORE_PREFIX)
