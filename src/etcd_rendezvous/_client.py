"""The one layer that talks to etcd.

Everything above this module speaks the library's vocabulary: :class:`Node` values,
the condition errors below (:class:`KeyNotFoundError`, :class:`KeyExistsError`,
:class:`CompareFailedError`), and :class:`~etcd_rendezvous.api.RendezvousConnectionError` /
:class:`~etcd_rendezvous.api.RendezvousStateError`. python-etcd and urllib3 exceptions
never leave this module.

What this layer adds over a bare ``etcd.Client``:

* **No silent re-sends.** urllib3 retries a timed-out request by default; for a
  compare-and-swap that means a "compare failed" can hide a swap that was applied. Our
  pool manager never retries; this module decides what may be sent again.
* **Recognising our own applied write.** When a conditional write fails on the
  connection (or the server answers "request timed out"), it may still have been
  applied. We send it again (it is conditional, so at most one copy can apply) and, if
  the answer is then "compare failed" / "already exists", read the key's history: if
  the first change after the state we compared against carries our value, the write
  was ours.
* **Failover that recovers.** One python-etcd client per endpoint; a request that could
  not reach an endpoint moves on to the next, round-robin, for as long as the
  operation's time budget lasts (python-etcd's own failover never recovers once all
  hosts were down).
* **Connect timeouts** separate from read/watch timeouts, so a dead host costs seconds,
  not the whole read timeout.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, Union

import etcd
import urllib3
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError, SSLError

from ._retry import Backoff, Deadline
from .api import RendezvousConnectionError, RendezvousError, RendezvousStateError

__all__ = [
    "CompareFailedError",
    "EtcdConnection",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "OperationRefusedError",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_CONNECT_TIMEOUT = 5.0


class _ConditionError(Exception):
    """A request was refused because of the state of a key (not a failure)."""

    def __init__(self, key: str, etcd_index: int | None) -> None:
        super().__init__(key)
        self.key = key
        #: The store index at the time of the refusal, when etcd reported it.
        self.etcd_index = etcd_index


class KeyNotFoundError(_ConditionError):
    """The key does not exist."""


class KeyExistsError(_ConditionError):
    """A create (``prevExist=false``) found the key already there."""


class CompareFailedError(_ConditionError):
    """A compare-and-swap or compare-and-delete found a different value or index."""


@dataclass(frozen=True)
class Node:
    """One etcd v2 node as returned by a read, write or watch."""

    key: str
    value: str | None
    modified_index: int
    created_index: int
    #: ``X-Etcd-Index`` of the response: the store index when it was served.
    etcd_index: int
    ttl: int | None
    is_dir: bool
    #: Immediate children, for directory reads (empty otherwise).
    children: tuple[Node, ...]
    #: The etcd action that produced this node (``get``, ``set``, ``compareAndSwap``,
    #: ``create``, ``expire``, ``delete`` ...).
    action: str

    @classmethod
    def _from_result(cls, result: Any) -> Node:
        etcd_index = int(getattr(result, "etcd_index", 0) or 0)
        raw_children = getattr(result, "_children", None) or []
        return cls(
            key=result.key,
            value=result.value,
            modified_index=int(result.modifiedIndex or 0),
            created_index=int(result.createdIndex or 0),
            etcd_index=etcd_index,
            ttl=result.ttl,
            is_dir=bool(result.dir),
            children=tuple(_node_from_dict(child, etcd_index) for child in raw_children),
            action=str(result.action or ""),
        )


def _node_from_dict(raw: dict[str, Any], etcd_index: int) -> Node:
    return Node(
        key=raw.get("key", ""),
        value=raw.get("value"),
        modified_index=int(raw.get("modifiedIndex", 0)),
        created_index=int(raw.get("createdIndex", 0)),
        etcd_index=etcd_index,
        ttl=raw.get("ttl"),
        is_dir=bool(raw.get("dir", False)),
        children=tuple(_node_from_dict(c, etcd_index) for c in raw.get("nodes", []) or []),
        action="get",
    )


class _NoRetryPoolManager(urllib3.PoolManager):
    """A pool manager that never re-sends a request and bounds connection set-up.

    python-etcd passes one number as the request timeout; we split it into a connect
    timeout (bounded by ``connect_timeout``) and the read timeout it asked for.
    """

    def __init__(self, connect_timeout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._connect_timeout = connect_timeout
        #: Per-thread upper bound for the read timeout of the next requests (seconds).
        self.read_cap = threading.local()

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
        return super().urlopen(method, url, redirect=redirect, **kw)


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
    # errorCode 300 is "Raft Internal Error": a permanent refusal such as updating a
    # directory's TTL on etcd 3.5 ("Not a file"). Plain 5xx answers without a code are
    # "etcdserver: request timed out" and friends, seen during leader elections.
    if payload.get("errorCode") == 300:
        return False
    status = payload.get("status")
    return isinstance(status, int) and status >= 500


class OperationRefusedError(RendezvousError):
    """etcd permanently refused an operation (for example, changing a directory's TTL
    on etcd 3.5, which answers "Not a file")."""


class _AmbiguousError(Exception):
    """A request was sent but its outcome is unknown."""


class _UnsentError(Exception):
    """A request never reached the server."""


Endpoint = tuple[str, int]
_Cert = Union[str, tuple[str, str], None]


class EtcdConnection:
    """A connection to an etcd cluster (v2 API) over one or more endpoints.

    Args:
        endpoints: ``(host, port)`` pairs, tried in order and round-robin on failure.
        protocol: ``"http"`` or ``"https"``.
        cert: client certificate file (with ``key``, or a combined PEM file).
        key: private key of ``cert``.
        cacert: CA bundle used to verify the server.
        username: user name for etcd authentication (needs ``password``).
        password: password for ``username``.
        read_timeout: seconds one request may wait for an answer, and the time budget
            for retrying a failed operation across endpoints before giving up with
            :class:`~etcd_rendezvous.api.RendezvousConnectionError`.
        connect_timeout: seconds to wait for a TCP/TLS connection to one endpoint.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        protocol: str = "http",
        cert: str | None = None,
        key: str | None = None,
        cacert: str | None = None,
        username: str | None = None,
        password: str | None = None,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints: at least one etcd endpoint is required.")
        if protocol not in ("http", "https"):
            raise ValueError(f"protocol: must be 'http' or 'https', got {protocol!r}.")
        if read_timeout <= 0:
            raise ValueError(f"read_timeout: must be positive, got {read_timeout!r}.")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout: must be positive, got {connect_timeout!r}.")
        if (username is None) != (password is None):
            raise ValueError("username/password: give both or neither.")
        if key is not None and cert is None:
            raise ValueError("key: a client key needs a client certificate ('cert').")
        self._protocol = protocol
        self._read_timeout = float(read_timeout)
        self._connect_timeout = float(connect_timeout)
        self._sleep = sleep
        client_cert: _Cert = (cert, key) if cert and key else cert
        self._endpoints = [f"{protocol}://{_format_host(h)}:{p}" for h, p in endpoints]
        self._clients = [
            self._make_client(h, p, client_cert, cacert, username, password) for h, p in endpoints
        ]
        self._lock = threading.Lock()
        self._current = 0
        self._last_index = 0
        self._closed = False

    # -- construction ---------------------------------------------------------------

    def _make_client(
        self,
        host: str,
        port: int,
        cert: _Cert,
        cacert: str | None,
        username: str | None,
        password: str | None,
    ) -> Any:
        client = etcd.Client(
            host=host,
            port=port,
            protocol=self._protocol,
            cert=cert,
            ca_cert=cacert,
            username=username,
            password=password,
            read_timeout=self._read_timeout,
            allow_reconnect=False,
        )
        pool_kw = dict(client.http.connection_pool_kw)
        client.http.clear()
        client.http = _NoRetryPoolManager(self._connect_timeout, num_pools=10, **pool_kw)
        return client

    @classmethod
    def from_client(cls, client: Any, *, param: str = "etcd_client") -> EtcdConnection:
        """Build a hardened connection with the same endpoints and credentials as ``client``.

        ``client`` is a python-etcd ``etcd.Client`` (not modified) or an
        :class:`EtcdConnection` (returned as it is).

        Raises:
            TypeError: ``client`` is neither; the message names ``param``, the caller's
                name for it.
        """
        if isinstance(client, EtcdConnection):
            return client
        if not isinstance(client, etcd.Client):
            raise TypeError(
                f"{param}: expected an etcd.Client or an EtcdConnection, got "
                f"{type(client).__name__}."
            )
        uris = [client.base_uri, *getattr(client, "_machines_cache", [])]
        endpoints: list[Endpoint] = []
        for uri in dict.fromkeys(uris):
            parsed = urllib3.util.parse_url(uri)
            if parsed.host is None or parsed.port is None:
                raise ValueError(f"{param}: cannot parse endpoint {uri!r}.")
            endpoints.append((parsed.host.strip("[]"), parsed.port))
        pool_kw = client.http.connection_pool_kw
        cert = pool_kw.get("cert_file")
        read_timeout = client.read_timeout if client.read_timeout else DEFAULT_READ_TIMEOUT
        return cls(
            endpoints,
            protocol=client.protocol,
            cert=cert,
            key=pool_kw.get("key_file") if cert else None,
            cacert=pool_kw.get("ca_certs"),
            username=client.username,
            password=client.password if client.username else None,
            read_timeout=float(read_timeout),
        )

    # -- properties -----------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The endpoint URLs, in configuration order."""
        return list(self._endpoints)

    @property
    def read_timeout(self) -> float:
        """Per-request read timeout and per-operation retry budget, in seconds."""
        return self._read_timeout

    @property
    def connect_timeout(self) -> float:
        """Timeout for connecting to one endpoint, in seconds."""
        return self._connect_timeout

    @property
    def last_index(self) -> int:
        """The highest ``X-Etcd-Index`` seen so far on this connection."""
        return self._last_index

    def close(self) -> None:
        """Release pooled connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for client in self._clients:
            client.http.clear()

    # -- the request loop -----------------------------------------------------------

    def _pick(self) -> tuple[int, Any]:
        with self._lock:
            return self._current, self._clients[self._current]

    def _rotate(self, failed: int) -> None:
        with self._lock:
            if self._current == failed and len(self._clients) > 1:
                self._current = (failed + 1) % len(self._clients)
                logger.info(
                    "etcd endpoint %s failed; switching to %s",
                    self._endpoints[failed],
                    self._endpoints[self._current],
                )

    def _note_index(self, node: Node) -> Node:
        self._last_index = max(self._last_index, node.etcd_index)
        return node

    def _once(self, what: str, key: str, call: Callable[[Any], _T], cap: float | None = None) -> _T:
        """Send one request to the current endpoint and classify any failure.

        Returns the result, or raises: a condition error, :class:`_UnsentError` (safe to
        send again anywhere), :class:`_AmbiguousError` (may have been applied), or a
        library error for permanent failures.
        """
        idx, client = self._pick()
        endpoint = self._endpoints[idx]
        client.http.read_cap.value = cap
        try:
            return call(client)
        except etcd.EtcdKeyNotFound as exc:
            raise KeyNotFoundError(key, _payload_index(exc)) from None
        except etcd.EtcdAlreadyExist as exc:
            raise KeyExistsError(key, _payload_index(exc)) from None
        except etcd.EtcdCompareFailed as exc:
            raise CompareFailedError(key, _payload_index(exc)) from None
        except etcd.EtcdWatchTimedOut:
            raise
        except etcd.EtcdEventIndexCleared:
            raise
        except etcd.EtcdConnectionFailed as exc:
            cause = _transport_cause(exc)
            self._rotate(idx)
            if isinstance(cause, (SSLError, ssl.SSLError)):
                raise RendezvousConnectionError(
                    f"TLS connection to etcd endpoint {endpoint} failed while trying to {what} "
                    f"{key!r}: {cause}. Check protocol, cacert, cert and key."
                ) from None
            message = f"{endpoint}: {cause}"
            if _was_not_sent(cause):
                raise _UnsentError(message) from None
            raise _AmbiguousError(message) from None
        except etcd.EtcdInsufficientPermissions as exc:
            raise RendezvousConnectionError(
                f"etcd endpoint {endpoint} refused to {what} {key!r}: {exc}. "
                "Check username and password."
            ) from None
        except etcd.EtcdClusterIdChanged as exc:
            raise RendezvousConnectionError(
                f"etcd endpoint {endpoint} belongs to another cluster than before: {exc}"
            ) from None
        except (etcd.EtcdNotFile, etcd.EtcdNotDir) as exc:
            raise RendezvousStateError(
                f"etcd refused to {what} {key!r}: {exc}. Another program may have written "
                "a key where a directory belongs (or the reverse)."
            ) from None
        except etcd.EtcdException as exc:
            if _is_transient_server_error(exc):
                raise _AmbiguousError(f"{endpoint}: {exc}") from None
            if "404 page not found" in str(exc):
                raise RendezvousConnectionError(
                    f"etcd endpoint {endpoint} does not serve the v2 API (it answered 404 "
                    f"when asked to {what} {key!r}). Start etcd with --enable-v2."
                ) from None
            raise OperationRefusedError(
                f"etcd endpoint {endpoint} failed to {what} {key!r}: {exc}"
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # python-etcd wraps most of these; anything that slips through is a
            # transport failure of unknown outcome.
            self._rotate(idx)
            raise _AmbiguousError(f"{endpoint}: {exc}") from None
        finally:
            client.http.read_cap.value = None

    def _retrying(
        self,
        what: str,
        key: str,
        call: Callable[[Any], _T],
        *,
        on_ambiguous: Callable[[], None] | None = None,
        budget: Deadline | None = None,
        cap_requests: bool = True,
    ) -> _T:
        """Run ``call`` until it succeeds or the time budget for failures runs out.

        ``on_ambiguous`` is invoked after a failure whose outcome is unknown (used by
        writes to remember that a later "compare failed" needs checking). Each request
        waits at most the remaining budget (at least ``min(1 s, read_timeout)``) unless
        ``cap_requests`` is false (watches, which set their own timeout). However short
        the budget, every endpoint gets one attempt, and one more attempt follows the
        last failure: a hung endpoint cannot hide a healthy one, and a write whose
        answer timed out is re-sent once so that its fate can be found out. So against
        endpoints that all hang, an operation takes at most the budget plus
        ``len(endpoints)`` times the minimum attempt time.
        """
        deadline = budget if budget is not None else Deadline(self._read_timeout)
        backoff = Backoff(initial=0.05, cap=1.0, sleep=self._sleep)
        floor = min(1.0, self._read_timeout)
        failures: list[str] = []
        while True:
            cap = max(deadline.remaining(), floor) if cap_requests else None
            try:
                return self._once(what, key, call, cap)
            except _UnsentError as exc:
                failures.append(str(exc))
            except _AmbiguousError as exc:
                failures.append(str(exc))
                if on_ambiguous is not None:
                    on_ambiguous()
            if deadline.expired() and len(failures) > len(self._clients):
                raise RendezvousConnectionError(self._unreachable_message(what, key, failures))
            logger.debug("Could not %s %r (%s); retrying", what, key, failures[-1])
            backoff.wait(deadline)

    def _unreachable_message(self, what: str, key: str, failures: list[str]) -> str:
        tried = ", ".join(dict.fromkeys(f.split(": ", 1)[0] for f in failures))
        message = (
            f"Could not {what} {key!r}: etcd unreachable at {tried} (last error: {failures[-1]})."
        )
        dropped = ("RemoteDisconnected", "Connection aborted", "without response")
        if self._protocol == "http" and any(d in f for f in failures for d in dropped):
            message += (
                " The server closed the connection without an answer: if the endpoint "
                "serves https, use protocol 'https' (and cacert)."
            )
        return message

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, recursive: bool = False) -> Node:
        """Read ``key`` (a directory with its immediate children, or all if ``recursive``).

        Raises:
            KeyNotFoundError: the key does not exist (``etcd_index`` tells when).
        """
        return self._note_index(
            self._retrying(
                "read",
                key,
                lambda c: Node._from_result(c.read(key, recursive=recursive)),
            )
        )

    def try_get(self, key: str) -> Node | None:
        """Like :meth:`get`, but ``None`` for a missing key."""
        try:
            return self.get(key)
        except KeyNotFoundError:
            return None

    def watch(
        self, key: str, index: int, timeout: float, *, recursive: bool = False
    ) -> Node | None:
        """Wait for the first change of ``key`` at or after etcd ``index``.

        Returns the change, or ``None`` when ``timeout`` passed or etcd no longer holds
        history that old (callers re-read in both cases). Connection failures are
        retried until the watch's own deadline; if etcd stays unreachable for longer
        than the read timeout, :class:`RendezvousConnectionError` is raised.
        """
        deadline = Deadline(timeout)
        while True:
            remaining = deadline.remaining()
            if remaining <= 0:
                return None

            def call(client: Any, wait: float = remaining) -> Node:
                # python-etcd treats a timeout of 0 as "wait forever".
                result = client.read(
                    key,
                    wait=True,
                    waitIndex=index,
                    recursive=recursive,
                    timeout=max(wait, 0.001),
                )
                return Node._from_result(result)

            try:
                return self._note_index(
                    self._retrying(
                        "watch",
                        key,
                        call,
                        budget=deadline.earliest(self._read_timeout),
                        cap_requests=False,
                    )
                )
            except etcd.EtcdWatchTimedOut:
                return None
            except etcd.EtcdEventIndexCleared:
                return None
            except KeyNotFoundError:
                # Watching a missing key works in etcd; this only happens for a
                # missing parent directory on some versions. Treat as "no change yet".
                return None
            except RendezvousConnectionError:
                if deadline.expired():
                    return None
                raise

    def first_change_after(self, key: str, index: int) -> Node | None:
        """The first recorded change of ``key`` after ``index``, if etcd still has it."""
        return self.watch(key, index + 1, timeout=0.5)

    def server_version(self) -> str:
        """The etcd server version (``etcdserver`` field of ``/version``)."""
        return self._retrying("query the version of", "/version", lambda c: str(c.version))

    # -- writes -----------------------------------------------------------------------

    def set(self, key: str, value: str | None, *, ttl: int | None = None) -> Node:
        """Unconditionally write ``key`` (idempotent, so re-sent freely)."""
        return self._note_index(
            self._retrying(
                "write",
                key,
                lambda c: Node._from_result(c.write(key, value, ttl=ttl)),
            )
        )

    def refresh(self, key: str, ttl: int, *, timeout: float | None = None) -> Node:
        """Reset the TTL of an existing key without changing its value or notifying watchers.

        ``timeout`` bounds the time spent retrying connection failures (default: the
        read timeout).
        """
        return self._note_index(
            self._retrying(
                "refresh the TTL of",
                key,
                lambda c: Node._from_result(
                    c.write(key, None, ttl=ttl, refresh=True, prevExist=True)
                ),
                budget=None if timeout is None else Deadline(timeout),
            )
        )

    def mkdir(self, key: str, *, ttl: int | None = None) -> bool:
        """Create directory ``key`` unless it exists. Returns whether it was created."""
        try:
            self._retrying(
                "create the directory",
                key,
                lambda c: c.write(key, None, dir=True, prevExist=False, ttl=ttl),
            )
        except KeyExistsError:
            return False
        return True

    def create(
        self,
        key: str,
        value: str,
        *,
        ttl: int | None = None,
        value_is_unique: bool = True,
    ) -> Node:
        """Create ``key`` with ``value``; fails with :class:`KeyExistsError` if it exists.

        ``value_is_unique`` says whether no other writer could create the key with the
        same value; only then can a create whose first attempt failed on the connection
        recognise the key's presence as its own success.
        """
        return self._conditional(
            "create",
            key,
            value,
            None,
            value_is_unique,
            lambda c: c.write(key, value, ttl=ttl, prevExist=False),
        )

    def compare_and_swap(
        self,
        key: str,
        value: str,
        prev: Node,
        *,
        ttl: int | None = None,
        value_is_unique: bool = True,
    ) -> Node:
        """Replace ``prev`` (as read) with ``value``, only if ``key`` is still ``prev``.

        Compares on both ``prev.value`` (as PyTorch's workers do) and
        ``prev.modified_index``. Comparing the index too rules out the ABA case where
        the key went through other values and came back to ``prev.value``; it is
        strictly stronger, so workers comparing on the value alone still interlock with
        us. After a connection failure, consults the key's history from
        ``prev.modified_index`` to tell whether the swap was in fact applied.

        Raises:
            CompareFailedError: the key changed since ``prev`` was read.
            KeyNotFoundError: the key no longer exists.
        """
        if prev.value is None:
            raise ValueError(f"compare_and_swap: {key!r} has no value to compare against.")
        conditions: dict[str, Any] = {"prevIndex": prev.modified_index}
        if prev.value:
            # etcd refuses an empty prevValue; the index alone is the stronger check.
            conditions["prevValue"] = prev.value
        return self._conditional(
            "compare-and-swap",
            key,
            value,
            prev.modified_index,
            value_is_unique,
            lambda c: c.write(key, value, ttl=ttl, **conditions),
        )

    def compare_and_delete(self, key: str, prev: Node) -> bool:
        """Delete ``key`` only if it is still ``prev`` (same index and value).

        Returns whether it did. After a connection failure, a delete that etcd reports
        as failed is checked against the key's history, so an applied delete still
        returns ``True``.
        """
        conditions: dict[str, Any] = {"prevIndex": prev.modified_index}
        if prev.value:
            # etcd refuses an empty prevValue; the index alone is the stronger check.
            conditions["prevValue"] = prev.value
        ambiguous = False

        def note() -> None:
            nonlocal ambiguous
            ambiguous = True

        try:
            self._retrying(
                "compare-and-delete",
                key,
                lambda c: c.delete(key, **conditions),
                on_ambiguous=note,
            )
        except (CompareFailedError, KeyNotFoundError):
            if ambiguous:
                change = self.first_change_after(key, prev.modified_index)
                if change is not None and change.action == "compareAndDelete":
                    return True
            return False
        return True

    def delete(self, key: str, *, recursive: bool = False) -> bool:
        """Delete ``key`` (a directory with ``recursive``). Returns whether it existed."""
        try:
            self._retrying(
                "delete",
                key,
                lambda c: c.delete(key, recursive=recursive, dir=recursive or None),
            )
        except KeyNotFoundError:
            return False
        return True

    def _conditional(
        self,
        what: str,
        key: str,
        value: str,
        since: int | None,
        value_is_unique: bool,
        send: Callable[[Any], Any],
    ) -> Node:
        """Send a conditional write; after an ambiguous failure, find out if it applied.

        ``since`` is the modification index the write compared against, or ``None`` for
        a create (which compared against the key's absence): then the creation of the
        key's current version is examined.
        """
        ambiguous = False

        def note() -> None:
            nonlocal ambiguous
            ambiguous = True

        try:
            return self._note_index(
                self._retrying(what, key, lambda c: Node._from_result(send(c)), on_ambiguous=note)
            )
        except (CompareFailedError, KeyExistsError, KeyNotFoundError):
            if not ambiguous:
                raise
            # An earlier attempt may have been applied, making this one fail. The first
            # change after the state we compared against is decisive: every copy we
            # sent compared against the same state, so at most one copy can be it.
            change = self._change_to_examine(key, since)
            if change is not None and change.value == value and change.action != "expire":
                if value_is_unique:
                    logger.info("%s of %s was applied by an earlier attempt", what, key)
                    return self._note_index(change)
                logger.warning(
                    "%s of %s failed on the connection and an identical value is now "
                    "stored; another writer may have written it, so assuming ours was "
                    "not applied",
                    what,
                    key,
                )
            raise

    def _change_to_examine(self, key: str, since: int | None) -> Node | None:
        if since is not None:
            return self.first_change_after(key, since)
        # A create: look at how the key's current version came to be.
        current = self.try_get(key)
        if current is None:
            return None
        change = self.first_change_after(key, current.created_index - 1)
        if change is None and current.created_index == current.modified_index:
            # etcd no longer holds that history, but the key was not changed since.
            return current
        return change


def _payload_index(exc: etcd.EtcdException) -> int | None:
    payload = exc.payload if isinstance(exc.payload, dict) else {}
    index = payload.get("index")
    return int(index) if isinstance(index, int) else None


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
