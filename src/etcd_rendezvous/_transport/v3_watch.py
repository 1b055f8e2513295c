"""The v3 watch stream: one ``POST /v3/watch`` answer carries every change.

etcd's gateway answers a watch with a chunked stream of JSON objects: first
``created``, then batches of ``events`` (every event of one revision in the same
batch); a compacted start revision or a refused auth token arrive as ``canceled``. Each
answer is one ``Watch`` gRPC stream in etcd, however many changes it carries.
:class:`V3WatchStream` keeps that answer open across
:meth:`~etcd_rendezvous._transport.interface.WatchStream.next` calls (the shared machinery is
:class:`~etcd_rendezvous._transport.stream.StreamingWatch`); a single wait
(:meth:`EtcdV3Connection.watch`) is a stream closed after its first change.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import urllib3
from urllib3.exceptions import HTTPError

from ..api import RendezvousConnectionError
from . import v3_wire as wire
from .interface import Node, WatchHistoryLostError, _AmbiguousError
from .retry import Deadline
from .stream import Batches, StreamingWatch, hold_socket_open

if TYPE_CHECKING:
    from .v3 import EtcdV3Connection

__all__ = ["V3WatchStream"]


class V3WatchStream(StreamingWatch):
    """The changes of a key (or of a prefix) over v3 watch answers, from a revision on."""

    confirmed_by_status = False

    def __init__(self, conn: EtcdV3Connection, key: str, start_index: int, recursive: bool) -> None:
        super().__init__(conn, wire.norm(key), start_index, recursive)
        self._conn = conn

    def _open(self, deadline: Deadline) -> None:
        """One attempt, authenticating first; a watch refused for an expired token is
        sent once more with a fresh one."""
        from .v3 import _ReauthError  # noqa: PLC0415

        conn = self._conn
        idx = conn._pick()
        for renewal in (False, True):
            conn._ensure_token(idx, renewal)
            try:
                super()._open(deadline)
                return
            except _ReauthError as exc:
                if renewal:
                    detail = f"{str(exc).split(': ', 1)[-1]}, with a fresh auth token"
                    raise conn.refusal(idx, f"watch {self._key!r}", "read", detail) from None

    def _send(self, from_index: int, deadline: Deadline) -> tuple[int, Any, Batches]:
        conn = self._conn
        idx = conn._pick()
        where = f"watch {self._key!r}"
        request: dict[str, Any] = {"key": wire.b64(self._key)}
        if from_index > 0:  # else from now: the created message says where that is
            request["start_revision"] = str(from_index)
        if self._recursive:
            request["range_end"] = wire.prefix_end(self._key)
        # A live member starts its answer at once; then the reader waits for as long
        # as nothing changes (StreamingWatch.next re-arms a wait that stays silent).
        wait = min(conn.request_timeout, max(deadline.remaining(), conn._last_chance()))
        try:
            response = conn._pool.urlopen(
                "POST",
                conn.endpoints[idx] + "/v3/watch",
                body=json.dumps({"create_request": request}).encode(),
                headers=conn._headers(),
                timeout=urllib3.Timeout(connect=min(conn.connect_timeout, wait), read=wait),
                retries=False,
                preload_content=False,
            )
        except BaseException as exc:
            raise conn._transport_failure(idx, exc, where) from None
        conn._heard_from(idx)
        if response.status != 200:
            error = wire.parse_error(response.status, response.read())
            response.close()
            raise conn._server_failure(idx, "/v3/watch", error, where)
        hold_socket_open(response)
        return idx, response, _batches(conn, idx, response, self._key, self._recursive, from_index)


def _batches(
    conn: EtcdV3Connection, idx: int, response: Any, key: str, recursive: bool, start: int
) -> Batches:
    """The messages of one watch answer: for ``created`` the store revision, else its
    changes."""
    endpoint = conn.endpoints[idx]
    try:
        for message in wire.iter_objects(response.stream(64 * 1024)):
            yield _handle(conn, idx, message, key, recursive, start)
    except (HTTPError, OSError, ValueError, TypeError) as exc:
        raise _AmbiguousError(f"{endpoint}: watch stream failed: {exc}") from None
    raise _AmbiguousError(f"{endpoint}: the watch stream ended")


def _handle(
    conn: EtcdV3Connection,
    idx: int,
    message: dict[str, Any],
    key: str,
    recursive: bool,
    start: int,
) -> list[Node] | int:
    """The changes in ``message`` of ``key`` (or of keys below it: a recursive watch's
    range also holds siblings such as ``key-2``); the store revision if it confirms the
    watch."""
    from .v3 import _ReauthError  # noqa: PLC0415

    where = f"watch {key!r}"
    error = wire.stream_error(message)
    if error is not None:
        failure = conn._server_failure(idx, "/v3/watch", error, where)
        if isinstance(failure, (_ReauthError, RendezvousConnectionError)):
            raise failure
        # The gateway ends a stream whose gRPC call ended ("context canceled" when its
        # connection is reset, say) with an error: reopen it.
        raise _AmbiguousError(f"{conn.endpoints[idx]}: watch stream ended: {error}")
    result = message.get("result")
    if not isinstance(result, dict):
        return []
    if result.get("canceled"):
        compacted = int(result.get("compact_revision", 0) or 0)
        if compacted > 0:
            detail = f"etcd compacted its history up to revision {compacted}"
            raise WatchHistoryLostError(key, start, detail)
        reason = str(result.get("cancel_reason", ""))
        cancel = wire.GrpcError(0, reason or "watch canceled", 200)
        denied = "permission denied" in reason.lower() or str(result.get("watch_id")) == "-1"
        if conn._username is not None and (cancel.needs_reauth or denied):
            # A watch refused for an expired token says "permission denied": renew the
            # token once; a second refusal is a real one.
            raise _ReauthError(f"{conn.endpoints[idx]}: {reason}")
        if denied:
            raise RendezvousConnectionError(
                f"etcd endpoint {conn.endpoints[idx]} refused to {where}: {reason}. Check "
                "username, password and the user's roles."
            )
        raise _AmbiguousError(f"{conn.endpoints[idx]}: watch canceled: {reason}")
    header = result.get("header")
    revision = int(header.get("revision", 0)) if isinstance(header, dict) else 0
    if result.get("created"):
        return revision  # the watch is in place, from the revision after this one
    events = result.get("events")
    below = key if key.endswith("/") else key + "/"
    nodes = [_event_node(event, revision) for event in events or () if isinstance(event, dict)]
    return [n for n in nodes if n.key == key or (recursive and n.key.startswith(below))]


def _event_node(event: dict[str, Any], revision: int) -> Node:
    kv = event.get("kv")
    if not isinstance(kv, dict):
        kv = {}
    deleted = event.get("type") == "DELETE"
    modified = int(kv.get("mod_revision", 0))
    return Node(
        key=wire.unb64(kv.get("key")),
        value=None if deleted else wire.unb64(kv.get("value")),
        modified_index=modified,
        created_index=int(kv.get("create_revision", 0)),
        etcd_index=max(revision, modified),
        ttl=None,
        is_dir=False,
        children=(),
        action="delete" if deleted else "create" if int(kv.get("version", 0)) == 1 else "set",
        lease=int(kv.get("lease", 0)),
    )
