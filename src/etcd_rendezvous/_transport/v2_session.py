"""One request of the v2 API: the python-etcd client of each endpoint, and the
classification of what python-etcd and urllib3 raise (which never leave this module
and the watch's). The v2 connection and its watch stream both send through a
:class:`V2Session`. See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import etcd
import urllib3
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError, SSLError

from ..api import RendezvousConnectionError, RendezvousStateError
from . import limits
from .attempt import ELECTION_MARKERS, AmbiguousError, UnsentError, transient_answer
from .clock import ServerClock
from .endpoints import Access, Endpoints
from .interface import (
    CompareFailedError,
    ConditionError,
    KeyExistsError,
    KeyNotFoundError,
    OperationRefusedError,
)
from .metering import count_bytes, op_name

__all__ = ["V2Session"]

_T = TypeVar("_T")

Endpoint = tuple[str, int]
_Cert = str | tuple[str, str] | None


class _NoRetryPoolManager(urllib3.PoolManager):
    """A pool manager that never re-sends a request and bounds connection set-up.

    python-etcd passes one number as the request timeout; we split it into a connect
    timeout (bounded by ``connect_timeout``) and the read timeout it asked for. Every
    answer's ``Date`` dates etcd's ``clock``.
    """

    def __init__(self, connect_timeout: float, clock: ServerClock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._connect_timeout = connect_timeout
        self._clock = clock
        #: Per-thread upper bound for the read timeout of the next requests (seconds).
        self.read_cap = threading.local()
        #: Per-thread ``op`` label (:func:`~etcd_rendezvous._transport.metering.op_name`)
        #: of the bytes of the next requests.
        self.op = threading.local()
        #: Per-thread bytes of the body of the last request sent.
        self.sent = threading.local()

    def urlopen(  # type: ignore[override]
        self, method: str, url: str, redirect: bool = True, **kw: Any
    ) -> Any:
        kw["retries"] = urllib3.Retry(total=False)
        timeout = kw.get("timeout")
        cap: float | None = getattr(self.read_cap, "value", None)
        if cap is not None and isinstance(timeout, (int, float)):
            timeout = min(float(timeout), cap)
        if timeout is None or isinstance(timeout, (int, float)):
            connect = (
                self._connect_timeout
                if timeout is None
                else min(self._connect_timeout, float(timeout))
            )
            kw["timeout"] = urllib3.Timeout(connect=connect, read=timeout)
        op: str = getattr(self.op, "value", None) or "other"
        body = kw.get("body")
        size = len(body) if isinstance(body, (bytes, str)) else 0
        self.sent.value = size
        sent = time.monotonic()
        response = super().urlopen(method, url, redirect=redirect, **kw)
        self._clock.sample(response.headers.get("Date"), sent, time.monotonic())
        if "stream=true" in url.partition("?")[2].split("&"):
            # A streaming watch's answer is read, and counted, as a stream (stream.py).
            count_bytes(size, 0, api="v2", op=op)
        else:
            # python-etcd asks for the body unread (to check the headers first), then
            # reads it whole at once: reading it here fails the same way, and it stays
            # cached for python-etcd.
            count_bytes(size, len(response.data or b""), api="v2", op=op)
        return response


def _transport_cause(exc: BaseException) -> BaseException:
    cause: BaseException = getattr(exc, "cause", None) or exc.__cause__ or exc
    if isinstance(cause, MaxRetryError) and cause.reason is not None:
        return cause.reason
    return cause


def _was_not_sent(cause: BaseException) -> bool:
    """Whether a transport failure happened before the request reached the server."""
    return isinstance(cause, (NewConnectionError, ConnectTimeoutError, ConnectionRefusedError))


def _is_transient_server_error(exc: etcd.EtcdException) -> bool:
    """Server-side failures worth retrying: leader election, raft request timeouts."""
    if isinstance(exc, (etcd.EtcdLeaderElectionInProgress, etcd.EtcdWatcherCleared)):
        return True
    if type(exc) is not etcd.EtcdException:
        return False
    payload = exc.payload if isinstance(exc.payload, dict) else {}
    # errorCode 300 ("Raft Internal Error") is a permanent refusal such as updating a
    # directory's TTL on etcd 3.5 ("Not a file") -- or a proposal that timed out during
    # a leader election, whose outcome is unknown. Plain 5xx answers without a code
    # are "etcdserver: request timed out" and friends, also seen during elections.
    if payload.get("errorCode") == 300:
        cause = f"{payload.get('cause', '')} {payload.get('message', '')} {exc}".lower()
        return any(marker in cause for marker in ELECTION_MARKERS)
    status = payload.get("status")
    return isinstance(status, int) and status >= 500


#: What the requests that only read are for (``what`` of :meth:`V2Session.once`):
#: a refusal of one of them is for want of read permission, of any other, write.
_READS = frozenset({"read", "list", "watch", "query the version of"})


class V2Session:
    """The python-etcd clients of a v2 connection (one per ``(host, port)`` of
    ``addresses``, the connection's ``endpoints``, with its ``access``), and one request
    at a time through them; the ``Date`` of every answer dates the connection's
    ``clock``."""

    def __init__(
        self,
        addresses: Sequence[Endpoint],
        endpoints: Endpoints,
        access: Access,
        clock: ServerClock,
    ) -> None:
        self._endpoints = endpoints
        self._access = access
        self._clock = clock
        self._clients = [self._make_client(host, port) for host, port in addresses]

    def _make_client(self, host: str, port: int) -> Any:
        access = self._access
        cert: _Cert = (access.cert, access.key) if access.cert and access.key else access.cert
        client = etcd.Client(
            host=host,
            port=port,
            protocol=access.protocol,
            cert=cert,
            ca_cert=access.cacert,
            username=access.username,
            password=access.password,
            read_timeout=self._endpoints.timeouts.read,
            allow_reconnect=False,
        )
        pool_kw = dict(client.http.connection_pool_kw)
        client.http.clear()
        client.http = _NoRetryPoolManager(
            self._endpoints.timeouts.connect, self._clock, num_pools=10, **pool_kw
        )
        return client

    def release(self) -> None:
        """Release the clients' pooled connections."""
        for client in self._clients:
            client.http.clear()

    def once(
        self, idx: int, what: str, key: str, call: Callable[[Any], _T], cap: float | None
    ) -> _T:
        """Send one request to endpoint ``idx`` and classify any failure.

        Returns the result, or raises: a condition error, :class:`UnsentError` (safe to
        send again anywhere), :class:`AmbiguousError` (may have been applied), or a
        library error for permanent failures.
        """
        client = self._clients[idx]
        client.http.read_cap.value = cap
        client.http.op.value = op_name(what)
        client.http.sent.value = 0
        try:
            result = call(client)
        except (etcd.EtcdWatchTimedOut, etcd.EtcdEventIndexCleared):
            raise  # the watch's own answers: v2_watch reads them
        except etcd.EtcdConnectionFailed as exc:
            raise self._connection_failure(idx, what, key, exc) from None
        except etcd.EtcdException as exc:
            refusal = _refusal(key, exc)
            if refusal is not None:
                self._endpoints.heard_from(idx)
                raise refusal from None
            raise self._server_failure(idx, what, key, exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # python-etcd wraps most of these; anything that slips through is a
            # transport failure of unknown outcome.
            raise AmbiguousError(f"{self._endpoints.url(idx)}: {exc}") from None
        finally:
            client.http.read_cap.value = None
            client.http.op.value = None
        self._endpoints.heard_from(idx)
        return result

    def _connection_failure(
        self, idx: int, what: str, key: str, exc: etcd.EtcdConnectionFailed
    ) -> Exception:
        """The error for a request that failed on the connection: TLS is permanent; the
        rest is retried, as unsent if it never reached the server."""
        endpoint = self._endpoints.url(idx)
        cause = _transport_cause(exc)
        if isinstance(cause, (SSLError, ssl.SSLError)):
            return RendezvousConnectionError(
                f"TLS connection to etcd endpoint {endpoint} failed while trying to {what} "
                f"{key!r}: {cause}. Check protocol, cacert, cert and key."
            )
        message = f"{endpoint}: {cause}"
        return UnsentError(message) if _was_not_sent(cause) else AmbiguousError(message)

    def _server_failure(self, idx: int, what: str, key: str, exc: etcd.EtcdException) -> Exception:
        """The error for an error answer of etcd other than a refusal on the key: an
        election is retried; anything else is permanent (a request too large for etcd
        included), and the message says what to check."""
        endpoint = self._endpoints.url(idx)
        if limits.v2_too_large(exc.payload):
            # A refusal, never sent again.
            sent = int(getattr(self._clients[idx].http.sent, "value", 0) or 0)
            where = f"{what} {key!r}"
            return limits.refused_for_size("v2", endpoint, where, key, sent, str(exc))
        if isinstance(exc, etcd.EtcdInsufficientPermissions):
            return self._permission_failure(idx, what, key, exc)
        if isinstance(exc, etcd.EtcdClusterIdChanged):
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} belongs to another cluster than before: {exc}"
            )
        if isinstance(exc, (etcd.EtcdNotFile, etcd.EtcdNotDir)):
            return RendezvousStateError(
                f"etcd refused to {what} {key!r}: {exc}. Another program may have written "
                "a key where a directory belongs (or the reverse)."
            )
        if _is_transient_server_error(exc):
            # An election: the next member may already have a leader.
            return transient_answer(endpoint, str(exc))
        if "404 page not found" in str(exc):
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} does not serve the v2 API (it answered 404 "
                f"when asked to {what} {key!r}). Start etcd with --enable-v2, or use "
                "etcd_api=v3 (or auto)."
            )
        return OperationRefusedError(f"etcd endpoint {endpoint} failed to {what} {key!r}: {exc}")

    def _permission_failure(
        self, idx: int, what: str, key: str, exc: etcd.EtcdInsufficientPermissions
    ) -> RendezvousConnectionError:
        """The error for a refusal by etcd's v2 auth, naming the permission missing."""
        endpoint = self._endpoints.url(idx)
        username = self._clients[idx].username
        if username is None:
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} refused to {what} {key!r}: {exc}. "
                "Check username and password."
            )
        permission = "read" if what in _READS else "write"
        return RendezvousConnectionError(
            f"etcd endpoint {endpoint} refused to {what} {key!r}: user "
            f"{username!r} has no {permission} permission on it ({exc}), "
            "or a wrong password. Grant it to one of the user's roles (etcd's v2 "
            f"auth: a {permission} pattern of the role's kv permissions; '<key>*' for "
            "every key below a prefix)."
        )


#: python-etcd's refusals on a key's state, as the interface's condition errors.
_REFUSALS: tuple[tuple[type[etcd.EtcdException], type[ConditionError]], ...] = (
    (etcd.EtcdKeyNotFound, KeyNotFoundError),
    (etcd.EtcdAlreadyExist, KeyExistsError),
    (etcd.EtcdCompareFailed, CompareFailedError),
)


def _refusal(key: str, exc: etcd.EtcdException) -> ConditionError | None:
    """The condition error for ``exc`` if it is a refusal on ``key``'s state."""
    for refused, error in _REFUSALS:
        if isinstance(exc, refused):
            return error(key, _payload_index(exc))
    return None


def _payload_index(exc: etcd.EtcdException) -> int | None:
    payload = exc.payload if isinstance(exc.payload, dict) else {}
    index = payload.get("index")
    return int(index) if isinstance(index, int) else None
