"""One wait on a v3 watch stream: open it, return its first event, close it.

A watch is an HTTP request whose answer is a chunked stream of JSON objects: first
``created``, then batches of ``events``; a compacted start revision or a refused auth
token arrive as ``canceled``. One stream per wait keeps the connection's pool simple;
closing the response closes its socket. :meth:`EtcdV3Connection.close` shuts down the
sockets of waits still blocked, so that they return at once.
"""

from __future__ import annotations

import contextlib
import json
import socket
from typing import TYPE_CHECKING, Any

import urllib3
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from . import _v3_http as wire
from ._retry import Deadline
from ._transport import Node, TransportClosedError, _AmbiguousError
from .api import RendezvousConnectionError

if TYPE_CHECKING:
    from ._v3 import EtcdV3Connection

__all__ = ["shutdown_stream", "watch_once"]


def watch_once(
    conn: EtcdV3Connection, body: dict[str, Any], deadline: Deadline, key: str
) -> Node | None:
    """The first event of a watch created with ``body``, or ``None`` at ``deadline``.

    Raises:
        _CompactedError: the start revision was compacted.
        _AmbiguousError, _UnsentError: the stream failed; worth retrying.
        RendezvousConnectionError: a permanent failure (TLS, permissions).
    """
    from ._v3 import _ReauthError  # noqa: PLC0415

    where = f"watch {key!r}"
    idx = conn._pick()
    for renewal in (False, True):
        conn._ensure_token(idx, renewal)
        try:
            return _stream(conn, idx, body, deadline, key)
        except _ReauthError as exc:
            if renewal:
                raise RendezvousConnectionError(
                    f"etcd endpoint {conn.endpoints[idx]} refused to {where} with a fresh auth "
                    f"token ({str(exc).split(': ', 1)[-1]}). Check the user's roles."
                ) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _stream(
    conn: EtcdV3Connection, idx: int, body: dict[str, Any], deadline: Deadline, key: str
) -> Node | None:
    where = f"watch {key!r}"
    remaining = deadline.remaining()
    if remaining <= 0:
        return None
    endpoint = conn.endpoints[idx]
    timeout = urllib3.Timeout(connect=min(conn.connect_timeout, remaining), read=remaining)
    try:
        response = conn._pool.urlopen(
            "POST",
            endpoint + "/v3/watch",
            body=json.dumps(body).encode(),
            headers=conn._headers(),
            timeout=timeout,
            retries=False,
            preload_content=False,
        )
    except BaseException as exc:
        raise conn._transport_failure(idx, exc, where) from None
    conn._track_stream(response, True)
    try:
        if response.status != 200:
            error = wire.parse_error(response.status, response.read())
            raise conn._server_failure(idx, "/v3/watch", error, where)
        for message in wire.iter_objects(response.stream(64 * 1024)):
            node = _handle(conn, idx, message, key)
            if node is not None:
                return node
        raise _AmbiguousError(f"{endpoint}: the watch stream ended")
    except ReadTimeoutError:
        return None
    except (ProtocolError, OSError, ValueError, TypeError) as exc:
        if conn.closed:
            raise TransportClosedError(
                f"Could not {where}: the etcd connection was closed."
            ) from None
        if deadline.expired():
            return None
        raise _AmbiguousError(f"{endpoint}: watch stream failed: {exc}") from None
    finally:
        conn._track_stream(response, False)
        response.close()


def _handle(conn: EtcdV3Connection, idx: int, message: dict[str, Any], key: str) -> Node | None:
    """The node of the first event in ``message`` of ``key`` or a key below it (a
    recursive watch's range also holds siblings such as ``key-2``); ``None`` if none."""
    from ._v3 import _CompactedError, _ReauthError  # noqa: PLC0415

    where = f"watch {key!r}"
    error = wire.stream_error(message)
    if error is not None:
        raise conn._server_failure(idx, "/v3/watch", error, where)
    result = message.get("result")
    if not isinstance(result, dict):
        return None
    if result.get("canceled"):
        compacted = int(result.get("compact_revision", 0) or 0)
        if compacted > 0:
            raise _CompactedError(f"etcd compacted its history up to revision {compacted}")
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
    events = result.get("events")
    if not isinstance(events, list):
        return None
    header = result.get("header")
    if not isinstance(header, dict):
        header = {}
    below = key if key.endswith("/") else key + "/"
    for event in events:
        node = _event_node(event, int(header.get("revision", 0)))
        if node.key == key or node.key.startswith(below):
            return node
    return None


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


def shutdown_stream(response: Any) -> None:
    """Wake a thread blocked reading ``response`` by shutting down its socket."""
    connection = getattr(response, "connection", None) or getattr(response, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
