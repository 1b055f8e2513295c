"""The v2 transport: etcd's v2 API over HTTP, with urllib3.

:class:`EtcdConnection` implements :class:`~etcd_rendezvous._transport.interface.Transport`
over a :class:`~etcd_rendezvous._transport.v2_session.V2Session` (the connection's urllib3
pool, its credentials, and what etcd's answers mean), which its watch streams share. It
sends the requests python-etcd sends, byte for byte, and reads the answers as python-etcd
reads them; python-etcd itself is used only to recognise a user's ``etcd.Client`` (see
:meth:`EtcdConnection.from_client`). See docs/etcd-v3.rst, section "Inside the
transport".
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import etcd
import urllib3

from ..api import Deadline, RendezvousConnectionError
from .attempt import Attempt, Outcome
from .base import Connection
from .interface import (
    DEFAULT_READ_TIMEOUT,
    CompareFailedError,
    ConnectionOptions,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    OperationRefusedError,
    WatchHistoryLostError,
    WatchStream,
)
from .v2_session import HistoryClearedError, PollEndedError, V2Session, key_path
from .v2_watch import V2WatchStream

if TYPE_CHECKING:
    from typing_extensions import Unpack  # Python 3.10 has no typing.Unpack

__all__ = [
    "CompareFailedError",
    "EtcdConnection",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "OperationRefusedError",
]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]
#: What a v2 request answers: its JSON object and its ``X-Etcd-Index``.
_Answer = tuple[dict[str, Any], int]


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _node(answer: _Answer, what: str, key: str) -> Node:
    """The :class:`Node` of a v2 answer (``{"action", "node", "prevNode"}`` and its
    ``X-Etcd-Index``)."""
    data, etcd_index = answer
    raw = data.get("node")
    if not isinstance(raw, dict):
        raise OperationRefusedError(
            f"etcd answered the request to {what} {key!r} without a node: {data!r:.200}"
        )
    node = _node_from_dict(raw, etcd_index, str(data.get("action") or ""))
    previous = data.get("prevNode")
    if isinstance(previous, dict) and previous.get("dir") and not node.is_dir:
        # etcd answers a write on a directory with a node that does not say it is one.
        node = dataclasses.replace(node, is_dir=True)
    return node


def _node_from_dict(raw: dict[str, Any], etcd_index: int, action: str = "get") -> Node:
    is_dir = bool(raw.get("dir", False))
    children = raw.get("nodes") if is_dir else None
    return Node(
        key=raw.get("key", ""),
        value=raw.get("value"),
        modified_index=int(raw.get("modifiedIndex", 0) or 0),
        created_index=int(raw.get("createdIndex", 0) or 0),
        etcd_index=etcd_index,
        ttl=raw.get("ttl"),
        is_dir=is_dir,
        children=tuple(_node_from_dict(child, etcd_index) for child in children or []),
        action=action,
    )


class EtcdConnection(Connection):
    """A connection to an etcd cluster over the v2 API, on one or more endpoints, through
    one urllib3 pool. The options are
    :class:`~etcd_rendezvous._transport.interface.Transport`'s.
    """

    api = "v2"

    def __init__(self, endpoints: Sequence[Endpoint], **options: Unpack[ConnectionOptions]) -> None:
        super().__init__(endpoints, **options)
        self._session = V2Session(self._endpoints, self._access, self._clock)
        self._version: str | None = None

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_client(cls, client: Any, *, param: str = "etcd_client") -> EtcdConnection:
        """Build a hardened connection to ``client``'s endpoint, with its credentials and
        read timeout, from ``client``, a python-etcd ``etcd.Client`` (read through its
        public attributes alone, and not modified): ``base_uri``, ``protocol``,
        ``username``, ``password``, ``read_timeout`` and the TLS files its ``http`` pool
        was given. The other members a client made with ``allow_reconnect`` learned
        are not used (python-etcd tells them only by asking etcd): give several
        endpoints to the connection instead. Callers outside the transport use
        :func:`~etcd_rendezvous._transport.connect.as_transport`.

        Raises:
            TypeError: ``client`` is not an ``etcd.Client``; the message names
                ``param``, the caller's name for it.
            ValueError: the endpoint of ``client`` cannot be parsed.
        """
        if not isinstance(client, etcd.Client):
            raise TypeError(
                f"{param}: expected an etcd.Client or an etcd-rendezvous connection, got "
                f"{type(client).__name__}."
            )
        uri = client.base_uri
        parsed = urllib3.util.parse_url(uri)
        if parsed.host is None or parsed.port is None:
            raise ValueError(f"{param}: cannot parse endpoint {uri!r}.")
        pool_kw = client.http.connection_pool_kw
        cert = pool_kw.get("cert_file")
        read_timeout = client.read_timeout if client.read_timeout else DEFAULT_READ_TIMEOUT
        return cls(
            [(parsed.host.strip("[]"), parsed.port)],
            protocol=client.protocol,
            cert=cert,
            key=pool_kw.get("key_file") if cert else None,
            cacert=pool_kw.get("ca_certs"),
            username=client.username,
            password=client.password if client.username else None,
            read_timeout=float(read_timeout),
        )

    def _release(self) -> None:
        self._session.release()

    # -- the request loop -----------------------------------------------------------

    def _v2(
        self,
        what: str,
        key: str,
        method: str,
        fields: dict[str, Any] | None,
        deadline: Deadline,
        *,
        path: str | None = None,
        poll: float | None = None,
    ) -> Attempt[_Answer]:
        """Send ``method`` on ``key``'s path (or ``path``) with ``fields`` to one endpoint
        after another until etcd answers it or ``deadline`` passes (see
        :meth:`~etcd_rendezvous._transport.endpoints.Endpoints.operate`). Each request
        waits ``read_timeout`` for its answer at most, as the failover loop caps it, or
        ``poll`` seconds (a long poll, which etcd answers only on a change; no longer
        than ``deadline``)."""
        read = self._endpoints.timeouts.read
        where = key_path(key) if path is None else path

        def send(idx: int, cap: float | None) -> _Answer:
            if poll is not None:
                # A poll sent again (its connection broke) waits no longer than the
                # caller's deadline: at least a moment, as a wait of 0 s would not wait.
                wait = max(min(poll, deadline.remaining()), 0.001)
            else:
                wait = read if cap is None else min(read, cap)
            return self._session.request(idx, method, where, fields, what=what, key=key, wait=wait)

        return self._endpoints.operate(
            what, key, send, deadline=deadline, cap_requests=poll is None
        )

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, deadline: Deadline | None = None) -> Node:
        """Read ``key``.

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """
        fields = self._read_fields(recursive=False)
        answer = self._v2("read", key, "GET", fields, self._deadline(deadline))
        return self._note_index(_node(answer.unwrap(), "read", key))

    def list_dir(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> Node:
        """Read directory ``key`` with its immediate children (all levels if ``recursive``).

        Raises:
            KeyNotFoundError: the directory does not exist (``etcd_index`` tells when).
        """
        # Its own op ("list"), as on v3, so that the metrics tell listings from reads.
        fields = self._read_fields(recursive=recursive)
        answer = self._v2("list", key, "GET", fields, self._deadline(deadline))
        return self._note_index(_node(answer.unwrap(), "list", key))

    def _read_fields(self, *, recursive: bool) -> dict[str, str]:
        fields = {"recursive": _flag(recursive)}
        if self._quorum_reads:
            fields["quorum"] = "true"
        return fields

    def _wait_for_change(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool
    ) -> Node | None:
        """Wait for the first change of ``key`` at or after etcd ``index``.

        Returns the change, or ``None`` when ``deadline`` passed. Connection failures are
        retried until then.

        A v2 wait is a long poll, which a member answers only when the key changes: a
        poll lasts at most ``silence_timeout`` and is then sent again from ``index``;
        when nothing else was heard from its member meanwhile either, the next poll
        goes to the next endpoint (a frozen member and an idle one look the same).

        Raises:
            WatchHistoryLostError: etcd answered "event index cleared" (401).
        """
        endpoints = self._endpoints
        while not deadline.expired():
            idx = endpoints.pick()
            remaining = deadline.remaining()
            poll = min(remaining, endpoints.timeouts.silence)
            try:
                return self._poll(key, index, poll, recursive, deadline)
            except PollEndedError:
                if poll >= remaining:
                    return None  # that poll was the whole wait
            except RendezvousConnectionError:
                if deadline.expired():
                    return None
                raise
            if endpoints.silent_for(idx) >= endpoints.timeouts.silence:
                endpoints.leave_silent(idx, f"watching {key!r}")
        return None

    def _poll(
        self, key: str, index: int, seconds: float, recursive: bool, deadline: Deadline
    ) -> Node | None:
        """One long poll of at most ``seconds`` (connection failures retried until
        ``deadline``); raises :class:`PollEndedError` if nothing changed."""
        fields = {"wait": "true", "waitIndex": index, "recursive": _flag(recursive)}
        # At least a moment: a read timeout of 0 s would not wait at all.
        poll = max(seconds, 0.001)
        try:
            watched = self._v2("watch", key, "GET", fields, deadline, poll=poll)
            return self._note_index(_node(watched.unwrap(), "watch", key))
        except HistoryClearedError as exc:
            raise WatchHistoryLostError(key, index, str(exc)) from None
        except KeyNotFoundError:
            # Watching a missing key works in etcd; this only happens for a
            # missing parent directory on some versions. Treat as "no change yet".
            return None

    def watch_stream(
        self,
        key: str,
        start_index: int,
        *,
        recursive: bool = False,
        deadline: Deadline | None = None,
    ) -> WatchStream:
        """The changes of ``key`` (or below it) from etcd index ``start_index`` on, over
        streaming watch requests (``stream=true``): one for every change made after the
        stream opened, one more per change that was already in etcd's history (see
        :mod:`etcd_rendezvous._transport.v2_watch`). Opened before returning, retrying like any
        operation.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable until ``deadline``.
        """
        stream = V2WatchStream(self._session, self._endpoints, key, start_index, recursive)
        self._adopt(stream)
        stream.start(self._deadline(deadline))
        return stream

    def server_version(self, *, deadline: Deadline | None = None) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""
        if self._version is None:
            what, deadline = "query the version of", self._deadline(deadline)
            answer = self._v2(what, "/version", "GET", None, deadline, path="/version")
            self._version = str(answer.unwrap()[0].get("etcdserver", ""))
        return self._version

    def can_refresh_directory_ttl(self, *, deadline: Deadline | None = None) -> bool:
        """etcd 3.5 and later answer "Not a file" to refreshing a directory's TTL."""
        version = self.server_version(deadline=deadline)
        try:
            major, minor = (int(part) for part in version.split(".")[:2])
        except ValueError:
            return True
        return (major, minor) < (3, 5)

    def time_to_live(self, node: Node, *, deadline: Deadline | None = None) -> int | None:
        """The TTL v2 reported with ``node``."""
        return node.ttl

    # -- writes -----------------------------------------------------------------------

    def set(
        self,
        key: str,
        value: str | None,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Unconditionally write ``key`` (idempotent, so re-sent freely)."""
        fields = _form(value, ttl)
        answer = self._v2("write", key, "PUT", fields, self._deadline(deadline))
        return self._note_index(_node(answer.unwrap(), "write", key))

    def update(
        self, key: str, value: str, *, ttl: int, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Rewrite the existing ``key`` (``prevExist``: a plain write would give it a new
        creation index); raises :class:`KeyNotFoundError` if it is gone. ``lease`` is
        for v3 (v2 restarts the TTL)."""
        fields = _form(value, ttl, prevExist="true")
        answer = self._v2("update", key, "PUT", fields, self._deadline(deadline))
        return self._note_index(_node(answer.unwrap(), "update", key))

    def refresh(
        self, key: str, ttl: int, *, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Reset the TTL of an existing key without changing its value or notifying
        watchers. ``lease`` is for v3 (v2 refreshes in one request anyway)."""
        return self._refresh(key, ttl, self._deadline(deadline))

    def compare_and_refresh(
        self, key: str, value: str, ttl: int, *, deadline: Deadline | None = None
    ) -> Node:
        """:meth:`refresh` with ``prevValue``: one request, as without it."""
        return self._refresh(key, ttl, self._deadline(deadline), prevValue=value)

    def _refresh(self, key: str, ttl: int, deadline: Deadline, **condition: str) -> Node:
        what = "refresh the TTL of"
        fields = _form(None, ttl, refresh="true", prevExist="true", **condition)
        return self._note_index(
            _node(self._v2(what, key, "PUT", fields, deadline).unwrap(), what, key)
        )

    def mkdir(self, key: str, *, ttl: int | None = None, deadline: Deadline | None = None) -> bool:
        """Create directory ``key`` unless it exists. Returns whether it was created."""
        fields = _form(None, ttl, dir="true", prevExist="false")
        try:
            self._v2("create the directory", key, "PUT", fields, self._deadline(deadline)).unwrap()
        except KeyExistsError:
            return False
        return True

    def create(
        self, key: str, value: str, *, ttl: int | None = None, deadline: Deadline | None = None
    ) -> Node:
        """Create ``key`` with ``value`` (``prevExist=false``; see
        :meth:`Transport.create <etcd_rendezvous._transport.interface.Transport.create>`)."""
        deadline = self._deadline(deadline)
        done = self._nodes("create", key, _form(value, ttl, prevExist="false"), deadline)
        return self._settle("create", key, value, None, done, deadline)

    def compare_and_swap(
        self,
        key: str,
        value: str,
        prev: Node | int,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Replace ``prev`` with ``value`` if ``key`` still holds ``prev.value`` at
        ``prev.modified_index`` (PyTorch's workers compare the value alone; the index
        also rules out a key that went through other values and came back), or, for
        an index ``prev``, if ``key`` is still at that index (``prevIndex`` alone). See
        :meth:`Transport.compare_and_swap
        <etcd_rendezvous._transport.interface.Transport.compare_and_swap>`."""
        if isinstance(prev, int):
            conditions: dict[str, Any] = {"prevIndex": prev}
            since = prev
        else:
            if prev.value is None:
                raise ValueError(f"compare_and_swap: {key!r} has no value to compare against.")
            conditions, since = _prev_conditions(prev), prev.modified_index
        deadline = self._deadline(deadline)
        fields = _form(value, ttl, **conditions)
        done = self._nodes("compare-and-swap", key, fields, deadline)
        return self._settle("compare-and-swap", key, value, since, done, deadline)

    def _nodes(
        self, what: str, key: str, fields: dict[str, Any], deadline: Deadline
    ) -> Attempt[Node]:
        """A conditional write (PUT ``fields``) sent until etcd answers it, as the node
        written, for :meth:`_settle`."""
        done = self._v2(what, key, "PUT", fields, deadline)
        node = None if done.result is None else _node(done.result, what, key)
        return Attempt(done.outcome, node, done.refusal, done.failure, done.after_unknown)

    def compare_and_delete(self, key: str, prev: Node, *, deadline: Deadline | None = None) -> bool:
        """Delete ``key`` only if its modification index is still ``prev``'s. Returns
        whether it did; a delete whose answer was lost counts as ours if the key's next
        change after ``prev`` was a compare-and-delete.

        The value is not compared: a DELETE carries its conditions in the URL, and etcd
        3.5 resets connections when many DELETEs with URLs of several kilobytes arrive
        at once.
        """
        deadline = self._deadline(deadline)
        fields = {"prevIndex": prev.modified_index}
        done = self._v2("compare-and-delete", key, "DELETE", fields, deadline)
        if done.outcome is Outcome.APPLIED:
            return True
        if done.after_unknown:
            change = self.first_change_after(key, prev.modified_index, deadline=deadline)
            return change is not None and change.action == "compareAndDelete"
        return False

    def check_writable(self, prefix: str, *, deadline: Deadline | None = None) -> None:
        """A compare-and-swap below ``prefix`` that cannot apply (on a key that no one
        writes, from an index it cannot have): etcd checks the user's permission first."""
        probe = f"{prefix.rstrip('/')}/_permission-check-{uuid.uuid4().hex}"
        fields = _form("", None, prevIndex=1)
        what, deadline = "write below", self._deadline(deadline)
        try:
            self._v2(what, prefix, "PUT", fields, deadline, path=key_path(probe)).unwrap()
        except (KeyNotFoundError, CompareFailedError):
            return

    def check_size(self, prefix: str, size: int, *, deadline: Deadline | None = None) -> None:
        """A compare-and-swap of ``size`` bytes on a key below ``prefix`` that no one
        writes, from an index it cannot have: etcd parses the form (and refuses one too
        large) first."""
        probe = f"{prefix.rstrip('/')}/_size-check-{uuid.uuid4().hex}"
        fields = _form("x" * max(size, 0), None, prevIndex=1)
        what, deadline = "check the size limit below", self._deadline(deadline)
        try:
            self._v2(what, prefix, "PUT", fields, deadline, path=key_path(probe)).unwrap()
        except (KeyNotFoundError, CompareFailedError):
            return

    def delete(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> bool:
        """Delete ``key`` (a directory with ``recursive``). Returns whether it existed."""
        fields = {"recursive": _flag(recursive)}
        if recursive:
            fields["dir"] = "true"
        try:
            self._v2("delete", key, "DELETE", fields, self._deadline(deadline)).unwrap()
        except KeyNotFoundError:
            return False
        return True


def _form(value: str | None, ttl: int | None, **options: Any) -> dict[str, Any]:
    """The form of a write, in python-etcd's order: ``value`` (unless ``None``), ``ttl``
    (unless ``None``), then ``options`` (conditions and flags) as given."""
    form: dict[str, Any] = {}
    if value is not None:
        form["value"] = value
    if ttl is not None:
        form["ttl"] = ttl
    return {**form, **options}


def _prev_conditions(prev: Node) -> dict[str, Any]:
    conditions: dict[str, Any] = {"prevIndex": prev.modified_index}
    if prev.value:
        # etcd refuses an empty prevValue; the index alone is the stronger check.
        conditions["prevValue"] = prev.value
    return conditions
