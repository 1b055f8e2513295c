"""The ``etcd-v2`` rendezvous backend, ported from PyTorch Elastic.

:class:`EtcdRendezvousBackend` holds the state of a
:class:`~etcd_rendezvous.dynamic_rendezvous.DynamicRendezvousHandler` in one etcd key,
``/torch/elastic/rendezvous/<run_id>``, exactly as PyTorch 2.13's backend of the same
name does:

* the value is the base64 of the state bytes (which the handler encodes and decodes;
  this module only moves bytes);
* the fencing token is the key's etcd ``modifiedIndex``; a write with a token is a
  compare-and-swap on that index, a write without one a create;
* every write gives the key a TTL (two hours by default), so an abandoned rendezvous
  cleans itself up.

So a fleet mixing PyTorch's ``etcd-v2`` workers and ours shares one state. What
differs:

* requests go through :class:`~etcd_rendezvous._client.EtcdConnection`: several
  endpoints with failover, ``username``/``password``, connection errors that name the
  endpoint, and a compare-and-swap whose answer was lost on the connection recognised
  as applied (or not) from the key's history instead of being reported as a conflict;
* a state key that is not base64 raises
  :class:`~etcd_rendezvous.api.RendezvousStateError` naming the key, which is left
  untouched;
* a compare-and-swap on a key that expired or was deleted meanwhile reports "no state"
  instead of a connection error;
* :meth:`EtcdRendezvousBackend.wait_for_change` lets the handler wait for the next
  change of the state with an etcd watch instead of polling every second;
* the store returned by :func:`create_backend` reads the keys it is asked for instead
  of the whole store directory, so it does not fail on a fresh etcd where
  ``/torch/elastic/store`` does not exist yet (PyTorch issue 132950).
"""

from __future__ import annotations

import binascii
import contextlib
import logging
import threading
from base64 import b64decode, b64encode
from typing import Any

from ._client import (
    CompareFailedError,
    EtcdConnection,
    KeyExistsError,
    KeyNotFoundError,
    Node,
)
from ._params import create_etcd_connection, seconds
from ._retry import REWATCH, Deadline
from ._transport import Transport
from .api import RendezvousParameters, RendezvousStateError
from .dynamic_rendezvous import RendezvousBackend, Token
from .etcd_store import EtcdStore
from .layout import ETCD_V2_STATE_PREFIX, ETCD_V2_STORE_PREFIX, etcd_v2_state_key

__all__ = ["EtcdRendezvousBackend", "create_backend"]

logger = logging.getLogger(__name__)

# How much of a corrupt value to quote in an error message.
_PREVIEW_CHARS = 60
# The dynamic rendezvous's default join timeout, in seconds.
_DEFAULT_JOIN_TIMEOUT = 600.0


