"""What the legacy ``etcd`` backend's rendezvous holds besides its barrier.

:class:`EtcdRendezvousBase` is the base of
:class:`~etcd_rendezvous.etcd_rendezvous.EtcdRendezvous`, which adds the barrier (the
state machine of :mod:`etcd_rendezvous.etcd_rendezvous`). The base owns what the
barrier runs on, and what a worker does with the run outside the barrier:

* set-up and tear-down: the arguments' checks, the etcd connection (and whether
  :meth:`~EtcdRendezvousBase.close` releases it), the run's directories and version
  counter, the keep-alive threads (:mod:`etcd_rendezvous._legacy.lease_keeper`);
* the time bounds: the rendezvous deadline, the retries after a lost race, the timeout
  messages;
* reading the state (validated by :mod:`etcd_rendezvous._legacy.state`), and closing
  the run (``set_closed``);
* the data kept beside the state: a version's ``extra_data`` and its key-value store.

Events are recorded through ``_record``, which ``EtcdRendezvous`` defines: an event is
named after the file that records it (see :mod:`etcd_rendezvous.events`), and these
methods' events keep the names ``etcd_rendezvous.py:EtcdRendezvous.<method>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import weakref
from typing import Any

from .._transport.interface import WRITE_ACTIONS, Transport
from .._transport.retry import CONTENTION, Deadline, Retry
from .._transport.v2 import (
    CompareFailedError,
    EtcdConnection,
    KeyExistsError,
    KeyNotFoundError,
    Node,
)
from ..api import RendezvousConnectionError, RendezvousStateError, RendezvousTimeoutError
from ..etcd_store import EtcdStore
from ..events import NodeState, _records_failure
from ..layout import LegacyLayout
from .admission import CONST_WORKER_KEEPALIVE_TTL, BatchJoin, StateFeed
from .lease_keeper import LeaseKeeper, stop_keepers
from .state import parse_state, preview

__all__ = ["CONST_RUNID_SUBROOT_TTL", "EtcdRendezvousBase"]

logger = logging.getLogger(__name__)

#: TTL of the run directory, which only serves to clean up after old runs (PyTorch's
#: name and value, importable from :mod:`etcd_rendezvous.etcd_rendezvous` as there).
CONST_RUNID_SUBROOT_TTL = 7200


def _check_arguments(
    prefix: object,
    run_id: object,
    num_min_workers: int,
    num_max_workers: int,
    timeout: float,
    last_call_timeout: float,
) -> None:
    """Raise naming the first invalid argument of :class:`EtcdRendezvous`."""
    if not isinstance(run_id, str) or not run_id or "/" in run_id:
        raise ValueError(f"run_id: must be a non-empty string without '/', got {run_id!r}.")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: must be a string, got {prefix!r}.")
    if num_min_workers < 1:
        raise ValueError(f"num_min_workers: must be at least 1, got {num_min_workers}.")
    if num_max_workers < num_min_workers:
        raise ValueError(
            f"num_max_workers: must be at least num_min_workers ({num_min_workers}), "
            f"got {num_max_workers}."
        )
    if timeout <= 0:
        raise ValueError(f"timeout: must be positive, got {timeout}.")
    if last_call_timeout < 0:
        raise ValueError(f"last_call_timeout: must not be negative, got {last_call_timeout}.")


class EtcdRendezvousBase:
    """The part of :class:`~etcd_rendezvous.etcd_rendezvous.EtcdRendezvous` around its
    barrier: its constructor (the arguments are documented there), its resources and the
    run's keys. Not used on its own: ``EtcdRendezvous`` adds the barrier and ``_record``.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        run_id: str,
        num_min_workers: int,
        num_max_workers: int,
        timeout: float,
        last_call_timeout: float,
        *,
        owns_connection: bool = False,
    ) -> None:
        self.client = client
        self._conn = EtcdConnection.from_client(client, param="client")
        self._owns_conn = owns_connection or self._conn is not client
        self._close_lock = threading.Lock()
        self._closed = False
        self._keepers: list[LeaseKeeper] = []
        self._lease_this_rank: LeaseKeeper | None = None
        self._last_state: dict[str, Any] | None = None
        #: The final version we announced ourselves waiting on, and our wait key's name:
        #: an attempt repeated after an etcd failure reuses it, and is counted once.
        self._waiting_as: tuple[str, str] | None = None
        self._finalizer = weakref.finalize(self, stop_keepers, self._keepers)
        try:
            _check_arguments(
                prefix, run_id, num_min_workers, num_max_workers, timeout, last_call_timeout
            )
            self._layout = LegacyLayout(prefix, run_id)
            self._prefix = self._layout.prefix_dir  # PyTorch's attribute
            self._run_id = run_id
            self._num_min_workers = num_min_workers
            self._num_max_workers = num_max_workers
            self._timeout = float(timeout)
            self._last_call_timeout = float(last_call_timeout)
            self._rendezvous_deadline = Deadline(self._timeout)
            self._feed = StateFeed(self._conn, self._layout.state_key, parse_state)
            self._join = BatchJoin(
                self._conn,
                self._layout,
                self._feed,
                min_workers=num_min_workers,
                max_workers=num_max_workers,
                keep_alive=self._keep_member_alive,
                timeout_error=lambda: RendezvousTimeoutError(self._timeout_message()),
            )
            logger.info("etcd endpoints: %s", ", ".join(self._conn.endpoints))
            with self._conn.bounded_by(self._rendezvous_deadline):
                self._create_run_keys()
        except BaseException:
            self.close()
            raise

    # -- set-up and tear-down ---------------------------------------------------------

    def _create_run_keys(self) -> None:
        """Create the run's directories and version counter, if missing.

        Only keys of the run are written: not the prefix's own directory, which v2
        creates with the run's and v3 does not need, so that a user whose role covers
        the run's keys alone can run the job.
        """
        layout = self._layout
        self._setup_run_dir()
        self.create_path_if_not_exists(layout.rdzv_dir)
        # PyTorch's "0" has no room for a tag, and needs none: whoever created it, the
        # counter exists (a create whose answer was lost is recognised by its value).
        with contextlib.suppress(KeyExistsError):
            self._conn.create(layout.counter_key, "0")

    def _setup_run_dir(self) -> None:
        # Spelled with a trailing "/", as PyTorch's get_path("") spells it.
        run_dir = self._layout.path("")
        if self._conn.can_refresh_directory_ttl():
            self.create_path_if_not_exists(run_dir, ttl=CONST_RUNID_SUBROOT_TTL)
            self.setup_lease_renewal(run_dir, ttl=CONST_RUNID_SUBROOT_TTL)
            return
        # etcd >= 3.5 cannot refresh a directory's TTL: a TTL would delete the whole run
        # (state and store) after two hours, whatever the workers do.
        if self._conn.mkdir(run_dir):
            logger.info(
                "etcd %s cannot refresh directory TTLs; created %s without a TTL "
                "(delete it once the job is over)",
                self._conn.server_version(),
                run_dir,
            )
            return
        existing = self._conn.get(run_dir)
        if existing.ttl is not None:
            logger.warning(
                "The run directory %s was created with a TTL (by a PyTorch worker?) and "
                "this etcd (%s) cannot refresh it: the run's rendezvous state and store "
                "will be deleted in %d s, when the TTL expires",
                run_dir,
                self._conn.server_version(),
                existing.ttl,
            )

    def setup_lease_renewal(self, full_path: str, ttl: int) -> threading.Event:
        """Keep ``full_path`` alive by refreshing its TTL in a daemon thread.

        Returns:
            An event that stops the refreshing when set.
        """
        keeper = LeaseKeeper(self._conn, full_path, ttl)
        self._keepers.append(keeper)
        return keeper.stop_event

    def _keep_member_alive(self, key: str, lease: int = 0) -> LeaseKeeper:
        """Keep our member key alive: it is this worker's keep-alive key of the version,
        written by us alone (``lease``: its v3 lease)."""
        self._keepers[:] = [k for k in self._keepers if not k.stop_event.is_set()]
        keeper = LeaseKeeper(self._conn, key, CONST_WORKER_KEEPALIVE_TTL, lease=lease)
        self._keepers.append(keeper)
        self._lease_this_rank = keeper
        return keeper

    def stop_lease_renewals(self) -> None:
        """Stop every keep-alive thread of this rendezvous and wait briefly for them."""
        for keeper in self._keepers:
            keeper.stop()
        self._keepers.clear()
        self._lease_this_rank = None

    def close(self) -> None:
        """Stop the keep-alive threads and release the etcd connection if the rendezvous
        owns it (see ``owns_connection``). The rendezvous stays open for the other
        workers. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.stop_lease_renewals()
        if self._owns_conn:
            self._conn.close()

    @property
    def connection(self) -> Transport:
        """The etcd connection this rendezvous uses."""
        return self._conn

    def _record(self, message: str, node_state: NodeState, *, method: str) -> None:
        """Record a rendezvous event named after ``method``.

        :class:`~etcd_rendezvous.etcd_rendezvous.EtcdRendezvous` defines it, in
        ``etcd_rendezvous.py``: an event is named after the file that records it (see
        :mod:`etcd_rendezvous.events`), so the events of the methods here are named
        ``etcd_rendezvous.py:EtcdRendezvous.<method>`` as well.
        """
        raise NotImplementedError

    # -- time bounds ------------------------------------------------------------------

    def _timeout_message(self, last_error: Exception | None = None) -> str:
        message = (
            f"The rendezvous of run {self._run_id!r} did not complete within "
            f"{self._timeout:g} s (min_workers={self._num_min_workers}, "
            f"max_workers={self._num_max_workers}); last state seen: "
            f"{self._feed.last_state or self._last_state}."
        )
        if isinstance(last_error, RendezvousConnectionError):
            message += f" Last error: {last_error}"
        return message

    def _check_deadline(self) -> None:
        if self._rendezvous_deadline.expired():
            raise RendezvousTimeoutError(self._timeout_message())

    def _contention_retry(self) -> Retry:
        """A retry after a lost compare-and-swap, until the rendezvous deadline."""
        return CONTENTION.start(
            self._rendezvous_deadline, lambda: RendezvousTimeoutError(self._timeout_message())
        )

    def _race_retry(self, key: str, what: str, timeout: float | None) -> Retry:
        """A retry after a lost race on ``key``, outside the barrier: for ``timeout``
        seconds (the rendezvous timeout if ``None``)."""
        seconds = self._timeout if timeout is None else timeout
        return CONTENTION.start(
            seconds,
            lambda: RendezvousTimeoutError(
                f"Could not {what} within {seconds:g} s: other workers kept changing "
                f"etcd key {key!r} first."
            ),
        )

    def bounded(self) -> contextlib.AbstractContextManager[None]:
        """A block in which every etcd request ends within the rendezvous ``timeout``
        from now (see :meth:`~etcd_rendezvous._transport.interface.Transport.bounded_by`)."""
        return self._conn.bounded_by(Deadline(self._timeout))

    # -- the state --------------------------------------------------------------------

    def get_rdzv_state(self) -> tuple[Node, dict[str, Any]]:
        """Read and validate the current state.

        Raises:
            KeyNotFoundError: there is no rendezvous state.
            RendezvousStateError: the state is corrupt.
        """
        active_version = self._conn.get(self._layout.state_key)
        state = parse_state(active_version)
        self._last_state = state
        return active_version, state

    def try_wait_for_state_change(
        self, etcd_index: int, timeout: float | None = None
    ) -> tuple[Node, dict[str, Any]]:
        """Wait for the state to change at or after ``etcd_index``, then read it.

        Waits at most ``timeout`` seconds, and never much past the rendezvous deadline.

        Raises:
            RendezvousTimeoutError: the rendezvous deadline passed.
        """
        overall = self._rendezvous_deadline.remaining() + 1.0
        wait = overall if timeout is None else min(timeout, overall)
        change = self._conn.watch(self._layout.state_key, etcd_index, wait)
        self._check_deadline()
        if change is not None and change.value is not None and change.action in WRITE_ACTIONS:
            # The event carries the new state: no need to read it again. Callers watch
            # on from the event's own index, so no later change is missed.
            node = dataclasses.replace(change, etcd_index=change.modified_index)
            state = parse_state(node)
            self._last_state = state
            return node, state
        return self.get_rdzv_state()

    # -- closing the run --------------------------------------------------------------

    @_records_failure
    def set_closed(self, timeout: float | None = None) -> None:
        """Mark the rendezvous of this run closed; workers then stop re-rendezvousing.

        Args:
            timeout: seconds to go on retrying when other workers keep changing the
                state first; the rendezvous ``timeout`` if ``None``.

        Raises:
            RendezvousTimeoutError: the state could not be written within ``timeout``.
            RendezvousConnectionError: etcd was unreachable until ``timeout``.
        """
        seconds = self._timeout if timeout is None else timeout
        with self._conn.bounded_by(Deadline(seconds)):
            self._close_state(seconds)

    def _close_state(self, timeout: float) -> None:
        """The compare-and-swap loop of :meth:`set_closed`."""
        key = self._layout.state_key
        retry = self._race_retry(key, f"close the rendezvous of run {self._run_id!r}", timeout)
        while True:
            try:
                active_version, state = self.get_rdzv_state()
            except KeyNotFoundError:
                try:
                    # No tag needed: a closed state means the same whoever wrote it.
                    self._conn.create(key, json.dumps({"status": "closed"}))
                    self._record_closed()
                    return
                except KeyExistsError:
                    retry.wait()
                    continue
            if state["status"] == "closed":
                return
            state["status"] = "closed"
            try:
                self._conn.compare_and_swap(key, json.dumps(state), active_version)
                self._record_closed()
                return
            except (CompareFailedError, KeyNotFoundError):
                logger.debug("Set closed CAS unsuccessful, retrying")
                retry.wait()

    def _record_closed(self) -> None:
        self._record(
            f"The worker closed the rendezvous of run '{self._run_id}'.",
            node_state=NodeState.SUCCEEDED,
            method="set_closed",
        )

    # -- the run's keys and data ------------------------------------------------------

    @property
    def layout(self) -> LegacyLayout:
        """The keys of this run (see :class:`~etcd_rendezvous.layout.LegacyLayout`)."""
        return self._layout

    def get_path(self, path: str) -> str:
        """Return the etcd key of ``path`` inside this run's directory (as PyTorch's
        method of the same name: :meth:`~etcd_rendezvous.layout.LegacyLayout.path`)."""
        return self._layout.path(path)

    def create_path_if_not_exists(self, full_path: str, ttl: int | None = None) -> None:
        """Create directory ``full_path`` (with ``ttl``) unless it exists."""
        self._conn.mkdir(full_path, ttl=ttl)

    def store_extra_data(
        self, rdzv_version: str, key: str, value: Any, timeout: float | None = None
    ) -> None:
        """Store ``key: value`` (JSON-serialisable) in the version's ``extra_data`` key.

        Args:
            timeout: seconds to go on retrying when other workers keep changing the
                key first; the rendezvous ``timeout`` if ``None``.

        Raises:
            RendezvousTimeoutError: the key could not be written within ``timeout``.
        """
        node = self._layout.extra_data_key(rdzv_version)
        encoded = json.dumps({key: value})
        try:
            # No tag needed: a value holding our key and value is what we want stored.
            self._conn.create(node, encoded)
            return
        except KeyExistsError:
            pass
        retry = self._race_retry(node, f"store {key!r}", timeout)
        while True:
            extra_data = self._conn.get(node)
            data = self._decode_extra_data(extra_data)
            data[key] = value
            try:
                self._conn.compare_and_swap(node, json.dumps(data), extra_data)
                return
            except CompareFailedError:
                logger.debug("Store extra_data CAS unsuccessful, retrying")
                retry.wait()

    def load_extra_data(self, rdzv_version: str, key: str, timeout: float | None = None) -> Any:
        """Return ``key`` from the version's ``extra_data``, waiting until it is stored.

        Raises:
            RendezvousTimeoutError: ``key`` was not stored within ``timeout`` seconds.
        """
        node = self._layout.extra_data_key(rdzv_version)
        deadline = Deadline.never() if timeout is None else Deadline(timeout)
        while True:
            try:
                extra_data = self._conn.get(node)
            except KeyNotFoundError as exc:
                index = (exc.etcd_index or self._conn.last_index) + 1
            else:
                data = self._decode_extra_data(extra_data)
                if key in data:
                    return data[key]
                index = extra_data.etcd_index + 1
            if deadline.expired():
                raise RendezvousTimeoutError(
                    f"Key {key!r} was not stored in {node!r} within {timeout} s."
                )
            self._conn.watch(node, index, min(deadline.remaining(), 60.0))

    @staticmethod
    def _decode_extra_data(node: Node) -> dict[str, Any]:
        try:
            data = json.loads(node.value or "")
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise RendezvousStateError(
                f"etcd key {node.key!r} should hold a JSON object, but holds "
                f"{preview(node.value)}. The key was left untouched."
            )
        return data

    def setup_kv_store(self, rdzv_version: str, *, create_dir: bool = True) -> EtcdStore:
        """Return the key-value store of rendezvous version ``rdzv_version``.

        Args:
            create_dir: whether to create the store's directory if missing, as PyTorch's
                workers do. The store works without it (etcd creates the directories
                of a key written below them), and the worker that creates a version
                creates it, so our workers skip that write.
        """
        store_path = self._layout.store_dir(rdzv_version)
        if create_dir:
            self.create_path_if_not_exists(store_path)
        return EtcdStore(etcd_client=self._conn, etcd_store_prefix=store_path)
