"""The v3 transport: etcd's v3 API as JSON over HTTP (the gRPC gateway), with urllib3.

:class:`EtcdV3Connection` implements :class:`~etcd_rendezvous._transport.interface.Transport`
with the v2 connection's contract: indexes are revisions, TTLs leases, directories key
prefixes (with a marker key), watches streaming watches. See docs/etcd-v3.rst, sections
"How the layout maps" and "Inside the transport".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import urllib3
from urllib3.exceptions import HTTPError

from ..api import Deadline, RendezvousConnectionError
from . import v3_wire as wire
from .attempt import Attempt
from .base import Connection
from .interface import (
    CompareFailedError,
    ConnectionOptions,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    OperationRefusedError,
    WatchStream,
)
from .metering import op_name
from .v3_session import LeaseGoneError, V3Session
from .v3_watch import V3WatchStream

if TYPE_CHECKING:
    from typing_extensions import Unpack  # Python 3.10 has no typing.Unpack

__all__ = ["EtcdV3Connection"]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]

#: TTLs at least this long only serve to clean up after a job: their leases are shared.
_SHARED_LEASE_MIN_TTL = 60
#: A shared lease is reused while at least this fraction of its TTL remains.
_SHARED_LEASE_FRESHNESS = 0.9


#: The key :meth:`EtcdV3Connection.check_writable` and :meth:`~EtcdV3Connection.check_size`
#: would write (they never do).
_PROBE_NAME = "_permission-check"


#: One request of a write attached to a lease: ``(lease, endpoint, cap) -> node``.
_LeasedSend = Callable[[int, int, "float | None"], Node]


class EtcdV3Connection(Connection):
    """A connection to an etcd cluster over the v3 API's JSON gateway, through a
    :class:`~etcd_rendezvous._transport.v3_session.V3Session` (one urllib3 pool manager
    for all endpoints) that its watch streams share. The options are
    :class:`~etcd_rendezvous._transport.interface.Transport`'s.
    """

    api = "v3"

    def __init__(self, endpoints: Sequence[Endpoint], **options: Unpack[ConnectionOptions]) -> None:
        super().__init__(endpoints, **options)
        self._session = V3Session(self._endpoints, self._access, self._clock)
        self._version: str | None = None
        # The leases of directories made with a TTL (directory -> lease), and the shared
        # clean-up leases (ttl -> (lease, monotonic time of the grant)).
        self._dir_leases: dict[str, int] = {}
        self._shared_leases: dict[int, tuple[int, float]] = {}
        #: Every shared lease this connection granted (see :meth:`close`).
        self._granted_shared: set[int] = set()
        self._lease_lock = threading.Lock()

    def close(self) -> None:
        """Revoke the shared leases this connection granted that hold no key, close the
        watch streams and release the pooled connections. Idempotent.

        A shared lease (a TTL of a minute or more: the two-hour clean-up TTL of a run's
        keys) is owned by the connection that granted it: only its writes attach keys
        to it, and the writes of another connection below a directory whose marker
        holds it (see :meth:`mkdir`). So a shared lease that holds no key when its owner
        closes gets no key any more (the owner writes no more; a directory adopted
        elsewhere is gone with its marker, and a write that finds the lease gone is sent
        without it), and nothing but this connection would ever revoke it: it is
        revoked here, rather than left for its two hours. A lease that still holds a
        key (the state of a live run, a run directory's marker) is left to lapse, as
        v2 leaves a TTL: other nodes' runs rely on those keys. Each revocation is
        asked for within ``request_timeout`` in all; one that fails is logged, and the
        lease lapses by itself.
        """
        if not self.closed:
            self._revoke_unused_leases(Deadline(self._endpoints.timeouts.request))
        super().close()

    def _revoke_unused_leases(self, deadline: Deadline) -> None:
        """Revoke each shared lease granted here that holds no key (see :meth:`close`)."""
        with self._lease_lock:
            granted, self._granted_shared = sorted(self._granted_shared), set()
        for lease in granted:
            try:
                body = {"ID": str(lease), "keys": True}
                data = self._call("read the lease of", "", "/v3/lease/timetolive", body, deadline)
                if int(data.get("TTL", -1)) <= 0 or data.get("keys"):
                    continue  # lapsed already, or holds keys: left to lapse
                self._call(
                    "revoke the lease of", "", "/v3/lease/revoke", {"ID": str(lease)}, deadline
                )
            except (RendezvousConnectionError, OperationRefusedError, LeaseGoneError) as exc:
                logger.info("Could not revoke the unused lease %d (it lapses): %s", lease, exc)

    def _release(self) -> None:
        self._session.release()

    # -- one request ------------------------------------------------------------------

    def _attempt(
        self,
        idx: int,
        path: str,
        body: dict[str, Any] | None,
        what: str,
        key: str,
        cap: float | None,
    ) -> dict[str, Any]:
        """One request to endpoint ``idx`` to ``what`` ``key`` (see
        :meth:`V3Session.attempt <etcd_rendezvous._transport.v3_session.V3Session.attempt>`),
        noting the revision it answers at."""
        data = self._session.attempt(idx, path, body, f"{what} {key!r}", cap, op_name(what))
        self._note_revision(wire.revision(data))
        return data

    def _call(
        self,
        what: str,
        key: str,
        path: str,
        body: dict[str, Any] | None,
        deadline: Deadline,
    ) -> dict[str, Any]:
        """One operation: the request, sent until etcd answers it by ``deadline``."""
        done = self._endpoints.operate(
            what,
            key,
            lambda idx, cap: self._attempt(idx, path, body, what, key, cap),
            deadline=deadline,
        )
        return done.unwrap()

    # -- leases -----------------------------------------------------------------------

    def _grant(self, ttl: int, key: str, deadline: Deadline) -> int:
        if ttl >= _SHARED_LEASE_MIN_TTL:
            with self._lease_lock:
                shared = self._shared_leases.get(ttl)
            fresh_until = ttl * (1 - _SHARED_LEASE_FRESHNESS)
            if shared is not None and time.monotonic() - shared[1] < fresh_until:
                return shared[0]
        data = self._call("grant a lease for", key, "/v3/lease/grant", {"TTL": int(ttl)}, deadline)
        lease = int(data.get("ID", 0))
        if not lease:
            raise OperationRefusedError(f"etcd granted no lease for {key!r}: {data!r:.200}")
        if ttl >= _SHARED_LEASE_MIN_TTL:
            with self._lease_lock:
                self._shared_leases[ttl] = (lease, time.monotonic())
                self._granted_shared.add(lease)
        return lease

    def _forget_lease(self, lease: int) -> None:
        with self._lease_lock:
            for name in [k for k, v in self._dir_leases.items() if v == lease]:
                del self._dir_leases[name]
            for ttl in [t for t, (v, _) in self._shared_leases.items() if v == lease]:
                del self._shared_leases[ttl]

    def _inherited_lease(self, key: str) -> int:
        """The lease of the closest directory above ``key`` made with a TTL (0: none)."""
        with self._lease_lock:
            best, lease = "", 0
            for directory, dir_lease in self._dir_leases.items():
                if key.startswith(directory + "/") and len(directory) > len(best):
                    best, lease = directory, dir_lease
            return lease

    def _lease_for(self, key: str, ttl: int | None, deadline: Deadline) -> int:
        return self._grant(ttl, key, deadline) if ttl else self._inherited_lease(key)

    def _leased(
        self,
        what: str,
        key: str,
        ttl: int | None,
        send: _LeasedSend,
        deadline: Deadline,
        known: int = 0,
    ) -> Attempt[Node]:
        """Send a write that attaches ``key`` to a lease until etcd answers it:
        ``send(lease, endpoint, cap)`` is one request. The lease is ``known`` (the
        caller's own, see :meth:`update`), a new one for ``ttl``, or the directory's; one
        that vanished meanwhile is replaced (twice at most). Sent until ``deadline``."""
        lease = known or self._lease_for(key, ttl, deadline)
        for replacements_left in (2, 1, 0) if known else (1, 0):
            done = self._endpoints.operate(
                what, key, functools.partial(send, lease), deadline=deadline
            )
            if not isinstance(done.refusal, LeaseGoneError):
                return done
            # Refused for a gone lease: sent again with another. The next operate()
            # starts without after_unknown: harmless, as an earlier copy's key went with
            # the gone lease.
            self._forget_lease(lease)
            if not replacements_left:
                raise OperationRefusedError(
                    f"Could not {what} {key!r}: its lease {lease} vanished twice in a row."
                )
            if not ttl and lease != known:
                logger.warning(
                    "The lease of the directory above %s is gone (its TTL lapsed or it "
                    "was deleted); writing the key without it",
                    key,
                )
            lease = self._lease_for(key, ttl, deadline)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- reads ------------------------------------------------------------------------

    def server_version(self, *, deadline: Deadline | None = None) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""
        if self._version is None:
            data = self._call(
                "query the version of", "/version", "/version", None, self._deadline(deadline)
            )
            self._version = str(data.get("etcdserver", ""))
        return self._version

    def can_refresh_directory_ttl(self, *, deadline: Deadline | None = None) -> bool:
        """Always: a directory's TTL is a lease, and leases are kept alive."""
        return True

    def get(self, key: str, *, deadline: Deadline | None = None) -> Node:
        """Read ``key`` (one range request).

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """
        key = wire.norm(key)
        body = {"key": wire.b64(key)}
        data = self._call("read", key, "/v3/kv/range", body, self._deadline(deadline))
        revision = wire.revision(data)
        kvs = wire.kvs(data)
        if not kvs:
            raise KeyNotFoundError(key, revision)
        return wire.kv_node(kvs[0], revision)

    def list_dir(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> Node:
        """Read directory ``key``: its marker and the keys below, in one range request
        (a read: a transaction would count as a write in etcd's metrics).

        The range from ``key`` to the end of the ``key/`` prefix also holds the keys that
        merely extend ``key`` with a character sorting before ``/`` (``key-x``, ``key.x``);
        they are left out.

        Given with its trailing ``/``, ``key``'s own marker is not read (a user granted
        ``--prefix key/`` may not read it): the directory node has no index or lease.

        Raises:
            KeyNotFoundError: neither ``key`` nor any key below it exists.
        """
        start = key
        key = wire.norm(key)
        below_key = wire.prefix_below(key)
        first = below_key if wire.below_only(start) else key
        body = {"key": wire.b64(first), "range_end": wire.prefix_end(below_key)}
        data = self._call("list", key, "/v3/kv/range", body, self._deadline(deadline))
        revision = wire.revision(data)
        own: list[dict[str, Any]] = []
        below: list[dict[str, Any]] = []
        for kv in wire.kvs(data):
            name = wire.unb64(kv.get("key"))
            if name == key:
                own.append(kv)
            elif name.startswith(below_key):
                below.append(kv)
        if not own and not below:
            raise KeyNotFoundError(key, revision)
        marker = wire.kv_node(own[0], revision) if own else None
        return wire.directory(key, marker, below, revision, recursive)

    def time_to_live(self, node: Node, *, deadline: Deadline | None = None) -> int | None:
        """Seconds left on ``node``'s lease (``None``: no lease, or the lease is gone)."""
        if not node.lease:
            return None
        data = self._call(
            "read the lease of",
            node.key,
            "/v3/lease/timetolive",
            {"ID": str(node.lease)},
            self._deadline(deadline),
        )
        # An expired lease answers TTL -1; 0 seconds left is a default, so left out.
        ttl = int(data.get("TTL", 0))
        return ttl if ttl >= 0 else None

    def _wait_for_change(
        self, key: str, index: int, deadline: Deadline, *, recursive: bool
    ) -> Node | None:
        """Wait for the first change of ``key`` (or below it) at or after revision ``index``:
        a watch stream, closed after its first change.

        Returns the change, or ``None`` when ``deadline`` passed.

        Raises:
            WatchHistoryLostError: the revision was compacted.
        """
        stream = V3WatchStream(self._session, self._endpoints, key, index, recursive)
        self._adopt(stream)
        with stream:
            node = stream.next(deadline)
        return None if node is None else self._note_index(node)

    def watch_stream(
        self,
        key: str,
        start_index: int,
        *,
        recursive: bool = False,
        deadline: Deadline | None = None,
    ) -> WatchStream:
        """The changes of ``key`` (or below it) from revision ``start_index`` on, over one
        ``POST /v3/watch`` answer kept open (reopened from where it broke, on the next
        endpoint, if it breaks). Opened before returning, retrying like any operation.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable until ``deadline``.
        """
        stream = V3WatchStream(self._session, self._endpoints, key, start_index, recursive)
        self._adopt(stream)
        stream.start(self._deadline(deadline))
        return stream

    # -- writes -----------------------------------------------------------------------

    def set(
        self,
        key: str,
        value: str | None,
        *,
        ttl: int | None = None,
        deadline: Deadline | None = None,
    ) -> Node:
        """Write ``key`` (idempotent, so re-sent freely); ``ttl`` attaches a new lease."""
        text = "" if value is None else value

        def send(lease: int, idx: int, cap: float | None) -> Node:
            body: dict[str, Any] = {"key": wire.b64(key), "value": wire.b64(text)}
            if lease:
                body["lease"] = str(lease)
            data = self._attempt(idx, "/v3/kv/put", body, "write", key, cap)
            revision = wire.revision(data)
            return wire.written(key, text, revision, revision, "set", lease)

        return self._leased("write", key, ttl, send, self._deadline(deadline)).unwrap()

    def update(
        self, key: str, value: str, *, ttl: int, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Rewrite the existing ``key`` (a transaction on ``create_revision > 0``: a put
        keeps the creation revision); a new lease of ``ttl`` unless ``lease`` (the
        caller's own) is alive. Idempotent, so re-sent freely.

        Raises:
            KeyNotFoundError: the key is gone.
        """

        def send(lease: int, idx: int, cap: float | None) -> Node:
            body = wire.update_txn(key, value, lease)
            data = self._attempt(idx, "/v3/kv/txn", body, "update", key, cap)
            revision = wire.revision(data)
            if not data.get("succeeded"):
                raise KeyNotFoundError(key, revision)
            return wire.written(key, value, revision, revision, "update", lease)

        return self._leased("update", key, ttl, send, self._deadline(deadline), lease).unwrap()

    def refresh(
        self, key: str, ttl: int, *, lease: int = 0, deadline: Deadline | None = None
    ) -> Node:
        """Keep ``key``'s lease alive (its TTL starts again), without waking watchers.

        The key's current lease is read first: another worker's write may have moved
        the key to a lease of its own since we last wrote it (v2 refreshes whatever TTL
        the key has now, and so do we). A lease's TTL is fixed when it is granted:
        asking a key for a longer TTL than its lease's attaches a new lease (a write
        that watchers see). A directory's lease, shared with the keys below it, keeps
        its TTL.

        A caller that alone writes ``key`` passes the ``lease`` of its last write (or
        refresh): that lease is kept alive at once, and the key is read only if the lease
        is gone or shorter than ``ttl``. One request per refresh instead of two.

        Raises:
            KeyNotFoundError: the key is gone, or its lease lapsed.
        """
        key = wire.norm(key)
        deadline = self._deadline(deadline)
        if lease:
            body = {"ID": str(lease)}
            data = self._call("refresh the TTL of", key, "/v3/lease/keepalive", body, deadline)
            result = data.get("result", data)
            if int(result.get("TTL", 0) or 0) >= ttl:
                return wire.written(key, None, wire.revision(data), 0, "refresh", lease)
            # Lapsed (the key with it), or shorter than asked: do as without a lease.
        node = self.get(key, deadline=deadline)
        return self._keep_alive(key, node, ttl, deadline)

    def compare_and_refresh(
        self, key: str, value: str, ttl: int, *, deadline: Deadline | None = None
    ) -> Node:
        """:meth:`refresh` after comparing the value read, as a keep-alive takes no
        condition: between the read and the keep-alive, the key can change hands only if
        its lease lapses (then the keep-alive fails too) or its holder deletes it (a
        caller that alone deletes the key, as the aggregator lock's holder does, rules
        that out). A new lease is attached only if the key is still as read. Two
        requests, as :meth:`refresh` without ``lease``."""
        key = wire.norm(key)
        deadline = self._deadline(deadline)
        node = self.get(key, deadline=deadline)
        if node.value != value:
            raise CompareFailedError(key, node.etcd_index)
        return self._keep_alive(key, node, ttl, deadline, node.modified_index)

    def _keep_alive(
        self, key: str, node: Node, ttl: int, deadline: Deadline, unless_changed: int = 0
    ) -> Node:
        """Keep alive the lease of ``node`` (``key`` as read), or attach a new one of
        ``ttl`` if it has none or a shorter one (only if its modification revision is
        still ``unless_changed``, unless that is 0)."""
        if not node.lease:
            # The key has no TTL: give it one, keeping its value (a v2 refresh would).
            return self._attach_new_lease(key, ttl, deadline, unless_changed)
        body = {"ID": str(node.lease)}
        data = self._call("refresh the TTL of", key, "/v3/lease/keepalive", body, deadline)
        result = data.get("result", data)
        if "TTL" not in result or int(result.get("TTL", 0)) <= 0:
            self._forget_lease(node.lease)
            raise KeyNotFoundError(key, wire.revision(data) or None)
        with self._lease_lock:
            directory = self._dir_leases.get(key) == node.lease
        if int(result["TTL"]) < ttl and not directory:
            return self._attach_new_lease(key, ttl, deadline, unless_changed)
        return node

    def _attach_new_lease(
        self, key: str, ttl: int, deadline: Deadline, unless_changed: int = 0
    ) -> Node:
        lease = self._grant(ttl, key, deadline)
        body = {"key": wire.b64(key), "lease": str(lease), "ignore_value": True}
        if unless_changed:
            txn = wire.guarded_txn(key, unless_changed, {"request_put": body})
            data = self._call("refresh the TTL of", key, "/v3/kv/txn", txn, deadline)
            if not data.get("succeeded"):
                raise wire.compare_failure(key, data, wire.revision(data))
        else:
            data = self._call("refresh the TTL of", key, "/v3/kv/put", body, deadline)
        revision = wire.revision(data)
        return wire.written(key, None, revision, 0, "refresh", lease)

    def mkdir(self, key: str, *, ttl: int | None = None, deadline: Deadline | None = None) -> bool:
        """Create the marker key of directory ``key`` unless it exists.

        With ``ttl``, the directory gets a lease that every key written below it through
        this connection shares. If the directory exists, its lease (if any) is adopted.
        """
        key = wire.norm(key)

        def send(lease: int, idx: int, cap: float | None) -> Node:
            body = wire.create_txn(key, "", lease)
            data = self._attempt(idx, "/v3/kv/txn", body, "create the directory", key, cap)
            revision = wire.revision(data)
            if data.get("succeeded"):
                return wire.written(key, "", revision, revision, "create", lease)
            existing = wire.kvs((data.get("responses") or [{}])[0])
            found = int(existing[0].get("lease", 0)) if existing else 0
            return wire.written(key, "", revision, 0, "get", found)

        node = self._leased(
            "create the directory", key, ttl, send, self._deadline(deadline)
        ).unwrap()
        if node.lease:
            with self._lease_lock:
                self._dir_leases[key] = node.lease
        return node.action == "create"

    def create(
        self, key: str, value: str, *, ttl: int | None = None, deadline: Deadline | None = None
    ) -> Node:
        """Create ``key`` with ``value`` (a transaction on ``create_revision == 0``; see
        :meth:`Transport.create <etcd_rendezvous._transport.interface.Transport.create>`)."""

        def send(lease: int, idx: int, cap: float | None) -> Node:
            body = wire.create_txn(key, value, lease)
            data = self._attempt(idx, "/v3/kv/txn", body, "create", key, cap)
            revision = wire.revision(data)
            if not data.get("succeeded"):
                raise KeyExistsError(key, revision)
            return wire.written(key, value, revision, revision, "create", lease)

        deadline = self._deadline(deadline)
        done = self._leased("create", key, ttl, send, deadline)
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
        """Replace ``prev`` with ``value`` if ``key``'s ``mod_revision`` is still ``prev``'s
        (or is ``prev``, an index); see :meth:`Transport.compare_and_swap
        <etcd_rendezvous._transport.interface.Transport.compare_and_swap>`."""
        if isinstance(prev, int):
            since, created = prev, 0  # the gateway's txn answer does not tell it
        elif prev.value is None:
            raise ValueError(f"compare_and_swap: {key!r} has no value to compare against.")
        else:
            since, created = prev.modified_index, prev.created_index

        def send(lease: int, idx: int, cap: float | None) -> Node:
            put: dict[str, Any] = {"key": wire.b64(key), "value": wire.b64(value)}
            if lease:
                put["lease"] = str(lease)
            body = wire.guarded_txn(key, since, {"request_put": put})
            data = self._attempt(idx, "/v3/kv/txn", body, "compare-and-swap", key, cap)
            revision = wire.revision(data)
            if not data.get("succeeded"):
                raise wire.compare_failure(key, data, revision)
            return wire.written(key, value, revision, created, "compareAndSwap", lease)

        deadline = self._deadline(deadline)
        done = self._leased("compare-and-swap", key, ttl, send, deadline)
        return self._settle("compare-and-swap", key, value, since, done, deadline)

    def compare_and_delete(self, key: str, prev: Node, *, deadline: Deadline | None = None) -> bool:
        """Delete ``key`` if its ``mod_revision`` is still ``prev``'s. Returns whether it
        did; a delete whose answer was lost counts as ours if the key's next change after
        ``prev`` was a deletion (v3 cannot tell whose)."""
        delete = {"request_delete_range": {"key": wire.b64(key)}}
        body = wire.guarded_txn(key, prev.modified_index, delete)
        deadline = self._deadline(deadline)
        done = self._endpoints.operate(
            "compare-and-delete",
            key,
            lambda idx, cap: self._attempt(idx, "/v3/kv/txn", body, "compare-and-delete", key, cap),
            deadline=deadline,
        )
        if done.unwrap().get("succeeded"):
            return True
        if done.after_unknown:
            change = self.first_change_after(key, prev.modified_index, deadline=deadline)
            return change is not None and change.action == "delete"
        return False

    def delete(
        self, key: str, *, recursive: bool = False, deadline: Deadline | None = None
    ) -> bool:
        """Delete ``key`` (and every key below it with ``recursive``). Returns whether any
        existed."""
        key = wire.norm(key)
        ops: list[dict[str, Any]] = [{"request_delete_range": {"key": wire.b64(key)}}]
        if recursive:
            below = {"key": wire.b64(key + "/"), "range_end": wire.prefix_end(key + "/")}
            ops.append({"request_delete_range": below})
        data = self._call("delete", key, "/v3/kv/txn", {"success": ops}, self._deadline(deadline))
        with self._lease_lock:
            for name in [k for k in self._dir_leases if k == key or k.startswith(key + "/")]:
                del self._dir_leases[name]
        deleted = sum(
            int(response.get("response_delete_range", {}).get("deleted", 0))
            for response in data.get("responses") or []
        )
        return deleted > 0

    def check_writable(self, prefix: str, *, deadline: Deadline | None = None) -> None:
        """A transaction whose put below ``prefix`` cannot apply (its key's version is
        compared with "less than 0"): etcd checks the permissions of every operation
        of a transaction, applied or not."""
        self._never_applied("write below", prefix, "", self._deadline(deadline))

    def check_size(self, prefix: str, size: int, *, deadline: Deadline | None = None) -> None:
        """A transaction whose put of ``size`` bytes below ``prefix`` cannot apply (as
        :meth:`check_writable`'s): etcd refuses a request too large before looking at it."""
        value = "x" * max(size, 0)
        self._never_applied("check the size limit below", prefix, value, self._deadline(deadline))

    def _never_applied(self, what: str, prefix: str, value: str, deadline: Deadline) -> None:
        """A transaction putting ``value`` below ``prefix`` whose condition never holds
        (the probe key's version compared with "less than 0")."""
        probe = f"{prefix.rstrip('/')}/{_PROBE_NAME}"
        never = {"key": wire.b64(probe), "target": "VERSION", "result": "LESS", "version": "0"}
        put = {"request_put": {"key": wire.b64(probe), "value": wire.b64(value)}}
        body = {"compare": [never], "success": [put]}
        self._call(what, prefix, "/v3/kv/txn", body, deadline)

    # -- discovery --------------------------------------------------------------------

    def probe(self, deadline: Deadline) -> tuple[str, bool]:
        """The server's version, and whether it serves the v2 API (``GET /v2/keys``).

        Raises:
            RendezvousConnectionError: no endpoint answered before ``deadline`` passed.
        """
        endpoints = self._endpoints
        version = endpoints.operate(
            "query the version of",
            "/version",
            lambda idx, cap: self._session.request(
                idx, "/version", None, cap, "query the version", "version"
            ),
            deadline=deadline,
        ).unwrap()
        self._version = str(version.get("etcdserver", ""))
        idx = endpoints.pick()
        read = min(endpoints.timeouts.request, max(deadline.remaining(), endpoints.last_chance()))
        try:
            response = self._session.pool.request(
                "GET",
                endpoints.url(idx) + "/v2/keys/",
                timeout=urllib3.Timeout(connect=min(endpoints.timeouts.connect, read), read=read),
                retries=False,
            )
        except (HTTPError, OSError) as exc:
            raise RendezvousConnectionError(
                f"etcd endpoint {endpoints.url(idx)} did not answer GET /v2/keys/: {exc}"
            ) from None
        # 404 "page not found": no v2 API. 200, or 401 with auth enabled: v2 is served.
        return self._version, response.status != 404

    def gateway_available(self, deadline: Deadline) -> bool:
        """Whether the current endpoint serves the v3 JSON gateway."""
        try:
            self._call(
                "query the status of",
                "/v3/maintenance/status",
                "/v3/maintenance/status",
                {},
                deadline,
            )
        except RendezvousConnectionError as exc:
            if "JSON gateway" in str(exc):
                return False
            raise
        return True