class EtcdRendezvousBackend(RendezvousBackend):
    """Represents an etcd-based rendezvous backend.

    The fencing token is the etcd ``modifiedIndex`` of the state it was read with.

    The backend releases the connection it owns on :meth:`close` (or leaving a ``with``
    block): the one it opened itself from an ``etcd.Client``, or one handed over with
    ``owns_connection=True`` (as :func:`create_backend` does). A connection it was merely
    given stays open for its owner.

    Args:
        client: the :class:`~etcd_rendezvous._client.EtcdConnection` to use, or a
            python-etcd ``etcd.Client`` (converted with
            :meth:`~etcd_rendezvous._client.EtcdConnection.from_client`).
        run_id: the run id of the rendezvous.
        key_prefix: the path under which to store the rendezvous state in etcd; the
            key is ``<key_prefix>/<run_id>`` (just ``run_id`` without a prefix).
        ttl: the TTL of the rendezvous state, in seconds. If not specified (or not
            positive), defaults to two hours.
        owns_connection: whether :meth:`close` closes ``client`` when it is an
            :class:`~etcd_rendezvous._client.EtcdConnection`; a connection converted from
            an ``etcd.Client`` is always the backend's own. An owned connection is also
            closed if the constructor raises.

    Raises:
        ValueError: ``run_id`` is empty.
        TypeError: ``client`` is neither kind of client.
    """

    _DEFAULT_TTL = 7200  # 2 hours

    def __init__(
        self,
        client: Any,
        run_id: str,
        key_prefix: str | None = None,
        ttl: int | None = None,
        *,
        owns_connection: bool = False,
    ) -> None:
        self._conn = EtcdConnection.from_client(client, param="client")
        self._owns_conn = owns_connection or self._conn is not client
        self._close_lock = threading.Lock()
        self._closed = False
        if not run_id:
            self.close()
            raise ValueError("The run id must be a non-empty string.")
        self._key = etcd_v2_state_key(run_id, key_prefix)
        self._ttl = ttl if ttl and ttl > 0 else self._DEFAULT_TTL
        # The etcd index at which the key was last seen missing: a watch for its
        # creation must start right after it (``None``: never seen missing).
        self._absent_at: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self._key!r}, endpoints={self._conn.endpoints!r})"

    def __enter__(self) -> EtcdRendezvousBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection if the backend owns it (see the class docs). Idempotent.

        The rendezvous state is left in etcd.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_conn:
            self._conn.close()

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v2"

    @property
    def key(self) -> str:
        """The etcd key holding the rendezvous state."""
        return self._key

    @property
    def state_key(self) -> str:
        """See base class: the etcd key holding the state (:attr:`key`)."""
        return self._key

    @property
    def ttl(self) -> int:
        """The TTL given to the state key on every write, in seconds."""
        return self._ttl

    @property
    def connection(self) -> Transport:
        """The connection the backend sends its requests through."""
        return self._conn

    def bounded_by(self, deadline: Deadline) -> contextlib.AbstractContextManager[None]:
        """See base class: every request of this thread on the backend's connection
        (shared with the store of :func:`create_backend`) ends by ``deadline``; etcd
        failures such as an election are retried until then."""
        return self._conn.bounded_by(deadline)

    def get_state(self) -> tuple[bytes, Token] | None:
        """Return the state and its token, or ``None`` if there is no state.

        Raises:
            RendezvousConnectionError: etcd could not be reached.
            RendezvousStateError: the key does not hold base64 (or is a directory).
        """
        try:
            node = self._conn.get(self._key)
        except KeyNotFoundError as exc:
            self._note_absent(exc)
            return None
        return self._decode(node), node.modified_index

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Write ``state`` if ``token`` is current (or, without a token, if there is none).

        Returns the state now stored, its token and whether it is ours; ``None`` if
        the state was deleted (or expired) in the meantime. A token that is not an
        etcd index (e.g. ``"invalid"``) never matches.

        Raises:
            RendezvousConnectionError: etcd could not be reached; the write may or may
                not have been applied.
            RendezvousStateError: the stored value does not decode.
        """
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"state: expected bytes, got {type(state).__name__}.")
        index: int | None = None
        if token:
            try:
                index = int(token)
            except (TypeError, ValueError):
                return self._current_state()
        value = b64encode(state).decode()
        try:
            if index:
                node = self._conn.compare_and_swap(
                    self._key, value, _prev(self._key, index), ttl=self._ttl
                )
            else:
                node = self._conn.create(self._key, value, ttl=self._ttl)
        except (CompareFailedError, KeyExistsError, KeyNotFoundError):
            return self._current_state()
        return bytes(state), node.modified_index, True

    def wait_for_change(self, token: Token | None, timeout: float) -> None:
        """Block until the state changes after ``token``, or for ``timeout`` seconds.

        ``token`` is the token of the state the caller last saw (``None``: it saw no
        state). Returns at once if the state already changed since then. Uses an etcd
        watch starting right after ``token``, so no change can slip between the
        caller's read and the wait. The caller re-reads the state afterwards; a
        spurious early return is possible (e.g. on an unusable token) and harmless.

        Raises:
            RendezvousConnectionError: etcd was unreachable for longer than the read
                timeout.
        """
        rewatch = REWATCH.start(max(0.0, timeout))
        deadline = rewatch.deadline
        expected: int | None = None
        if token:
            try:
                expected = int(token)
            except (TypeError, ValueError):
                return
        since = expected if expected is not None else self._absent_at
        while True:
            if since is None:
                # No usable starting point: read the key to get one (or a change).
                since = self._index_if_unchanged(expected)
                if since is None:
                    return
            if deadline.expired():
                return
            if self._conn.watch(self._key, since + 1, deadline.remaining()) is not None:
                return
            if deadline.expired():
                return
            # etcd no longer holds the history since ``since`` (or the watch ended
            # early): find out from the key itself, then watch from where it was read.
            since = None
            rewatch.pause()

    # -- internals ------------------------------------------------------------------------

    def _index_if_unchanged(self, expected: int | None) -> int | None:
        """Read the key: the etcd index up to which it is still at ``expected``
        (``None``: absent), or ``None`` if it changed."""
        try:
            node = self._conn.get(self._key)
        except KeyNotFoundError as exc:
            self._note_absent(exc)
            return self._absent_at if expected is None else None
        if node.modified_index != expected:
            return None
        return node.etcd_index

    def _note_absent(self, exc: KeyNotFoundError) -> None:
        index = exc.etcd_index if exc.etcd_index is not None else self._conn.last_index
        self._absent_at = index

    def _current_state(self) -> tuple[bytes, Token, bool] | None:
        result = self.get_state()
        if result is None:
            return None
        return result[0], result[1], False

    def _decode(self, node: Node) -> bytes:
        if node.is_dir or node.value is None:
            raise RendezvousStateError(
                f"The rendezvous state key {self._key!r} is an etcd directory, not a value; "
                "another program wrote keys below it."
            )
        try:
            return b64decode(node.value, validate=True)
        except (binascii.Error, ValueError):
            preview = repr(node.value)
            if len(preview) > _PREVIEW_CHARS:
                preview = preview[:_PREVIEW_CHARS] + "..."
            raise RendezvousStateError(
                f"The rendezvous state key {self._key!r} holds {preview}, which is not "
                "base64: it was not written by a rendezvous backend. The key was left "
                "untouched."
            ) from None


def _prev(key: str, index: int) -> Node:
    """A stand-in for the node read at ``index``: compare-and-swap on the index alone.

    PyTorch's backend compares on ``prevIndex`` only; the index identifies the value.
    """
    return Node(
        key=key,
        value="",
        modified_index=index,
        created_index=0,
        etcd_index=index,
        ttl=None,
        is_dir=False,
        children=(),
        action="get",
    )


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Create a new :class:`EtcdRendezvousBackend` and its store from ``params``.

    ``params.endpoint`` may list several etcd endpoints, comma-separated. Options (as
    values or strings, e.g. from torchrun's ``--rdzv-conf``):

    ===============  ==========================================================  =======
    option           meaning                                                     default
    ===============  ==========================================================  =======
    join_timeout     creation, too, ends within it (see below)                   600
    read_timeout     seconds one etcd request waits for an answer (then the      60
                     next endpoint is tried)
    connect_timeout  seconds to connect to one endpoint                          5
    protocol         ``http`` or ``https``                                       http
    ssl_cert         client certificate file (https)
    ssl_cert_key     private key of ``ssl_cert`` (https)
    ca_cert          CA bundle that verifies the server (https)
    username         etcd user (with ``password``)
    password         password of ``username``
    ===============  ==========================================================  =======

    The state is kept under ``/torch/elastic/rendezvous/<run_id>`` and the store under
    ``/torch/elastic/store``, as in PyTorch. The endpoints are contacted once, so a
    wrong address fails here rather than in the first rendezvous: within
    ``connect_timeout`` for an endpoint that refuses connections or never answers, and
    within ``join_timeout`` (plus about a second) however etcd fails.

    Both share one connection, owned by the backend: :meth:`EtcdRendezvousBackend.close`
    releases it (the store borrows it and its ``close()`` leaves it open). Pass
    ``owns_backend=True`` to :func:`~etcd_rendezvous.dynamic_rendezvous.create_handler`
    to have the handler close the backend in turn.

    Raises:
        ValueError: an option or the endpoint is invalid; the message names it.
        RendezvousConnectionError: etcd cannot be reached at any endpoint (or does not
            serve the v2 API); the message names the endpoints.
    """
    deadline = Deadline(seconds(params, "join_timeout", _DEFAULT_JOIN_TIMEOUT))
    conn = create_etcd_connection(
        params,
        cert_option="ssl_cert",
        key_option="ssl_cert_key",
        cacert_option="ca_cert",
        deadline=deadline,
    )
    backend = EtcdRendezvousBackend(
        conn, params.run_id, key_prefix=ETCD_V2_STATE_PREFIX, owns_connection=True
    )
    try:
        # Fail early, as PyTorch's client does when it connects: one read of the key.
        with conn.bounded_by(deadline):
            conn.try_get(backend.key)
    except BaseException:
        backend.close()
        raise
    return backend, EtcdStore(conn, ETCD_V2_STORE_PREFIX)
