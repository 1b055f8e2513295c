"""A c10d-style key-value store on etcd, wire-compatible with PyTorch's ``EtcdStore``.

:class:`EtcdStore` is what :class:`~etcd_rendezvous.etcd_rendezvous.EtcdRendezvousHandler`
hands to the workers once a rendezvous completes. Keys and values are stored as
PyTorch's ``EtcdStore`` stores them (base64, under ``<prefix>/<base64 key>``), so torch
workers and ours share a store. One addition: a value written by ``add``,
``compare_set`` or ``append`` ends with ``~`` and a random tag that PyTorch's decoder
skips, so that a write whose answer was lost recognises itself (see
:ref:`writes whose answer was lost <lost-answers>`).

Unlike the reference, ``get``/``wait``/``check`` read only the keys asked for and wait
with an etcd watch from the index at which a key was seen missing (no polling); a value
that is not base64 raises :class:`~etcd_rendezvous.api.RendezvousStateError` naming the
key, and nothing stored is touched.
"""

from __future__ import annotations

import binascii
import dataclasses
import logging
import operator
import random
import secrets
import threading
import time
from base64 import b64decode, b64encode
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._transport.connect import as_transport
from ._transport.interface import (
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    Transport,
)
from ._transport.retry import CONTENTION, REWATCH, Retry
from .api import Deadline, RendezvousConnectionError, RendezvousStateError
from .layout import normalize_key, store_value_key

if TYPE_CHECKING:
    from .api import Store

__all__ = ["DEFAULT_TIMEOUT", "EtcdStore", "cas_delay"]

logger = logging.getLogger(__name__)

#: Default for :attr:`EtcdStore.timeout`, the same as c10d's ``Store`` (``kDefaultTimeout``).
DEFAULT_TIMEOUT = timedelta(seconds=300)

KeyLike = str | bytes
"""Keys and values may be ``str`` (stored as UTF-8) or ``bytes``."""

# Watch events that leave a value under the key (as opposed to delete/expire).
_VALUE_ACTIONS = frozenset({"set", "create", "compareAndSwap", "update"})
# How much of a bad value to quote in an error message.
_PREVIEW_CHARS = 60
# How many missing keys a timeout message lists.
_LISTED_KEYS = 5
# Seconds short of its timeout a call that gave up may have waited and still be said to
# have waited the timeout (its last request began before the deadline).
_WAIT_SLACK = 0.5
# Write tags (see _tagged): a separator and characters that base64 decoders which skip
# non-alphabet characters ignore; 8**12 tags make a collision between two concurrent
# writes of one value practically impossible.
_TAG_SEPARATOR = "~"
_TAG_ALPHABET = "-_.!*:;,"
_TAG_LENGTH = 12


def cas_delay() -> None:
    """Sleep for a random 0 to 0.1 s, like PyTorch's helper of the same name.

    Kept for code that imports it from the reference module. :class:`EtcdStore` itself
    backs off after a failed compare-and-swap with the capped, jittered
    :data:`~etcd_rendezvous._transport.retry.CONTENTION` policy, which starts at a few
    milliseconds, until its :attr:`~EtcdStore.timeout`.
    """
    time.sleep(random.uniform(0, 0.1))


