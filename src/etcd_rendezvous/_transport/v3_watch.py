"""The v3 watch stream: one ``POST /v3/watch`` answer carries every change.

The answer is a chunked stream of JSON objects: ``created``, then batches of ``events``
(every event of one revision in one batch); a compacted start revision or a refused
auth token arrive as ``canceled``. A single wait is a stream closed after its first
change. See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import json
from typing import Any

import urllib3
from urllib3.exceptions import HTTPError

from ..api import Deadline, RendezvousConnectionError
from . import v3_wire as wire
from .attempt import AmbiguousError
from .endpoints import Endpoints
from .interface import Node, WatchHistoryLostError
from .metering import count_bytes
from .stream import (
    Changes,
    Messages,
    Registered,
    StreamingWatch,
    hold_socket_open,
    iter_objects,
)
from .v3_session import V3Session

__all__ = ["V3WatchStream"]


class V3WatchStream(StreamingWatch):
    """The changes of a key (or of a prefix) over v3 watch answers, from a revision on,
    sent through ``session`` (the connection's) to ``endpoints`` (the connection's)."""

    confirmed_by_status = False

    def __init__(
        self,
        session: V3Session,
        endpoints: Endpoints,
        key: str,
        start_index: int,
        recursive: bool,
    ) -> None:
        super().__init__(endpoints, wire.norm(key), start_index, recursive)
        self._session = session
        #: The range watched: ``key`` and every key starting with it, or, for ``key``
        #: given with its trailing ``/``, only the keys below it (a user whose grant is
        #: ``--prefix key/`` may watch those, not ``key`` itself).
        self._range = wire.watched_range(key, recursive)

    def _open(self, endpoint: int, deadline: Deadline) -> None:
        """One attempt, authenticating first; a watch refused for an expired token is
        sent once more with a fresh one."""
        session = self._session
        for renewal in (False, True):
            session.ensure_token(endpoint, renewal, "watch")
            try:
                super()._open(endpoint, deadline)
                return
            except wire.ReauthError as exc:
                if renewal:
                    detail = f"{str(exc).split(': ', 1)[-1]}, with a fresh auth token"
                    raise session.refusal(
                        endpoint, f"watch {self._key!r}", "read", detail
                    ) from None

    def _send(self, endpoint: int, from_index: int, deadline: Deadline) -> tuple[Any, Messages]:
        endpoints, session = self._endpoints, self._session
        where = f"watch {self._key!r}"
        start, end = self._range
        request: dict[str, Any] = {"key": wire.b64(start)}
        if from_index > 0:  # else from now: the created message says where that is
            request["start_revision"] = str(from_index)
        if end is not None:
            request["range_end"] = end
        # A live member starts its answer at once; then the reader waits for as long
        # as nothing changes (StreamingWatch.next re-arms a wait that stays silent).
        wait = min(endpoints.timeouts.request, max(deadline.remaining(), endpoints.last_chance()))
        body = json.dumps({"create_request": request}).encode()
        count_bytes(len(body), 0, api=endpoints.api, op="watch")
        try:
            response = session.pool.urlopen(
                "POST",
                endpoints.url(endpoint) + "/v3/watch",
                body=body,
                headers=session.headers(),
                timeout=urllib3.Timeout(connect=min(endpoints.timeouts.connect, wait), read=wait),
                retries=False,
                preload_content=False,
            )
        except BaseException as exc:
            raise session.transport_failure(endpoint, exc, where) from None
        endpoints.heard_from(endpoint)
        if response.status != 200:
            error = wire.parse_error(response.status, response.read())
            response.close()
            raise session.server_failure(endpoint, "/v3/watch", error, where)
        hold_socket_open(response)
        url = endpoints.url(endpoint)
        return response, _messages(
            session, url, endpoint, response, self._key, self._recursive, from_index
        )


def _messages(
    session: V3Session,
    endpoint: str,
    idx: int,
    response: Any,
    key: str,
    recursive: bool,
    start: int,
) -> Messages:
    """The messages of one watch answer (from ``endpoint``, number ``idx``)."""
    try:
        for message in iter_objects(response.stream(64 * 1024), "v3"):
            yield _handle(session, endpoint, idx, message, key, recursive, start)
    except (HTTPError, OSError, ValueError, TypeError) as exc:
        raise AmbiguousError(f"{endpoint}: watch stream failed: {exc}") from None
    raise AmbiguousError(f"{endpoint}: the watch stream ended")


def _handle(
    session: V3Session,
    endpoint: str,
    idx: int,
    message: dict[str, Any],
    key: str,
    recursive: bool,
    start: int,
) -> Changes | Registered:
    """The changes in ``message`` of ``key`` (or of keys below it: a recursive watch's
    range also holds siblings such as ``key-2``), or the store revision at which it
    confirms the watch."""
    where = f"watch {key!r}"
    error = wire.stream_error(message)
    if error is not None:
        failure = session.server_failure(idx, "/v3/watch", error, where)
        if isinstance(failure, (wire.ReauthError, RendezvousConnectionError)):
            raise failure
        # The gateway ends a stream whose gRPC call ended ("context canceled" when its
        # connection is reset, say) with an error: reopen it.
        raise AmbiguousError(f"{endpoint}: watch stream ended: {error}")
    result = message.get("result")
    if not isinstance(result, dict):
        return Changes([])
    if result.get("canceled"):
        compacted = int(result.get("compact_revision", 0) or 0)
        if compacted > 0:
            detail = f"etcd compacted its history up to revision {compacted}"
            raise WatchHistoryLostError(key, start, detail)
        reason = str(result.get("cancel_reason", ""))
        cancel = wire.GrpcError(0, reason or "watch canceled", 200)
        denied = "permission denied" in reason.lower() or str(result.get("watch_id")) == "-1"
        if session.username is not None and (cancel.needs_reauth or denied):
            # A watch refused for an expired token says "permission denied": renew the
            # token once; a second refusal is a real one.
            raise wire.ReauthError(f"{endpoint}: {reason}")
        if denied:
            raise RendezvousConnectionError(
                f"etcd endpoint {endpoint} refused to {where}: {reason}. Check "
                "username, password and the user's roles."
            )
        raise AmbiguousError(f"{endpoint}: watch canceled: {reason}")
    header = result.get("header")
    revision = int(header.get("revision", 0)) if isinstance(header, dict) else 0
    if result.get("created"):
        return Registered(revision)  # in place, from the revision after this one
    events = result.get("events")
    below = key if key.endswith("/") else key + "/"
    nodes = [_event_node(event, revision) for event in events or () if isinstance(event, dict)]
    return Changes([n for n in nodes if n.key == key or (recursive and n.key.startswith(below))])


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
