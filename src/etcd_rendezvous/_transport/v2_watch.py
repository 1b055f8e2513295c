"""The v2 watch stream: ``GET /v2/keys/<key>?wait=true&stream=true&waitIndex=N``.

python-etcd has no streaming watch; this one is sent through the connection's
:class:`~etcd_rendezvous._transport.v2_session.V2Session`, whose answers it reads as any
v2 request's. etcd answers with ``X-Etcd-Index``, then one JSON object per change. A change
found in etcd's history ends the answer (the stream reopens at once); "event index
cleared" (401) raises :class:`~etcd_rendezvous._transport.interface.WatchHistoryLostError`.
See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import urllib3
from urllib3.exceptions import HTTPError

from ..api import Deadline
from .attempt import AmbiguousError
from .endpoints import Endpoints
from .interface import KeyNotFoundError, Node, WatchHistoryLostError
from .stream import Changes, Messages, StreamingWatch, hold_socket_open, iter_objects
from .v2_session import HistoryClearedError, V2Session, key_path

__all__ = ["V2WatchStream"]


class V2WatchStream(StreamingWatch):
    """The changes of a key (or of a directory) over v2 streaming watches, sent through
    ``session`` (the connection's) to ``endpoints`` (the connection's)."""

    def __init__(
        self,
        session: V2Session,
        endpoints: Endpoints,
        key: str,
        start_index: int,
        recursive: bool,
    ) -> None:
        key_path(key)  # a key that no URL names raises here, not on each attempt
        super().__init__(endpoints, key, start_index, recursive)
        self._session = session

    def _send(self, endpoint: int, from_index: int, deadline: Deadline) -> tuple[Any, Messages]:
        endpoints = self._endpoints
        key = self._key if self._key.startswith("/") else f"/{self._key}"
        fields = {"wait": "true", "stream": "true"}
        if from_index > 0:  # else from now
            fields["waitIndex"] = str(from_index)
        if self._recursive:
            fields["recursive"] = "true"
        # A live member starts its answer at once; then the reader waits for as long
        # as nothing changes (StreamingWatch.next re-arms a wait that stays silent).
        wait = min(endpoints.timeouts.request, max(deadline.remaining(), endpoints.last_chance()))
        timeout = urllib3.Timeout(connect=min(endpoints.timeouts.connect, wait), read=wait)
        path = quote(key_path(key))
        try:
            response = self._session.open_stream(endpoint, path, fields, timeout, key)
        except HistoryClearedError as exc:
            raise WatchHistoryLostError(self._key, from_index, str(exc)) from None
        except KeyNotFoundError:
            # Some etcd versions refuse to watch below a missing directory: nothing
            # changed yet; try again (after a pause) until the caller's deadline.
            raise AmbiguousError(f"watch {key!r}: its parent directory is missing") from None
        hold_socket_open(response)
        # Where etcd registered the watch (or, from an index in its history, the index
        # that the one change it answers with is at or below).
        index = int(response.headers.get("X-Etcd-Index", 0) or 0)
        if from_index == 0:
            with self._cond:
                self._registered_at(index)
        return response, _messages(endpoints.url(endpoint), response, index)


def _messages(endpoint: str, response: Any, etcd_index: int) -> Messages:
    """The changes of one answer, one at a time; ends after a change from the history
    (``etcd_index`` is the answer's ``X-Etcd-Index``), for which etcd watches no more."""
    try:
        for message in iter_objects(response.stream(64 * 1024), "v2"):
            node = _event_node(message, etcd_index)
            yield Changes([node])
            if node.modified_index <= etcd_index:
                return
    except (HTTPError, OSError, ValueError, TypeError) as exc:
        raise AmbiguousError(f"{endpoint}: watch stream failed: {exc}") from None


def _event_node(message: dict[str, Any], etcd_index: int) -> Node:
    """The :class:`Node` of one change (``{"action", "node", "prevNode"}``)."""
    raw = message.get("node")
    if not isinstance(raw, dict) or "action" not in message:
        raise ValueError(f"not a v2 watch event: {message!r:.200}")
    modified = int(raw.get("modifiedIndex", 0))
    return Node(
        key=str(raw.get("key", "")),
        value=raw.get("value"),
        modified_index=modified,
        created_index=int(raw.get("createdIndex", 0)),
        etcd_index=max(etcd_index, modified),
        ttl=raw.get("ttl"),
        is_dir=bool(raw.get("dir", False)),
        children=(),
        action=str(message["action"]),
    )
