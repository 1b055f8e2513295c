"""One request of the v3 API's JSON gateway: the connection's urllib3 pool, its auth
token, and the classification of what the gateway answers and urllib3 raises. The v3
connection and its watch stream both send through a :class:`V3Session`. See
docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from typing import Any

import urllib3
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    NewConnectionError,
    SSLError,
)

from ..api import RendezvousConnectionError
from . import limits
from . import v3_wire as wire
from .attempt import AmbiguousError, UnsentError, dropped_during_tls, transient_answer
from .clock import ServerClock
from .endpoints import Access, Endpoints, close_pool
from .interface import ConditionError, OperationRefusedError
from .metering import count_bytes

__all__ = ["LeaseGoneError", "V3Session"]

logger = logging.getLogger(__name__)

_AUTHENTICATE = "/v3/auth/authenticate"

#: The permission (as ``etcdctl role grant-permission`` names it) a request of each path
#: needs on its key; a transaction compares (reads) and writes.
_PERMISSIONS = {
    "/v3/kv/range": "read",
    "/v3/watch": "read",
    "/v3/kv/put": "write",
    "/v3/kv/deleterange": "write",
    "/v3/lease/revoke": "write",
    "/v3/kv/txn": "readwrite",
}


class LeaseGoneError(ConditionError):
    """A refusal: the lease named in a write does not exist any more (the write was not
    applied). Its ``key`` is what the request was for ("write '/k'"); the message is
    etcd's answer, ``"<endpoint>: <error>"``."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(key, None)
        self.args = (detail,)