class EtcdStore:
    """A c10d ``Store`` on etcd, readable and writable by PyTorch's ``EtcdStore``.

    Keys live under ``etcd_store_prefix``; a rendezvous uses one prefix per rendezvous
    version. The store satisfies :class:`~etcd_rendezvous.api.Store` and adds the
    extended c10d methods (:meth:`compare_set`, :meth:`delete_key`, :meth:`num_keys`,
    :meth:`multi_get`, :meth:`multi_set`, :meth:`append`). It does not need PyTorch and
    is not a ``torch.distributed.Store`` itself; wrap it in
    :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` to pass it to PyTorch (e.g.
    ``init_process_group(store=...)``). The handlers do that for you when PyTorch is
    installed. It is safe to share between threads.

    The store releases the connection it owns on :meth:`close` (or leaving a ``with``
    block): the one it opened itself from an ``etcd.Client``, or an
    :class:`~etcd_rendezvous._transport.v2.EtcdConnection` handed over with
    ``owns_connection=True``. A connection it was merely given stays open for its owner.

    Args:
        etcd_client: an :class:`~etcd_rendezvous._transport.v2.EtcdConnection`, or a
            python-etcd ``etcd.Client`` (converted with
            :meth:`~etcd_rendezvous._transport.v2.EtcdConnection.from_client`; the original is
            kept on :attr:`client` and not used for requests).
        etcd_store_prefix: the etcd directory holding the keys; a trailing ``/`` is
            added if missing (as in PyTorch).
        timeout: how long :meth:`get`, :meth:`wait` and :meth:`multi_get` wait for a
            key, and how long :meth:`add`, :meth:`compare_set` and :meth:`append` go on
            retrying when other writers keep changing the key first; defaults to
            :data:`DEFAULT_TIMEOUT` (300 s). It also bounds every call of the store:
            etcd failures (an election, an unreachable member) are retried until then,
            and no call outlives it by more than about a second.
        owns_connection: whether :meth:`close` closes ``etcd_client`` when it is an
            :class:`~etcd_rendezvous._transport.v2.EtcdConnection` (set by whoever opened it
            and hands it over); a connection converted from an ``etcd.Client`` is always
            the store's own.

    Raises:
        TypeError: ``etcd_client`` is neither kind of client, ``etcd_store_prefix`` is
            not a string or ``timeout`` not a ``timedelta``.
    """

    def __init__(
        self,
        etcd_client: Any,
        etcd_store_prefix: str,
        timeout: timedelta | None = None,
        *,
        owns_connection: bool = False,
    ) -> None:
        if not isinstance(etcd_store_prefix, str):
            raise TypeError(
                "etcd_store_prefix: expected a str, got "
                f"{type(etcd_store_prefix).__name__}: {etcd_store_prefix!r}."
            )
        #: The client given to the constructor (an ``etcd.Client`` or an
        #: :class:`~etcd_rendezvous._transport.v2.EtcdConnection`).
        self.client = etcd_client
        self._conn = as_transport(etcd_client, param="etcd_client")
        self._owns_conn = owns_connection or self._conn is not etcd_client
        self._close_lock = threading.Lock()
        self._closed = False
        #: The store directory, always ending in ``/``; keys are ``prefix + base64(key)``.
        self.prefix = (
            etcd_store_prefix if etcd_store_prefix.endswith("/") else etcd_store_prefix + "/"
        )
        #: The store's directory as etcd stores its keys (see :func:`store_value_key`),
        #: with its ``/``: what the listings and watches of the whole store name.
        self._below = normalize_key(self.prefix).rstrip("/") + "/"
        self._timeout = DEFAULT_TIMEOUT
        if timeout is not None:
            self.set_timeout(timeout)
        #: The deadline of a view made by :meth:`with_deadline` (``None``: none).
        self._cap: Deadline | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prefix={self.prefix!r}, endpoints={self._conn.endpoints!r})"

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the connection if the store owns it (see the class docs). Idempotent.

        The keys are left in etcd; a store given a connection leaves it open.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_conn:
            self._conn.close()

    # -- configuration -----------------------------------------------------------------

    @property
    def connection(self) -> Transport:
        """The connection the store sends its requests through."""
        return self._conn

    @property
    def timeout(self) -> timedelta:
        """How long :meth:`get`, :meth:`wait` and :meth:`multi_get` wait for missing keys,
        and the read-modify-write operations retry lost races."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default :attr:`timeout`.

        Raises:
            TypeError: ``timeout`` is not a ``datetime.timedelta``.
        """
        self._timeout = _check_timedelta(timeout, "timeout")

    def with_deadline(self, deadline: Deadline) -> EtcdStore:
        """This store, as seen by a caller with a deadline of its own: a store over the
        same connection, prefix and :attr:`timeout` whose every call also ends by
        ``deadline`` (the earlier of the two wins; a timeout message then says how long
        the call really waited). For a rendezvous whose own calls to the store, such
        as the exchange of rank 0's address, must end with the rendezvous; the store
        handed to the workers is the rendezvous' own, without it.

        Not in PyTorch's ``EtcdStore``. The view never closes the connection.

        Raises:
            TypeError: ``deadline`` is not a :class:`~etcd_rendezvous.api.Deadline`.
        """
        if not isinstance(deadline, Deadline):
            raise TypeError(
                f"deadline: expected an etcd_rendezvous.api.Deadline, got "
                f"{type(deadline).__name__}."
            )
        view = EtcdStore(self._conn, self.prefix, self._timeout)
        view.client = self.client
        view._cap = deadline if self._cap is None else self._cap.earlier(deadline)
        return view

    # -- c10d Store interface -----------------------------------------------------------

    def set(self, key: KeyLike, value: KeyLike) -> None:
        """Write ``value`` under ``key``, replacing any previous value.

        Raises:
            TypeError: ``key`` or ``value`` is not ``str`` or ``bytes``.
            ValueError: ``key`` is empty.
        """
        path = self._path(key)
        self._conn.set(path, _encode(value, "value"), deadline=self._deadline())

    def get(self, key: KeyLike) -> bytes:
        """Return the value under ``key``, waiting up to :attr:`timeout` for it to be set.

        Reads the one key; if it is missing, watches it from the index at which it was
        found missing, so the call returns as soon as the key is written.

        Raises:
            LookupError: the key was not set within :attr:`timeout` (the exception type
                PyTorch's ``EtcdStore`` raises); the message names the key.
            RendezvousStateError: the key holds something that is not base64.
            RendezvousConnectionError: etcd could not be reached.
        """
        path = self._path(key)
        awaited = self._await({path: key}, self._timeout)
        if awaited.missing:
            raise LookupError(
                f"Key {key!r} not found in EtcdStore {self.prefix!r} {awaited.waited()}."
            )
        return self._decode(awaited.found[path], key)

    def add(self, key: KeyLike, num: int) -> int:
        """Atomically add ``num`` to the counter under ``key`` and return the new value.

        A missing key counts as ``0``; the counter is stored as PyTorch's is (base64 of
        its decimal string). When ``add`` returns, its increment was applied exactly
        once, through elections and members dying mid-request (see
        :ref:`writes whose answer was lost <lost-answers>`).

        Raises:
            TypeError: ``key`` is not ``str``/``bytes`` or ``num`` not an integer.
            ValueError: the key holds something that is not a decimal integer (the
                key is left untouched).
            RendezvousStateError: the key holds something that is not base64.
            RendezvousConnectionError: etcd could not be reached for :attr:`timeout`,
                or lost the answer and the history that would tell: the increment may
                or may not have been applied.
            LookupError: other writers kept changing the key first for longer than
                :attr:`timeout` (the increment was not applied).
        """
        path = self._path(key)
        try:
            amount = operator.index(num)
        except TypeError:
            raise TypeError(f"num: expected an int, got {type(num).__name__}: {num!r}.") from None

        def update(current: bytes | None) -> tuple[bytes, bool]:
            if current is None:
                return str(amount).encode(), True
            try:
                return str(int(current) + amount).encode(), True
            except ValueError:
                raise ValueError(
                    f"Cannot add to key {key!r} in EtcdStore {self.prefix!r}: its value "
                    f"{_preview(current)} is not an integer. The key was left untouched."
                ) from None

        return int(self._read_modify_write(path, key, update))

    def wait(self, keys: Sequence[KeyLike], override_timeout: timedelta | None = None) -> None:
        """Wait until every key in ``keys`` has been set, or raise after the timeout.

        Keys found missing are awaited with one watch (the key's own, or a recursive
        watch on the store directory when several are missing), re-checking only the
        keys still missing. A key counts as set once it has been seen with a value
        during the call.

        Args:
            keys: the keys to wait for.
            override_timeout: used instead of :attr:`timeout` if given.

        Raises:
            LookupError: some keys were still missing at the timeout; the message
                names them.
            TypeError: ``keys`` is a single string rather than a list of keys.
        """
        wanted = self._paths(keys)
        timeout = (
            self._timeout
            if override_timeout is None
            else _check_timedelta(override_timeout, "override_timeout")
        )
        awaited = self._await(dict(wanted), timeout)
        if awaited.missing:
            raise LookupError(
                f"Timeout while waiting for keys in EtcdStore {self.prefix!r}: "
                f"{_list_keys(awaited.missing.values())} not set {awaited.waited()}."
            )

    def check(self, keys: Sequence[KeyLike]) -> bool:
        """Return whether every key in ``keys`` is set, without waiting.

        Reads each key (stopping at the first missing one), never the whole directory.
        """
        paths = self._paths(keys)
        deadline = self._deadline()
        return all(self._read(path, key, deadline) is not None for path, key in paths)

    # -- extended c10d interface --------------------------------------------------------

    def compare_set(self, key: KeyLike, expected_value: KeyLike, desired_value: KeyLike) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return its value.

        Follows c10d: a missing key is created when ``expected_value`` is empty. The
        result is the value the key holds afterwards (``desired_value`` on success, the
        current value otherwise), except that for a missing key and a non-empty
        ``expected_value`` nothing is written and ``expected_value`` is returned, as
        c10d's stores do.

        Raises:
            TypeError: an argument is not ``str`` or ``bytes``.
            RendezvousStateError: the key holds something that is not base64.
            LookupError: other writers kept changing the key first for longer than
                :attr:`timeout`.
        """
        path = self._path(key)
        expected = _as_bytes(expected_value, "expected_value")
        desired = _as_bytes(desired_value, "desired_value")

        def decide(current: bytes | None) -> tuple[bytes, bool]:
            if current is None:
                return (desired, True) if not expected else (expected, False)
            return (desired, True) if current == expected else (current, False)

        # As for add(), the write's tag tells it from another caller's write of the same
        # value when its answer was lost, so that exactly one of them wins. If etcd
        # cannot tell, deciding again on the value read back is right either way.
        return self._read_modify_write(path, key, decide, idempotent=True)

    def append(self, key: KeyLike, value: KeyLike) -> None:
        """Atomically append ``value`` to the value under ``key``, creating it if missing.

        Same exactly-once guarantee as :meth:`add` (the value after appending plays the
        part of the counter value).

        Raises:
            TypeError: ``key`` or ``value`` is not ``str`` or ``bytes``.
            RendezvousStateError: the key holds something that is not base64.
            RendezvousConnectionError: etcd could not be reached for :attr:`timeout`,
                or lost the answer and the history that would tell: the append may or
                may not have been applied.
            LookupError: other writers kept changing the key first for longer than
                :attr:`timeout`.
        """
        path = self._path(key)
        suffix = _as_bytes(value, "value")
        self._read_modify_write(path, key, lambda current: ((current or b"") + suffix, True))

    def multi_get(self, keys: Sequence[KeyLike]) -> list[bytes]:
        """Return the values of ``keys``, in order, waiting up to :attr:`timeout` for all.

        Raises:
            LookupError: some keys were still missing at the timeout; the message
                names them.
        """
        wanted = self._paths(keys)
        awaited = self._await(dict(wanted), self._timeout)
        if awaited.missing:
            raise LookupError(
                f"Keys {_list_keys(awaited.missing.values())} not found in EtcdStore "
                f"{self.prefix!r} {awaited.waited()}."
            )
        return [self._decode(awaited.found[path], key) for path, key in wanted]

    def multi_set(self, keys: Sequence[KeyLike], values: Sequence[KeyLike]) -> None:
        """Write ``values[i]`` under ``keys[i]`` for every ``i``.

        All arguments are checked before anything is written. The writes are
        individual (etcd v2 has no transactions): a reader may see some before others.

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
            TypeError: a key or value is not ``str`` or ``bytes``.
        """
        paths = self._paths(keys)
        if isinstance(values, (str, bytes)):
            raise TypeError("values: expected a sequence of values, got a single value.")
        if len(paths) != len(values):
            raise ValueError(
                f"keys/values: got {len(paths)} keys but {len(values)} values; they must match."
            )
        encoded = [_encode(value, "values") for value in values]
        deadline = self._deadline()
        for (path, _), data in zip(paths, encoded, strict=True):
            self._conn.set(path, data, deadline=deadline)

    def delete_key(self, key: KeyLike) -> bool:
        """Delete ``key``. Returns whether it existed."""
        path = self._path(key)
        return self._conn.delete(path, deadline=self._deadline())

    def num_keys(self) -> int:
        """Return the number of keys in the store.

        Unlike the key lookups this reads the whole store directory, so its cost grows
        with the number of keys.

        Raises:
            RendezvousStateError: the store prefix is a key, not a directory.
        """
        try:
            # The keys below the prefix (with its "/"): a user granted --prefix on the
            # store's directory with its "/" may not read the directory's own key.
            node = self._conn.list_dir(self._below, recursive=True, deadline=self._deadline())
        except KeyNotFoundError:
            return 0
        if not node.is_dir:
            raise RendezvousStateError(
                f"EtcdStore prefix {self.prefix!r} is an etcd key, not a directory."
            )
        return _count_values(node)

    # -- internals ------------------------------------------------------------------------

    def _deadline(self, timeout: timedelta | None = None) -> Deadline:
        """The deadline of a call from now: ``timeout`` (default: the store's
        :attr:`timeout`), or the view's (see :meth:`with_deadline`) if earlier. Every
        request of the call ends by it; etcd failures are retried until then."""
        own = Deadline((self._timeout if timeout is None else timeout).total_seconds())
        return own if self._cap is None else self._cap.earlier(own)

    def _path(self, key: object, param: str = "key") -> str:
        """The etcd key of store key ``key``, normalised the way etcd stores it."""
        encoded = _encode(key, param)
        if not encoded:
            raise ValueError(f"{param}: the empty key is not allowed (it names the store itself).")
        return store_value_key(self.prefix, encoded)

    def _paths(self, keys: Sequence[KeyLike], param: str = "keys") -> list[tuple[str, KeyLike]]:
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"{param}: expected a list of keys, got the single key {keys!r}.")
        return [(self._path(key, param), key) for key in keys]

    def _read(self, path: str, key: KeyLike, deadline: Deadline) -> Node | None:
        """Read one key by ``deadline``; ``None`` if missing."""
        node = self._conn.try_get(path, deadline=deadline)
        if node is not None:
            self._require_value(node, key)
        return node

    def _require_value(self, node: Node, key: KeyLike) -> None:
        if node.is_dir or node.value is None:
            raise RendezvousStateError(
                f"Key {key!r} of EtcdStore {self.prefix!r} is an etcd directory "
                f"({node.key!r}), not a value; another program wrote keys below it."
            )

    def _decode(self, node: Node, key: KeyLike) -> bytes:
        self._require_value(node, key)
        raw = node.value or ""
        try:
            return b64decode(raw.split(_TAG_SEPARATOR, 1)[0], validate=True)
        except (binascii.Error, ValueError):
            raise RendezvousStateError(
                f"Key {key!r} of EtcdStore {self.prefix!r} (etcd key {node.key!r}) holds "
                f"{_preview(raw)}, which is not base64: it was not written by an EtcdStore. "
                "The key was left untouched."
            ) from None

    def _await(self, wanted: dict[str, KeyLike], timeout: timedelta) -> _Awaited:
        """Wait until every etcd key in ``wanted`` holds a value, or the timeout passes.

        Returns the nodes found, the keys still missing (empty unless timed out) and how
        long the wait lasted. Every request runs under the same deadline, which a view's
        (see :meth:`with_deadline`) may shorten.
        """
        started = time.monotonic()
        deadline = self._deadline(timeout)
        found, missing = self._await_until(wanted, deadline)
        cut_short = deadline is self._cap
        return _Awaited(found, missing, time.monotonic() - started, timeout, cut_short)

    def _await_until(
        self, wanted: dict[str, KeyLike], deadline: Deadline
    ) -> tuple[dict[str, Node], dict[str, KeyLike]]:
        """The loop of :meth:`_await`."""
        found: dict[str, Node] = {}
        missing: dict[str, KeyLike] = {}
        since = self._read_into(wanted, found, missing, deadline)
        # Only for a watch that ends early without an event (etcd dropped the history we
        # asked for, or an anomaly): re-reading is the fix, the back-off stops a spin.
        rewatch = REWATCH.start(deadline)
        while missing:
            if deadline.expired():
                break
            if len(missing) == 1:
                watched, recursive = next(iter(missing)), False
            else:
                watched, recursive = self._below, True  # the keys below it (see num_keys)
            change = self._conn.watch(watched, since + 1, deadline, recursive=recursive)
            if change is None:
                if deadline.expired():
                    break
                rewatch.pause()
                retry = dict(missing)
                missing.clear()
                since = self._read_into(retry, found, missing, deadline)
                continue
            rewatch.reset()
            since = max(since, change.modified_index)
            path = normalize_key(change.key)
            if path in missing and change.action in _VALUE_ACTIONS:
                self._require_value(change, missing[path])
                found[path] = change
                del missing[path]
        return found, missing

    def _read_into(
        self,
        wanted: dict[str, KeyLike],
        found: dict[str, Node],
        missing: dict[str, KeyLike],
        deadline: Deadline,
    ) -> int:
        """Read each key of ``wanted`` into ``found`` or ``missing``, by ``deadline``.

        Returns the lowest etcd index at which a key was seen missing: watching from
        the next index sees every later write to any of them.
        """
        since: int | None = None
        for path, key in wanted.items():
            try:
                node = self._conn.get(path, deadline=deadline)
            except KeyNotFoundError as exc:
                missing[path] = key
                index = exc.etcd_index if exc.etcd_index is not None else self._conn.last_index
                since = index if since is None else min(since, index)
            else:
                self._require_value(node, key)
                found[path] = node
        return since if since is not None else self._conn.last_index

    def _read_modify_write(
        self,
        path: str,
        key: KeyLike,
        update: Callable[[bytes | None], tuple[bytes, bool]],
        *,
        idempotent: bool = False,
    ) -> bytes:
        """Replace the value of ``key`` by ``update(current)`` atomically; return it.

        ``update`` receives ``None`` for a missing key and returns ``(value, write)``:
        with ``write`` false nothing is written and ``value`` is returned as it is.
        Creates with ``prevExist=false`` and swaps comparing value and index, retrying
        with jittered back-off on contention for up to :attr:`timeout`. A write whose
        outcome etcd cannot tell is not sent again unless ``idempotent`` (``update``
        applied to the value read back gives the right result whether it applied).

        Raises:
            RendezvousConnectionError: see :meth:`add` (not if ``idempotent``).
            LookupError: the key kept changing under us for longer than :attr:`timeout`.
        """
        started = time.monotonic()
        deadline = self._deadline()
        retry = CONTENTION.start(
            deadline,
            lambda: LookupError(
                f"Could not update key {key!r} in EtcdStore {self.prefix!r} "
                f"{_waited(started, self._timeout)}: other writers kept changing it first."
            ),
        )
        return self._update(path, key, update, retry, idempotent)

    def _update(
        self,
        path: str,
        key: KeyLike,
        update: Callable[[bytes | None], tuple[bytes, bool]],
        retry: Retry,
        idempotent: bool,
    ) -> bytes:
        """The compare-and-swap loop of :meth:`_read_modify_write`, every request by the
        retry's deadline."""
        deadline = retry.deadline
        node = self._read(path, key, deadline)
        while True:
            if node is None:
                new, write = update(None)
                if not write:
                    return new
                try:
                    self._conn.create(path, _tagged(new), deadline=deadline)
                except KeyExistsError as exc:
                    if not idempotent:
                        _check_known(exc, key)
                    retry.wait()
                    node = self._read(path, key, deadline)
                    continue
                return bytes(new)
            new, write = update(self._decode(node, key))
            if not write:
                return new
            try:
                self._conn.compare_and_swap(path, _tagged(new), node, deadline=deadline)
            except CompareFailedError as exc:
                if not idempotent:
                    _check_known(exc, key)
                retry.wait()
                node = self._read(path, key, deadline)
            except KeyNotFoundError as exc:
                if not idempotent:
                    _check_known(exc, key)
                retry.wait()
                node = None
            else:
                return bytes(new)


