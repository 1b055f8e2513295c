"""One request of the v2 API: the connection's urllib3 pool, its credentials, and what
etcd's answers mean. The v2 connection and its watch stream both send through a
:class:`V2Session`. See docs/etcd-v3.rst, section "Inside the transport".

A request is sent as python-etcd (and PyTorch) sends it: the key in the path of
``/v2/keys``, its options in the query (GET, DELETE) or as a form (PUT), with the same
headers, so that the bytes on the wire and etcd's answers are those PyTorch's workers
get. An answer is read as python-etcd reads it: its errorCode (404 and 401 count as key
not found and no permission), its ``X-Etcd-Index`` and ``X-Etcd-Cluster-Id`` headers,
and a redirection is an answer, not followed. What urllib3 raises and what etcd answers
become this package's errors here, and never leave this module and the watch's.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any
from urllib.parse import urlencode

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    NewConnectionError,
    ReadTimeoutError,
    SSLError,
)

from ..api import RendezvousConnectionError, RendezvousStateError
from . import limits
from .attempt import (
    ELECTION_MARKERS,
    AmbiguousError,
    UnsentError,
    dropped_during_tls,
    transient_answer,
)
from .clock import ServerClock
from .endpoints import Access, Endpoints, close_pool
from .interface import (
    CompareFailedError,
    ConditionError,
    KeyExistsError,
    KeyNotFoundError,
    OperationRefusedError,
)
from .metering import count_bytes, op_name

__all__ = [
    "KEYS",
    "ErrorAnswer",
    "HistoryClearedError",
    "PollEndedError",
    "V2Session",
    "key_path",
    "transient",
]

logger = logging.getLogger(__name__)

#: The path of the v2 keys below an endpoint's URL.
KEYS = "/v2/keys"

#: Characters that a URL's path does not carry as they are: etcd would read another key.
_URL_SPECIALS = {"?": "starts a query", "#": "starts a fragment", "%": "starts an escape"}


def key_path(key: str) -> str:
    """The path of ``key`` below an endpoint, as python-etcd spells it: the key as it
    is, after a leading ``/`` (so that PyTorch's workers and ours name the same keys).

    Raises:
        ValueError: etcd would read the path as another key: ``key`` holds ``?``, ``#``
            or ``%`` (from a run id or a prefix), or a ``.`` or ``..`` segment.
    """
    path = key if key.startswith("/") else f"/{key}"
    for char, meaning in _URL_SPECIALS.items():
        if char in path:
            raise ValueError(
                f"key {key!r}: holds {char!r}, which {meaning} in a URL of etcd's v2 API, "
                "so etcd would read another key; use a run id and prefix without '?', "
                "'#' or '%' (or the v3 API)."
            )
    if any(segment in (".", "..") for segment in path.split("/")):
        raise ValueError(
            f"key {key!r}: a '.' or '..' segment names a directory above it in a URL of "
            "etcd's v2 API; use a run id and prefix without them."
        )
    return KEYS + path


#: What the requests that only read are for (``what`` of :meth:`V2Session.request`):
#: a refusal of one of them is for want of read permission, of any other, write.
_READS = frozenset({"read", "list", "watch", "query the version of"})

#: etcd's v2 errorCodes (see etcd's Documentation/v2/errorcode.md) that this module acts on.
_KEY_NOT_FOUND = 100
_COMPARE_FAILED = 101
_NOT_A_FILE = 102
_NOT_A_DIRECTORY = 104
_NODE_EXISTS = 105
_NO_PERMISSION = 110
_RAFT_INTERNAL = 300
_LEADER_ELECTION = 301
_WATCHER_CLEARED = 400
_EVENT_INDEX_CLEARED = 401
#: Every errorCode python-etcd gives a class of its own: an answer with any other code
#: (or none) is a plain error, which may be an election's (see :func:`transient`).
_NAMED_CODES = frozenset({100, 101, 102, 104, 105, 107, 108, 110, *range(200, 211), 301, 400, 401})
#: The refusals on a key's state, as the interface's condition errors.
_REFUSALS: dict[int, type[ConditionError]] = {
    _KEY_NOT_FOUND: KeyNotFoundError,
    _NODE_EXISTS: KeyExistsError,
    _COMPARE_FAILED: CompareFailedError,
}


class PollEndedError(Exception):
    """A long poll (``wait=true``) heard no answer within its time: nothing changed."""


class HistoryClearedError(Exception):
    """etcd answered a watch "event index cleared" (errorCode 401): it no longer holds
    the history asked for. The message is etcd's."""


@dataclass(frozen=True)
class ErrorAnswer:
    """An error answer of etcd: its HTTP ``status`` (``None``: its body was not JSON),
    errorCode (404 and 401 count as 100 and 110), ``index`` and ``text`` ("message :
    cause"), and the decoded ``payload``."""

    status: int | None
    code: int | None
    index: int | None
    text: str
    payload: dict[str, Any]

    @classmethod
    def read(cls, status: int, body: bytes) -> ErrorAnswer:
        """The refusal an answer of ``status`` with ``body`` says, as python-etcd reads it."""
        text = body.decode("utf-8", errors="replace")
        try:
            payload = json.loads(text)
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            payload["status"] = status
            code = payload.get("errorCode")
            answered: int | None = status
        else:
            payload, code, answered = {"message": "Bad response", "cause": text}, None, None
        if answered == 404:
            code = _KEY_NOT_FOUND
        elif answered == 401:
            code = _NO_PERMISSION
        index = payload.get("index")
        return cls(
            answered,
            code if isinstance(code, int) else None,
            index if isinstance(index, int) else None,
            f"{payload.get('message')} : {payload.get('cause')}",
            payload,
        )


def transient(refusal: ErrorAnswer) -> bool:
    """Whether ``refusal`` is a server-side failure worth retrying: a leader election, a
    raft request that timed out."""
    if refusal.code in (_LEADER_ELECTION, _WATCHER_CLEARED):
        return True
    if refusal.code in _NAMED_CODES:
        return False
    # errorCode 300 ("Raft Internal Error") is a permanent refusal such as updating a
    # directory's TTL on etcd 3.5 ("Not a file") -- or a proposal that timed out during
    # a leader election, whose outcome is unknown. Plain 5xx answers without a code
    # are "etcdserver: request timed out" and friends, also seen during elections.
    if refusal.code == _RAFT_INTERNAL:
        payload = refusal.payload
        said = f"{payload.get('cause', '')} {payload.get('message', '')} {refusal.text}"
        return any(marker in said.lower() for marker in ELECTION_MARKERS)
    return refusal.status is not None and refusal.status >= 500


def _was_not_sent(cause: BaseException) -> bool:
    """Whether a transport failure happened before the request reached the server."""
    return isinstance(cause, (NewConnectionError, ConnectTimeoutError, ConnectionRefusedError))


class V2Session:
    """The urllib3 pool of a v2 connection to ``endpoints`` (the connection's, reached
    with its ``access``), and one request at a time; the ``Date`` of every answer dates
    the connection's ``clock``."""

    def __init__(self, endpoints: Endpoints, access: Access, clock: ServerClock) -> None:
        self._endpoints = endpoints
        self._clock = clock
        #: The connections to every endpoint (ten each, as python-etcd keeps).
        self.pool = access.pool(max(10, len(endpoints.urls)), 10)
        self.username = access.username
        #: What every request carries: etcd's v2 auth is HTTP basic auth.
        self._headers: dict[str, str] = (
            urllib3.make_headers(basic_auth=f"{access.username}:{access.password}")
            if access.username and access.password
            else {}
        )
        #: The cluster id each endpoint answered with first (``None``: none yet).
        self._cluster_ids: list[str | None] = [None] * len(endpoints.urls)

    def release(self) -> None:
        """Close the pooled connections."""
        close_pool(self.pool)

    # -- one request ------------------------------------------------------------------

    def request(
        self,
        idx: int,
        method: str,
        path: str,
        fields: dict[str, Any] | None,
        *,
        what: str,
        key: str,
        wait: float,
    ) -> tuple[dict[str, Any], int]:
        """Send ``method`` ``path`` with ``fields`` to endpoint ``idx``, waiting at most
        ``wait`` seconds for the answer, to ``what`` ``key`` (for messages and metrics).

        Returns the answer's JSON object and its ``X-Etcd-Index`` (1 if it has none), or
        raises: a condition error, :class:`UnsentError` (safe to send again anywhere),
        :class:`AmbiguousError` (may have been applied), :class:`PollEndedError` or
        :class:`HistoryClearedError` (a watch's own answers), or a library error for
        permanent failures.
        """
        endpoint = self._endpoints.url(idx)
        timeout = urllib3.Timeout(connect=min(self._endpoints.timeouts.connect, wait), read=wait)
        form = method in ("PUT", "POST")
        size = len(urlencode(fields)) if form and fields else 0
        sent = time.monotonic()
        try:
            response = self._send(endpoint, method, path, fields, timeout)
            self._clock.sample(response.headers.get("Date"), sent, time.monotonic())
            self._check_cluster(idx, response.headers)
            body = response.data or b""
        except (HTTPError, HTTPException, OSError) as exc:
            if isinstance(exc, ReadTimeoutError) and (fields or {}).get("wait") == "true":
                raise PollEndedError(f"{endpoint}: no change within {wait:g} s") from None
            raise self._connection_failure(idx, what, key, exc) from None
        count_bytes(size, len(body), api="v2", op=op_name(what))
        if response.status not in (200, 201):
            refusal = ErrorAnswer.read(response.status, body)
            raise self._refused(idx, what, key, refusal, size) from None
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise OperationRefusedError(
                f"etcd endpoint {endpoint} failed to {what} {key!r}: its answer is not "
                f"a JSON object ({body[:100]!r})."
            )
        self._endpoints.heard_from(idx)
        return data, int(response.headers.get("X-Etcd-Index", 1))

    def open_stream(
        self, idx: int, path: str, fields: dict[str, str], timeout: urllib3.Timeout, key: str
    ) -> Any:
        """Open a streaming watch (``GET path`` with ``fields``) on endpoint ``idx``:
        the answer (status 200, body unread), or raises as :meth:`request` does."""
        endpoint = self._endpoints.url(idx)
        sent = time.monotonic()
        try:
            response = self._send(endpoint, "GET", path, fields, timeout)
        except (HTTPError, HTTPException, OSError) as exc:
            raise self._connection_failure(idx, "watch", key, exc) from None
        self._clock.sample(response.headers.get("Date"), sent, time.monotonic())
        # A streaming watch's answer is read, and counted, as a stream (stream.py).
        if response.status != 200:
            try:
                body = response.data or b""
            except (HTTPError, HTTPException, OSError) as exc:
                raise self._connection_failure(idx, "watch", key, exc) from None
            raise self._refused(idx, "watch", key, ErrorAnswer.read(response.status, body), 0)
        self._check_cluster(idx, response.headers)
        self._endpoints.heard_from(idx)
        return response

    def _send(
        self,
        endpoint: str,
        method: str,
        path: str,
        fields: dict[str, Any] | None,
        timeout: urllib3.Timeout,
    ) -> Any:
        """One request as python-etcd sends it (the form of a PUT in its body, any other
        request's in the URL; a redirection not followed), body unread."""
        url = endpoint + path
        options: dict[str, Any] = {
            "headers": self._headers,
            "timeout": timeout,
            "retries": False,
            "redirect": False,
            "preload_content": False,
        }
        if method in ("PUT", "POST"):
            return self.pool.request_encode_body(
                method, url, fields=fields, encode_multipart=False, **options
            )
        return self.pool.request_encode_url(method, url, fields=fields, **options)

    def _check_cluster(self, idx: int, headers: Any) -> None:
        """Refuse an answer from another cluster than endpoint ``idx`` answered from
        before (its ``X-Etcd-Cluster-Id``)."""
        cluster = headers.get("X-Etcd-Cluster-Id")
        if not cluster:
            logger.debug("etcd endpoint %s answered without a cluster id", self._endpoints.url(idx))
            return
        known, self._cluster_ids[idx] = self._cluster_ids[idx], cluster
        if known is not None and known != cluster:
            close_pool(self.pool)  # connect afresh next time
            raise RendezvousConnectionError(
                f"etcd endpoint {self._endpoints.url(idx)} belongs to another cluster than "
                f"before: the UUID of the cluster changed from {known} to {cluster}."
            )

    # -- what failures mean -----------------------------------------------------------

    def _connection_failure(self, idx: int, what: str, key: str, cause: BaseException) -> Exception:
        """The error for a request that failed on the connection: a TLS failure is permanent
        (unless the peer dropped the handshake after the cluster answered over TLS, see
        :func:`~etcd_rendezvous._transport.attempt.dropped_during_tls`); the
        rest is retried, as unsent if it never reached the server."""
        endpoint = self._endpoints.url(idx)
        dropped = dropped_during_tls(cause) and self._endpoints.answered_before()
        if isinstance(cause, (SSLError, ssl.SSLError)) and not dropped:
            return RendezvousConnectionError(
                f"TLS connection to etcd endpoint {endpoint} failed while trying to {what} "
                f"{key!r}: {cause}. Check protocol, cacert, cert and key."
            )
        message = f"{endpoint}: {cause}"
        return UnsentError(message) if _was_not_sent(cause) else AmbiguousError(message)

    def _refused(self, idx: int, what: str, key: str, refusal: ErrorAnswer, size: int) -> Exception:
        """The error for etcd's error answer ``refusal`` to a request of ``size`` bytes
        of form: a refusal on the key's state, an election (retried), or a permanent
        failure (a request too large for etcd included), whose message says what to
        check."""
        endpoint = self._endpoints.url(idx)
        condition = _REFUSALS.get(refusal.code or 0)
        if condition is not None:
            self._endpoints.heard_from(idx)
            return condition(key, refusal.index)
        if refusal.code == _EVENT_INDEX_CLEARED:
            return HistoryClearedError(refusal.text)
        if limits.v2_too_large(refusal.payload):
            # A refusal, never sent again.
            where = f"{what} {key!r}"
            return limits.refused_for_size("v2", endpoint, where, key, size, refusal.text)
        if refusal.code == _NO_PERMISSION:
            return self._permission_failure(idx, what, key, refusal.text)
        if refusal.code in (_NOT_A_FILE, _NOT_A_DIRECTORY):
            return RendezvousStateError(
                f"etcd refused to {what} {key!r}: {refusal.text}. Another program may have "
                "written a key where a directory belongs (or the reverse)."
            )
        if transient(refusal):
            # An election: the next member may already have a leader.
            return transient_answer(endpoint, refusal.text)
        if "404 page not found" in refusal.text:
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} does not serve the v2 API (it answered 404 "
                f"when asked to {what} {key!r}). Start etcd with --enable-v2, or use "
                "etcd_api=v3 (or auto)."
            )
        return OperationRefusedError(
            f"etcd endpoint {endpoint} failed to {what} {key!r}: {refusal.text}"
        )

    def _permission_failure(
        self, idx: int, what: str, key: str, text: str
    ) -> RendezvousConnectionError:
        """The error for a refusal by etcd's v2 auth, naming the permission missing."""
        endpoint = self._endpoints.url(idx)
        if self.username is None:
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} refused to {what} {key!r}: {text}. "
                "Check username and password."
            )
        permission = "read" if what in _READS else "write"
        return RendezvousConnectionError(
            f"etcd endpoint {endpoint} refused to {what} {key!r}: user "
            f"{self.username!r} has no {permission} permission on it ({text}), "
            "or a wrong password. Grant it to one of the user's roles (etcd's v2 "
            f"auth: a {permission} pattern of the role's kv permissions; '<key>*' for "
            "every key below a prefix)."
        )