class V3Session:
    """The urllib3 pool of a v3 connection to ``endpoints`` (the connection's, reached
    with its ``access``), its auth token, and one request at a time; the ``Date`` of
    every answer dates the connection's ``clock``."""

    def __init__(self, endpoints: Endpoints, access: Access, clock: ServerClock) -> None:
        self._endpoints = endpoints
        self._clock = clock
        #: The connections to every endpoint (discovery reads ``/v2/keys/`` with it too).
        self.pool = access.pool(max(4, len(endpoints.urls)), 8)
        self._username = access.username
        self._password = access.password
        self._token: str | None = None
        self._auth_lock = threading.Lock()

    @property
    def username(self) -> str | None:
        """The etcd user (``None``: none, or etcd's auth turned out to be off)."""
        return self._username

    def release(self) -> None:
        """Close the pooled connections."""
        close_pool(self.pool)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        token = self._token
        if token is not None:
            headers["Authorization"] = token
        return headers

    def ensure_token(self, idx: int, renew: bool, op: str) -> None:
        """Authenticate on endpoint ``idx`` if a user is configured and there is no token
        yet (or ``renew``), for an operation whose metrics are labelled ``op``."""
        if self._username is None:
            return
        with self._auth_lock:
            if renew or self._token is None:
                self._authenticate(idx, None, op)

    # -- one request ------------------------------------------------------------------

    def request(
        self,
        idx: int,
        path: str,
        body: dict[str, Any] | None,
        cap: float | None,
        where: str,
        op: str,
    ) -> dict[str, Any]:
        """POST ``body`` (GET without one) to ``path`` on endpoint ``idx``; classify failures.

        ``where`` says what the request was for, for error messages ("read '/k'"), and
        ``op`` labels its bytes in the metrics
        (:func:`~etcd_rendezvous._transport.metering.op_name`).
        """
        endpoint = self._endpoints.url(idx)
        read = self._endpoints.timeouts.request if cap is None else cap
        timeout = urllib3.Timeout(connect=min(self._endpoints.timeouts.connect, read), read=read)
        headers = self.headers()
        if path == _AUTHENTICATE:
            # etcd 3.4 refuses to authenticate a request that carries an expired token.
            headers.pop("Authorization", None)
        payload = None if body is None else json.dumps(body).encode()
        sent = time.monotonic()
        try:
            response = self.pool.request(
                "GET" if body is None else "POST",
                endpoint + path,
                body=payload,
                headers=headers,
                timeout=timeout,
                retries=False,
            )
        except BaseException as exc:
            raise self.transport_failure(idx, exc, where) from None
        self._clock.sample(response.headers.get("Date"), sent, time.monotonic())
        self._endpoints.heard_from(idx)
        count_bytes(len(payload or b""), len(response.data or b""), api=self._endpoints.api, op=op)
        if response.status == 200:
            try:
                data = json.loads(response.data)
            except ValueError:
                data = None
            if not isinstance(data, dict):
                raise RendezvousConnectionError(
                    f"etcd endpoint {endpoint} answered {path} with something other than a "
                    f"JSON object ({response.data[:100]!r}); is it an etcd v3 gateway?"
                )
            return data
        raise self.server_failure(
            idx, path, wire.parse_error(response.status, response.data), where, body
        )

    def transport_failure(self, idx: int, exc: BaseException, where: str) -> BaseException:
        """The library error for a request that failed on the connection."""
        endpoint = self._endpoints.url(idx)
        if not isinstance(exc, (HTTPError, OSError)):
            return exc
        dropped = dropped_during_tls(exc) and self._endpoints.answered_before()
        if isinstance(exc, (SSLError, ssl.SSLError)) and not dropped:
            self._endpoints.rotate(idx)
            return RendezvousConnectionError(
                f"TLS connection to etcd endpoint {endpoint} failed while trying to {where}: "
                f"{exc}. Check protocol, cacert, cert and key."
            )
        if isinstance(exc, (NewConnectionError, ConnectTimeoutError, ConnectionRefusedError)):
            return UnsentError(f"{endpoint}: {exc}")
        return AmbiguousError(f"{endpoint}: {exc}")

    def server_failure(
        self,
        idx: int,
        path: str,
        error: wire.GrpcError,
        where: str,
        body: dict[str, Any] | None = None,
    ) -> BaseException:
        """The library error for an error answer of the gateway to the request ``body``."""
        endpoint = self._endpoints.url(idx)
        if limits.v3_too_large(error.message):
            # Before the transient answers: gRPC's own limit answers RESOURCE_EXHAUSTED,
            # which is no overload. A refusal, never sent again.
            key, size = wire.request_size(body)
            return limits.refused_for_size("v3", endpoint, where, key, size, str(error))
        if error.needs_reauth and self._username is not None:
            return wire.ReauthError(f"{endpoint}: {error}")
        if error.transient:
            # An election or overload: the next member may already serve us.
            return transient_answer(endpoint, str(error))
        if error.lease_not_found:
            return LeaseGoneError(where, f"{endpoint}: {error}")
        if error.http_status == 404 and not error.lease_not_found:
            # A path the gateway does not serve: "404 page not found" as text (etcd
            # 3.4/3.5, or any etcd without the gateway), {"code": 5, "message": "Not
            # Found"} from the gateway of etcd 3.6 and later.
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} does not serve the v3 API's JSON gateway ({path} "
                f"answered 404) while trying to {where}. etcd 3.4 or later serves it; use "
                "etcd_api=v2 for older servers."
            )
        if error.code == wire.PERMISSION_DENIED and self._username is not None:
            return self.refusal(idx, where, _PERMISSIONS.get(path, "readwrite"), str(error))
        if error.code in (wire.PERMISSION_DENIED, wire.UNAUTHENTICATED) or error.needs_reauth:
            return RendezvousConnectionError(
                f"etcd endpoint {endpoint} refused to {where}: {error}. Check username, "
                "password and the user's roles."
            )
        return OperationRefusedError(f"etcd endpoint {endpoint} refused to {where}: {error}")

    def refusal(
        self, idx: int, where: str, permission: str, detail: str
    ) -> RendezvousConnectionError:
        """The error for a request to ``where`` ("write '/k'") that endpoint ``idx``
        refused because the user lacks ``permission`` (``read``, ``write`` or
        ``readwrite``) on its key."""
        return RendezvousConnectionError(
            f"etcd endpoint {self._endpoints.url(idx)} refused to {where}: user "
            f"{self._username!r} has no {permission} permission on it ({detail}). "
            f"Grant it to one of the user's roles: etcdctl role grant-permission <role> "
            f"{permission} <key> (add --prefix for every key below a prefix)."
        )

    def _authenticate(self, idx: int, cap: float | None, op: str) -> None:
        """Get a fresh auth token from endpoint ``idx``."""
        body = {"name": self._username, "password": self._password}
        where = f"authenticate as {self._username!r}"
        try:
            data = self.request(idx, _AUTHENTICATE, body, cap, where, op)
        except OperationRefusedError as exc:
            if "not enabled" in str(exc):
                logger.info("etcd auth is not enabled; sending requests without a token")
                self._username = None
                return
            raise RendezvousConnectionError(
                f"etcd endpoint {self._endpoints.url(idx)} refused to authenticate user "
                f"{self._username!r}: {str(exc).split(': ', 1)[-1]}. Check username and password."
            ) from None
        token = data.get("token")
        if not isinstance(token, str) or not token:
            raise RendezvousConnectionError(
                f"etcd endpoint {self._endpoints.url(idx)} answered authentication without a token."
            )
        self._token = token

    def attempt(
        self,
        idx: int,
        path: str,
        body: dict[str, Any] | None,
        where: str,
        cap: float | None,
        op: str,
    ) -> dict[str, Any]:
        """One request to endpoint ``idx`` (see :meth:`request`), authenticating first
        where needed; a request refused for an expired token is sent once more with a
        fresh one."""
        for renewal in (False, True):
            self.ensure_token(idx, renewal, op)
            try:
                data = self.request(idx, path, body, cap, where, op)
            except wire.ReauthError:
                if renewal:
                    raise RendezvousConnectionError(
                        f"etcd endpoint {self._endpoints.url(idx)} refused the auth token it had "
                        f"just issued while trying to {where}."
                    ) from None
                logger.info("etcd auth token expired; authenticating again")
            else:
                return data
        raise AssertionError("unreachable")  # pragma: no cover