@dataclasses.dataclass(frozen=True)
class _Awaited:
    """What a wait for keys found: the nodes found, the keys still missing, the seconds
    it lasted, the store's timeout and whether the caller's deadline came first."""

    found: dict[str, Node]
    missing: dict[str, KeyLike]
    seconds: float
    timeout: timedelta
    cut_short: bool

    def waited(self) -> str:
        """How long the wait lasted, as a timeout message says it (see
        :func:`_how_long`)."""
        return _how_long(self.seconds, self.timeout, cut_short=self.cut_short)


def _check_known(
    refusal: CompareFailedError | KeyExistsError | KeyNotFoundError, key: KeyLike
) -> None:
    """Raise if our own earlier copy of the refused write may have been applied (etcd
    lost its answer, and the history that would tell is gone or could not be read):
    writing again could apply it twice."""
    if refusal.outcome_unknown:
        raise RendezvousConnectionError(
            f"Could not update key {key!r} in etcd ({refusal.key!r}): etcd lost the answer "
            f"to a write and {refusal.unknown_because}; the update may or may not have "
            "been applied."
        )


def _waited(started: float, timeout: timedelta) -> str:
    """How long a call that gave up at its deadline really waited, from ``started``
    (``time.monotonic()``), for its message (see :func:`_how_long`)."""
    seconds = time.monotonic() - started
    return _how_long(seconds, timeout, cut_short=seconds < timeout.total_seconds() - _WAIT_SLACK)


def _how_long(seconds: float, timeout: timedelta, *, cut_short: bool) -> str:
    """The time a call waited, as its timeout message says it: "within 300 s" when that
    is the store's ``timeout``; the ``seconds`` it really waited, and why, when a
    caller's deadline (a rendezvous' own, for instance) ended it sooner (``cut_short``)."""
    limit = timeout.total_seconds()
    if not cut_short:
        return f"within {limit:g} s"
    return (
        f"within {seconds:.1f} s (its caller's deadline, earlier than the store's "
        f"timeout of {limit:g} s)"
    )


def _check_timedelta(value: object, param: str) -> timedelta:
    if not isinstance(value, timedelta):
        raise TypeError(f"{param}: expected a datetime.timedelta, got {type(value).__name__}.")
    return value


def _as_bytes(data: object, param: str) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    raise TypeError(f"{param}: expected str or bytes, got {type(data).__name__}: {data!r:.80}.")


def _b64(data: bytes) -> str:
    return b64encode(data).decode()


def _tagged(data: bytes) -> str:
    """base64 of ``data``, then a separator and a random tag: the value of a conditional
    write, unique to it, so that a write whose answer was lost is never taken for
    another's of the same bytes (or the reverse). PyTorch's non-strict ``b64decode``
    skips the tag's characters; :meth:`EtcdStore._decode` drops them."""
    tag = "".join(secrets.choice(_TAG_ALPHABET) for _ in range(_TAG_LENGTH))
    return f"{_b64(data)}{_TAG_SEPARATOR}{tag}"


def _encode(data: object, param: str) -> str:
    """base64 of ``data`` (``str`` as UTF-8), exactly as PyTorch's ``EtcdStore`` writes it."""
    return _b64(_as_bytes(data, param))


def _count_values(node: Node) -> int:
    return sum(_count_values(child) if child.is_dir else 1 for child in node.children)


def _preview(value: str | bytes) -> str:
    text = repr(value)
    return text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."


def _list_keys(keys: Iterable[KeyLike]) -> str:
    names = [repr(key) for key in keys]
    shown = ", ".join(names[:_LISTED_KEYS])
    more = len(names) - _LISTED_KEYS
    return f"{shown} and {more} more" if more > 0 else shown


if TYPE_CHECKING:

    def _satisfies_store_protocol(store: EtcdStore) -> Store:
        return store
