"""The legacy ``etcd`` backend's rendezvous: one worker's side of PyTorch's state machine.

:class:`EtcdRendezvous` runs the barrier (``setup -> joinable -> frozen -> final``, and
``closed``) over the run's state key, on the run's keys and keep-alive threads, and
keeps the data beside the state (``extra_data``, the version's store). It is
documented and pickled as :mod:`etcd_rendezvous.etcd_rendezvous`'s, which PyTorch's
users import. The protocol: docs/how-it-works.rst, sections "The state machine" and
"What differs from PyTorch's engine".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
import weakref
from typing import Any

from .._progress_log import ProgressLog, progress_interval, seconds_left
from .._transport.connect import as_transport
from .._transport.interface import (
    WRITE_ACTIONS,
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    Transport,
)
from .._transport.retry import CONNECTION, CONTENTION, Retry
from ..api import (
    Deadline,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from ..etcd_store import EtcdStore
from ..events import EventSource, NodeState, _records_failure
from ..layout import LegacyLayout, new_waiter_name, normalize_key
from ..metrics import MetricKind, record_metric, timed
from .admission import create_spread
from .feed import SILENCE, StateFeed
from .join import BatchJoin, RestartAttempt
from .lease_keeper import LeaseKeeper, stop_keepers
from .state import (
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
    CONST_ETCD_SETUP_TTL,
    CONST_WORKER_KEEPALIVE_TTL,
    LOGGER_NAME,
    confirmed_keys,
    parse_state,
    preview,
    read_state,
    torch_waiting,
)
from .waiting import WAITER_TTL, await_end_of_final

__all__ = [
    "CONST_RUNID_SUBROOT_TTL",
    "EtcdRendezvous",
    "EtcdRendezvousRetryImmediately",
    "EtcdRendezvousRetryableFailure",
    "progress_line",
]

logger = logging.getLogger(LOGGER_NAME)

#: The least last call, in seconds, of a version that follows one on which PyTorch's
#: workers waited: they pause a second after an attempt fails, the end of the version
#: they waited on included (``time.sleep(1)`` in PyTorch's ``rendezvous_barrier``),
#: then may wait for the new version to become joinable and pause again when their join
#: races a change: a shorter last call can close every next version before they join.
TORCH_LAST_CALL = 3.0

#: The module users import these classes from, and whose name they are documented and
#: pickled under.
_PUBLIC_MODULE = "etcd_rendezvous.etcd_rendezvous"

#: TTL of the run directory, which only serves to clean up after old runs (PyTorch's
#: name and value).
CONST_RUNID_SUBROOT_TTL = 7200

#: This backend's events are named as PyTorch names its own (file, class, method):
#: ``etcd_rendezvous.py:EtcdRendezvous.<method>``, wherever the code lives.
_EVENT_FILE = "etcd_rendezvous.py"
_EVENT_CLASS = "EtcdRendezvous"


class EtcdRendezvousRetryableFailure(Exception):  # noqa: N818 (PyTorch's name)
    """We were too late for a state transition and must start again, after a short delay."""

    __module__ = _PUBLIC_MODULE


class EtcdRendezvousRetryImmediately(Exception):  # noqa: N818 (PyTorch's name)
    """The state we observed allows starting again at once, without a delay."""

    __module__ = _PUBLIC_MODULE


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


class EtcdRendezvous:
    """A rendezvous that uses `etcd <https://etcd.io/>`__ (v2 API) as the backend store.

    Args:
        client: an :class:`~etcd_rendezvous._transport.v2.EtcdConnection`, or a python-etcd
            ``etcd.Client`` (its endpoints and credentials are used to open a hardened
            connection; the client itself is kept as :attr:`client` but not used).
        prefix: etcd key prefix under which the run's keys live.
        run_id: identifies the job; workers with the same ``run_id`` meet.
        num_min_workers: the rendezvous completes once this many workers joined (and
            the last call ended).
        num_max_workers: at most this many workers are admitted.
        timeout: seconds :meth:`rendezvous_barrier` may take.
        last_call_timeout: seconds to wait for more workers once ``num_min_workers``
            joined.
        owns_connection: whether :meth:`close` closes ``client`` when it is an
            :class:`~etcd_rendezvous._transport.v2.EtcdConnection` (set by whoever opened it
            and hands it over, as :func:`create_rdzv_handler` does). A connection the
            rendezvous converted from an ``etcd.Client`` is always its own. An owned
            connection is also closed if the constructor raises.
        deadline: when the constructor's own requests (creating the run's keys, if
            missing) give up; ``timeout`` from now if not given. Not in PyTorch's class.

    The rendezvous is a context manager: leaving the block calls :meth:`close`.

    Raises:
        ValueError: a parameter is invalid (the message names it).
        RendezvousConnectionError: etcd cannot be reached.
        RendezvousStateError: on the v2 API, the prefix exists in etcd as a value, not a
            directory.
    """

    __module__ = _PUBLIC_MODULE

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
        deadline: Deadline | None = None,
    ) -> None:
        self.client = client
        self._conn = as_transport(client, param="client")
        self._owns_conn = owns_connection or self._conn is not client
        self._close_lock = threading.Lock()
        self._closed = False
        self._keepers: list[LeaseKeeper] = []
        self._lease_this_rank: LeaseKeeper | None = None
        self._last_state: dict[str, Any] | None = None
        #: The final version we announced ourselves waiting on, and our wait key's name:
        #: an attempt repeated after an etcd failure reuses it, and is counted once.
        self._waiting_as: tuple[str, str] | None = None
        #: Whether PyTorch's workers waited on the final version this barrier waited on
        #: (then its next version's last call lasts TORCH_LAST_CALL at least).
        self._torch_waited = False
        self._finalizer = weakref.finalize(self, stop_keepers, self._keepers)
        try:
            _check_arguments(
                prefix, run_id, num_min_workers, num_max_workers, timeout, last_call_timeout
            )
            self._layout = LegacyLayout(prefix, run_id)
            self._prefix = self._layout.prefix_dir  # PyTorch's attribute
            self._run_id = run_id
            self._events = EventSource(_EVENT_FILE, _EVENT_CLASS, run_id)
            self._num_min_workers = num_min_workers
            self._num_max_workers = num_max_workers
            self._timeout = float(timeout)
            self._last_call_timeout = float(last_call_timeout)
            self._rendezvous_deadline = deadline or Deadline(self._timeout)
            self._feed = StateFeed(self._conn, self._layout.state_key, parse_state)
            # num_workers_waiting()'s own: a stream on the state, kept open between calls
            # while no rendezvous is in progress.
            self._waiting_feed = StateFeed(self._conn, self._layout.state_key, parse_state)
            self._waiting_lock = threading.Lock()
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
            self._create_run_keys(self._rendezvous_deadline)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EtcdRendezvous:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- set-up and tear-down ---------------------------------------------------------

    def _create_run_keys(self, deadline: Deadline) -> None:
        """Create the run's directories and version counter, if missing, by ``deadline``.

        Only keys of the run are written: not the prefix's own directory, which v2
        creates with the run's and v3 does not need, so that a user whose role covers
        the run's keys alone can run the job.
        """
        layout = self._layout
        self._setup_run_dir(deadline)
        self.create_path_if_not_exists(layout.rdzv_dir, deadline=deadline)
        # PyTorch's "0" has no room for a tag, and needs none: whoever created it, the
        # counter exists (a create whose answer was lost is recognised by its value).
        with contextlib.suppress(KeyExistsError):
            self._conn.create(layout.counter_key, "0", deadline=deadline)

    def _setup_run_dir(self, deadline: Deadline) -> None:
        # Spelled with a trailing "/", as PyTorch's get_path("") spells it.
        run_dir = self._layout.path("")
        conn = self._conn
        if conn.can_refresh_directory_ttl(deadline=deadline):
            self.create_path_if_not_exists(run_dir, ttl=CONST_RUNID_SUBROOT_TTL, deadline=deadline)
            self.setup_lease_renewal(run_dir, ttl=CONST_RUNID_SUBROOT_TTL)
            return
        # etcd >= 3.5 cannot refresh a directory's TTL: a TTL would delete the whole run
        # (state and store) after two hours, whatever the workers do.
        if conn.mkdir(run_dir, deadline=deadline):
            logger.info(
                "etcd %s cannot refresh directory TTLs; created %s without a TTL "
                "(delete it once the job is over)",
                conn.server_version(deadline=deadline),
                run_dir,
            )
            return
        existing = conn.get(run_dir, deadline=deadline)
        if existing.ttl is not None:
            logger.warning(
                "The run directory %s was created with a TTL (by a PyTorch worker?) and "
                "this etcd (%s) cannot refresh it: the run's rendezvous state and store "
                "will be deleted in %d s, when the TTL expires",
                run_dir,
                conn.server_version(deadline=deadline),
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

    def withdraw(self, deadline: Deadline) -> None:
        """Stop the keep-alive threads and delete this worker's member key (by
        ``deadline``; one that cannot be deleted lapses by its TTL). Only for a
        rendezvous this worker has just closed: once the run is closed, every other
        worker leaves it, and none reads that key again (a worker waiting on a version
        ends with the closed state, not with a member key gone). The run directory,
        which a keep-alive thread refreshes too, is the run's: it stays."""
        member = self._lease_this_rank
        self.stop_lease_renewals()
        if member is None:
            return
        try:
            self._conn.delete(member.key, deadline=deadline)
        except RendezvousError as exc:
            logger.info("Could not delete our member key %s (it lapses): %s", member.key, exc)

    def stop_threads(self) -> None:
        """Stop every thread of this rendezvous: the keep-alive threads (waited for
        briefly) and the watch stream that :meth:`num_workers_waiting` keeps open (its
        reader ends once its socket is shut down). A later :meth:`num_workers_waiting`
        opens the stream again."""
        self.stop_lease_renewals()
        waiting_feed = getattr(self, "_waiting_feed", None)  # (absent if __init__ raised)
        if waiting_feed is not None:
            with self._waiting_lock:
                waiting_feed.close()

    def close(self) -> None:
        """Stop the threads (:meth:`stop_threads`) and release the etcd connection if
        the rendezvous owns it (see ``owns_connection``). The rendezvous stays open for
        the other workers. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.stop_threads()
        if self._owns_conn:
            self._conn.close()

    @property
    def connection(self) -> Transport:
        """The etcd connection this rendezvous uses."""
        return self._conn

    @property
    def deadline(self) -> Deadline:
        """The deadline of the current (or last) :meth:`rendezvous_barrier`."""
        return self._rendezvous_deadline

    def _record(
        self,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        *,
        method: str,
        rank: int | None = None,
    ) -> None:
        """Record a phase change of ``method`` as the rendezvous event
        ``etcd_rendezvous.py:EtcdRendezvous.<method>`` (see :mod:`etcd_rendezvous.events`)."""
        self._events.record(method, message, node_state, rank=rank)

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

    # -- the barrier ------------------------------------------------------------------

    @_records_failure
    def rendezvous_barrier(self) -> tuple[str, int, int]:
        """Join the next rendezvous; block until it completes.

        Returns:
            ``(rdzv_version, rank, world_size)``.

        Every etcd request runs under the rendezvous deadline: etcd failures (an
        election, an unreachable member) are retried until then, and the call returns
        or raises within about a second of ``timeout`` however etcd fails.

        Raises:
            RendezvousTimeoutError: the rendezvous did not complete within ``timeout``
                (the message gives the last etcd error, if etcd was the cause).
            RendezvousClosedError: the rendezvous is or was closed while waiting.
            RendezvousStateError: the state in etcd is corrupt.
            RequestTooLargeError: etcd refused a write of the state as larger than its
                ``--max-request-bytes``: ours, or one we waited for (see
                the documentation, "etcd's limits").
            RendezvousError: other non-retryable errors.
        """
        self._rendezvous_deadline = Deadline(self._timeout)
        self._torch_waited = False
        self._record(
            f"The worker attempts to join the next rendezvous of run '{self._run_id}'.",
            method="rendezvous_barrier",
        )
        with self._waiting_lock:
            # While the barrier runs, every state write of its admissions would reach
            # num_workers_waiting()'s stream: it is opened again by the next call.
            self._waiting_feed.close()
        if self._lease_this_rank is not None:
            # Disown our keep-alive in the previous rendezvous: it lapses, telling the
            # workers waiting on that version that we left it.
            self._lease_this_rank.stop()
            self._lease_this_rank = None
        self._join.begin(self._rendezvous_deadline)
        progress = ProgressLog(
            self._describe_progress,
            progress_interval(self._timeout),
            run_id=self._run_id,
            log=logger,
        )
        with progress:
            try:
                with timed("rendezvous.time_to_form", backend="etcd"):
                    version, rank, world_size = self._barrier()
                record_metric("rendezvous.rounds", backend="etcd")
                record_metric("rendezvous.world_size", world_size, MetricKind.GAUGE, backend="etcd")
                return version, rank, world_size
            except BaseException:
                self._join.discard()
                raise
            finally:
                self._feed.close()

    def _describe_progress(self) -> str | None:
        """The progress line of a waiting :meth:`rendezvous_barrier`, from the state last
        read (see :mod:`etcd_rendezvous._progress_log`)."""
        return progress_line(
            self._feed.last_state,
            self._join.member_key,
            self._run_id,
            (self._num_min_workers, self._num_max_workers),
            self._rendezvous_deadline.remaining(),
        )

    def _barrier(self) -> tuple[str, int, int]:
        """The loop of :meth:`rendezvous_barrier`: attempts until one succeeds."""
        last_error: Exception | None = None
        retry = CONNECTION.start(
            self._rendezvous_deadline,
            lambda: RendezvousTimeoutError(self._timeout_message(last_error)),
        )
        while True:
            retry.check()
            logger.info("Attempting to join next rendezvous")
            # An attempt decides on the state itself and waits on its changes: the hint
            # key of a version the last attempt left is written no more (a frozen state
            # that lapses, say, tells nothing there), and the state it last showed may
            # be long gone.
            self._feed.follow_state()
            try:
                return self.init_phase()
            except (EtcdRendezvousRetryImmediately, RestartAttempt) as exc:
                logger.debug("Rendezvous attempt starts over: %r", exc)
            except (EtcdRendezvousRetryableFailure, CompareFailedError, KeyNotFoundError) as exc:
                logger.debug("Rendezvous attempt must be retried: %r", exc)
                last_error = exc
                retry.wait()
            except RendezvousConnectionError as exc:
                logger.warning("Rendezvous attempt failed, will retry: %s", exc)
                last_error = exc
                retry.wait()
            except RendezvousTimeoutError:
                logger.info("Rendezvous timeout occurred in EtcdRendezvousHandler")
                raise
            except RendezvousClosedError:
                logger.info("Rendezvous for run_id=%s was observed to be closed", self._run_id)
                raise

    def init_phase(self) -> tuple[str, int, int]:
        """Create a new rendezvous state, or join/observe the existing one.

        Returns:
            ``(rdzv_version, rank, world_size)``.

        Raises:
            RendezvousClosedError: the rendezvous is closed.
            EtcdRendezvousRetryImmediately: the state changed in a way that calls for a
                new attempt.
        """
        observed = self._feed.current(self._rendezvous_deadline)
        if observed.state is None:
            created = self._create_or_follow()
            if created is None:
                raise EtcdRendezvousRetryImmediately("The rendezvous state was created.")
            return self.join_phase(created)
        state = observed.state
        logger.info("Observed existing rendezvous state: %s", state)
        if state["status"] == "closed":
            raise RendezvousClosedError(f"The rendezvous of run {self._run_id!r} is closed.")
        if state["status"] == "joinable":
            return self.join_phase(state["version"])
        if state["status"] == "final":
            try:
                self.handle_existing_rendezvous(state["version"])
            finally:
                # It read the state itself: the next attempt starts from a fresh read.
                self._feed.invalidate()
            raise EtcdRendezvousRetryImmediately
        # setup, or frozen without us: wait until that changes.
        self._await_change()
        raise EtcdRendezvousRetryImmediately

    def _create_or_follow(self) -> str | None:
        """There is no state: create it, unless another worker does so first.

        Of many workers finding no state at once, about one should try to create it (a
        failed try is a wasted write, two on v3): each watches the state for a random
        moment first (:func:`~etcd_rendezvous._legacy.admission.create_spread`).

        Returns:
            The version we created (we are admitted to it), or ``None`` if another
            worker created the state.
        """
        spread = create_spread(self._num_max_workers, self._feed.read_seconds)
        if self._feed.wait(spread, self._rendezvous_deadline):
            return None
        try:
            active_version = self.try_create_rendezvous()
        except KeyExistsError:
            self._await_change()
            return None
        state = self._feed.note(active_version, self._rendezvous_deadline).state or {}
        logger.info("New rendezvous state created: %s", state)
        self._join.publish(str(state["version"]), active_version, state)
        return str(state["version"])

    def _await_change(self) -> None:
        """Wait for the state to change, until the rendezvous deadline."""
        self._feed.wait(self._rendezvous_deadline.remaining(), self._rendezvous_deadline)
        self._check_deadline()

    def join_phase(self, expected_version: str) -> tuple[str, int, int]:
        """Join the joinable rendezvous ``expected_version`` and wait for the others.

        We announce ourselves with a member key and are admitted with others in one
        write (see :doc:`how-it-works`, "Joining in a few requests").
        """
        this_rank = self._join.admit(expected_version)
        logger.info("Joined rendezvous version %s as rank %s", expected_version, this_rank)
        self._record(
            f"The worker joined version {expected_version} of the rendezvous of run "
            f"'{self._run_id}' as rank {this_rank}.",
            method="join_phase",
            rank=this_rank,
        )
        # The worker ranked num_min_workers - 1 waits out the last call, then freezes
        # the rendezvous. Should it die meanwhile, the state (now with a TTL) expires
        # and everyone starts over.
        if (
            this_rank == self._num_min_workers - 1
            and self._feed.current(self._rendezvous_deadline).status_in(expected_version)
            == "joinable"
        ):
            # It keeps the state alive and freezes it: it follows the state itself.
            self._feed.follow_state()
            logger.info("Rank %s is responsible for join last call.", this_rank)
            last_call = self._last_call_timeout
            if self._torch_waited:
                last_call = max(last_call, TORCH_LAST_CALL)
            self.handle_join_last_call(expected_version, Deadline(last_call))
            logger.info("Rank %s finished join last call.", this_rank)
        return self.confirm_phase(expected_version, this_rank)

    def confirm_phase(self, expected_version: str, this_rank: int) -> tuple[str, int, int]:
        """Wait until every member of ``expected_version`` confirmed (our members are
        confirmed together; see :doc:`how-it-works`, "Joining in a few requests")."""
        logger.info("Waiting for confirmations from all peers.")
        world_size = self._join.confirm(expected_version, this_rank)
        logger.info(
            "Rendezvous version %s is complete. Final state: %s",
            expected_version,
            self._feed.last_state,
        )
        self._record(
            f"Version {expected_version} of the rendezvous of run '{self._run_id}' is "
            f"complete: the worker is rank {this_rank} in a world of size {world_size}.",
            node_state=NodeState.SUCCEEDED,
            method="confirm_phase",
            rank=this_rank,
        )
        return expected_version, this_rank, world_size

    def handle_existing_rendezvous(self, expected_version: str) -> None:
        """Announce ourselves as waiting on a final rendezvous, then wait for it to end.

        We announce ourselves with a wait key, and are counted in
        ``num_workers_waiting`` with the others that did (one write for many; see
        :doc:`how-it-works`, "Waiting in a few requests"), where PyTorch's workers each
        increment it (:meth:`announce_self_waiting`).
        """
        if self._waiting_as is None or self._waiting_as[0] != expected_version:
            self._waiting_as = (expected_version, new_waiter_name(secrets.randbits(64)))
        waiter = self._waiting_as[1]
        key = self._layout.waiter_key(expected_version, waiter)
        written = self._conn.set(key, None, ttl=WAITER_TTL, deadline=self._rendezvous_deadline)
        logger.info("Waiting on rendezvous version %s as %s", expected_version, key)
        self._record(
            f"The worker waits for the next rendezvous of run '{self._run_id}': version "
            f"{expected_version} is complete.",
            method="handle_existing_rendezvous",
        )
        final = self._await_free(expected_version, (waiter, written.created_index))
        logger.info("Previously existing rendezvous state changed. Will re-try joining.")
        # PyTorch's workers waited too: they come back a second or two after the version
        # ended, and the next version's last call, should we make it, waits for them.
        self._torch_waited = final is not None and torch_waiting(final) > 0

    def try_create_rendezvous(self) -> Node:
        """Create a new joinable rendezvous version, with us admitted to it.

        Raises:
            KeyExistsError: a rendezvous state already exists.
            EtcdRendezvousRetryableFailure: another worker took over the setup.
            RendezvousStateError: the version counter is missing, corrupt or went
                backwards.
        """
        # The state is ephemeral until joinable, in case we die half-way through.
        # Its "tag" (which PyTorch's workers ignore) makes the state ours alone: a create
        # whose answer was lost recognises itself, never another worker's setup.
        deadline = self._rendezvous_deadline
        setup = {"status": "setup", "tag": secrets.token_hex(8)}
        active_version = self._conn.create(
            self._layout.state_key, json.dumps(setup), ttl=CONST_ETCD_SETUP_TTL, deadline=deadline
        )
        version, counted = self._next_version(deadline)
        version_dir = self._layout.version_dir(version)
        if not self._conn.mkdir(version_dir, deadline=deadline):
            self._check_version_dir(active_version, version, counted, deadline)
        self.create_path_if_not_exists(self._layout.store_dir(version), deadline=deadline)
        opening = self._join.opening_state(version)
        # No tag needed: only the holder of our tagged setup state swaps it for this.
        return self._conn.compare_and_swap(
            self._layout.state_key,
            json.dumps(opening.state),
            active_version,
            ttl=opening.ttl,
            deadline=deadline,
        )

    def _check_version_dir(
        self, setup: Node, version: str, counted: Node, deadline: Deadline
    ) -> None:
        """Tell why the directory of the ``version`` we just counted (``counted``, the
        counter's write) exists already, and raise unless it is ours to use.

        The counter carries no tag, so a write of it whose answer was lost is settled by
        its value: if our setup state lapsed meanwhile, another worker may have written
        the same value and made the directory. A lost answer to our own ``mkdir`` makes
        it too, once re-sent.

        Raises:
            EtcdRendezvousRetryableFailure: our setup state is gone: another worker
                took over the setup.
            RendezvousStateError: the directory predates the counter's write: the
                counter went backwards.
        """
        state_key = self._layout.state_key
        current = self._conn.try_get(state_key, deadline=deadline)
        if current is None or current.value != setup.value:
            raise EtcdRendezvousRetryableFailure(
                f"Lost the right to set up version {version}: the setup state {state_key!r} "
                "lapsed and another worker took over."
            )
        version_dir = self._layout.version_dir(version)
        made = self._conn.try_get(version_dir, deadline=deadline)
        if made is not None and made.created_index < counted.modified_index:
            raise RendezvousStateError(
                f"{version_dir!r} already exists although the version counter "
                f"{self._layout.counter_key!r} just handed out {version}: the counter went "
                f"backwards. Delete {self._layout.run_dir!r} once no worker uses it."
            )
        # Our setup state holds: the directory is our own mkdir's, its answer lost.
        logger.info("%s was created by an earlier attempt", version_dir)

    def _next_version(self, deadline: Deadline) -> tuple[str, Node]:
        """Increment the version counter; return the new version and the counter's write.

        Raises:
            RendezvousStateError: the counter is missing or corrupt.
            EtcdRendezvousRetryableFailure: another worker incremented it first.
        """
        counter_key = self._layout.counter_key
        try:
            counter = self._conn.get(counter_key, deadline=deadline)
        except KeyNotFoundError:
            raise RendezvousStateError(
                f"The rendezvous version counter {counter_key!r} is missing: the run's etcd "
                "directory was deleted or expired while workers were using it."
            ) from None
        try:
            version = str(int(counter.value or "") + 1)
        except ValueError:
            raise RendezvousStateError(
                f"The rendezvous version counter {counter_key!r} holds "
                f"{preview(counter.value)}, not an integer. The key was left untouched."
            ) from None
        try:
            # PyTorch's counter has no room for a tag. Only the holder of the setup
            # state (ours, tagged) writes it, so the same value after a lost answer is
            # ours unless our setup state lapsed meanwhile: see _check_version_dir.
            counted = self._conn.compare_and_swap(counter_key, version, counter, deadline=deadline)
        except (CompareFailedError, KeyNotFoundError):
            # Our setup state expired and another worker took over.
            raise EtcdRendezvousRetryableFailure("Lost the right to set up a rendezvous.") from None
        return version, counted

    def announce_self_waiting(self, expected_version: str) -> Node:
        """Increment ``num_workers_waiting`` of the final rendezvous ``expected_version``,
        as PyTorch's workers do; returns the state written.

        Kept for PyTorch's API: our workers count themselves with wait keys instead
        (:meth:`handle_existing_rendezvous`).

        Raises:
            EtcdRendezvousRetryImmediately: the state is no longer that final version.
        """
        retry = self._contention_retry()
        while True:
            self._check_deadline()
            active_version, state = self.get_rdzv_state(deadline=self._rendezvous_deadline)
            if state["status"] != "final" or state["version"] != expected_version:
                raise EtcdRendezvousRetryImmediately
            state["num_workers_waiting"] += 1
            # A tag (which PyTorch's workers ignore and carry along) tells our increment
            # from a concurrent announcer's identical one.
            state["tag"] = secrets.token_hex(8)
            try:
                return self._conn.compare_and_swap(
                    active_version.key,
                    json.dumps(state),
                    active_version,
                    deadline=self._rendezvous_deadline,
                )
            except CompareFailedError:
                logger.debug("Announce self as waiting CAS unsuccessful, retrying")
                retry.wait()

    def wait_for_rendezvous_to_free(self, expected_version: str) -> None:
        """Wait until the final rendezvous ``expected_version`` ends.

        It ends when its state changes or is deleted, or when a member stops renewing
        its keep-alive key; in that case we delete the state (if it has not changed) so
        that a new version can start. One read, one listing and one watch stream,
        whatever the number of workers (see :doc:`how-it-works`, "Waiting in a few requests").
        """
        self._await_free(expected_version, None)

    def _await_free(
        self, expected_version: str, waiter: tuple[str, int] | None
    ) -> dict[str, Any] | None:
        """:meth:`wait_for_rendezvous_to_free`, counting the wait keys when our wait
        key (``waiter``: its name and creation index) calls for it; the last final state
        seen."""

        def lapsed(key: str) -> None:
            logger.info("Keep-alive key %s is not renewed.", key)
            logger.info(
                "Rendezvous version %s is incomplete. Attempting to destroy it.", expected_version
            )
            self._record(
                f"The keep-alive key {key} lapsed: version {expected_version} of the "
                f"rendezvous of run '{self._run_id}' lost a member and is being destroyed.",
                method="wait_for_rendezvous_to_free",
            )

        return await_end_of_final(
            self._conn,
            self._layout,
            expected_version,
            parse=parse_state,
            on_lapse=lapsed,
            deadline=self._rendezvous_deadline,
            timeout_error=lambda: RendezvousTimeoutError(self._timeout_message()),
            waiter=waiter,
        )

    def handle_join_last_call(self, expected_version: str, deadline: Deadline) -> None:
        """Keep the joinable state alive until ``deadline``, then freeze it, our live
        members already confirmed.

        Returns when the state is frozen or final (by us at the deadline, or by a worker
        that reached ``max_workers`` earlier).

        Raises:
            EtcdRendezvousRetryableFailure: the state changed in any other way.
            RequestTooLargeError: a write of the version was refused for its size (ours,
                or one reported in the version's hint key, read every ``SILENCE``).
        """
        half_ttl = CONST_ETCD_JOINABLE_EPHEMERAL_TTL / 2
        refreshed_at = float("-inf")
        looked_at = time.monotonic()
        while True:
            observed = self._feed.current(self._rendezvous_deadline)
            status = observed.status_in(expected_version)
            if status in ("frozen", "final"):
                return
            if status != "joinable" or observed.node is None:
                raise EtcdRendezvousRetryableFailure(
                    "Rendezvous state transition no longer possible. Must re-enter."
                )
            if deadline.expired():
                self._join.freeze(expected_version)
                continue
            # Every admission renews the state's TTL; we do when none did for half of it.
            age = min(self._feed.quiet_for, time.monotonic() - refreshed_at)
            if age >= half_ttl:
                refreshed_at = time.monotonic()
                self._refresh_state_ttl(observed.node)
                continue
            # We follow the state, not the hints: we read the hint every SILENCE, lest a
            # report of a write etcd refused for its size pass us by.
            looked = time.monotonic() - looked_at
            if looked >= SILENCE:
                looked_at = time.monotonic()
                self._join.check_reports(expected_version)
                continue
            wait = min(half_ttl - age, deadline.remaining() + 0.01, SILENCE - looked)
            self._feed.wait(wait, self._rendezvous_deadline)
            self._check_deadline()

    def _refresh_state_ttl(self, active_version: Node) -> None:
        """Renew the joinable state's TTL, only if it is still ``active_version``: hence a
        compare-and-swap that writes the same value."""
        try:
            node = self._conn.compare_and_swap(
                active_version.key,
                active_version.value or "",
                active_version,
                ttl=CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
                deadline=self._rendezvous_deadline,
            )  # the same value: another worker's identical refresh serves as well
        except CompareFailedError:
            logger.debug("Join last-call TTL refresh CAS unsuccessful; the state changed")
            return
        observed = self._feed.note(node, self._rendezvous_deadline)
        if observed.state is not None and observed.state.get("version") is not None:
            self._join.publish(str(observed.state["version"]), node, observed.state)

    # -- the state --------------------------------------------------------------------

    def get_rdzv_state(self, *, deadline: Deadline | None = None) -> tuple[Node, dict[str, Any]]:
        """Read and validate the current state, by ``deadline`` (default: the rendezvous
        ``timeout`` from now).

        Raises:
            KeyNotFoundError: there is no rendezvous state.
            RendezvousStateError: the state is corrupt.
        """
        deadline = deadline or Deadline(self._timeout)
        active_version = read_state(self._conn, self._layout.state_key, deadline)
        state = parse_state(active_version)
        self._last_state = state
        return active_version, state

    def num_workers_waiting(self) -> int:
        """``num_workers_waiting`` of the current state if it is final, else 0.

        Reads the state on the first call and leaves a watch stream on it open, so that
        later calls cost no request while the state does not change;
        :meth:`rendezvous_barrier` closes the stream (see docs/how-it-works.rst, "Waiting
        in a few requests").

        Its requests end within the rendezvous ``timeout``.

        Raises:
            RendezvousStateError: the state is corrupt.
        """
        deadline = Deadline(self._timeout)
        with self._waiting_lock:
            self._waiting_feed.wait(0.0, deadline)  # (reads the state the first time)
            state = self._waiting_feed.current(deadline).state
        if state is None or state["status"] != "final":
            return 0
        return int(state["num_workers_waiting"])

    def try_wait_for_state_change(
        self, etcd_index: int, timeout: float | None = None
    ) -> tuple[Node, dict[str, Any]]:
        """Wait for the state to change at or after ``etcd_index``, then read it.

        Waits at most ``timeout`` seconds, and never much past the rendezvous deadline.

        Raises:
            RendezvousTimeoutError: the rendezvous deadline passed.
        """
        overall = self._rendezvous_deadline.remaining() + 1.0
        wait = Deadline(overall if timeout is None else min(timeout, overall))
        change = self._conn.watch(self._layout.state_key, etcd_index, wait)
        self._check_deadline()
        if change is not None and change.value is not None and change.action in WRITE_ACTIONS:
            # The event carries the new state: no need to read it again. Callers watch
            # on from the event's own index, so no later change is missed.
            node = dataclasses.replace(change, etcd_index=change.modified_index)
            state = parse_state(node)
            self._last_state = state
            return node, state
        return self.get_rdzv_state(deadline=self._rendezvous_deadline)

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
        key = self._layout.state_key
        retry = self._race_retry(key, f"close the rendezvous of run {self._run_id!r}", seconds)
        deadline = retry.deadline
        while True:
            try:
                active_version, state = self.get_rdzv_state(deadline=deadline)
            except KeyNotFoundError:
                try:
                    # No tag needed: a closed state means the same whoever wrote it.
                    self._conn.create(key, json.dumps({"status": "closed"}), deadline=deadline)
                    self._record_closed()
                    return
                except KeyExistsError:
                    retry.wait()
                    continue
            if state["status"] == "closed":
                return
            state["status"] = "closed"
            try:
                # No tag needed: a closed state is closed whoever closed it.
                self._conn.compare_and_swap(
                    key, json.dumps(state), active_version, deadline=deadline
                )
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

    def create_path_if_not_exists(
        self, full_path: str, ttl: int | None = None, *, deadline: Deadline | None = None
    ) -> None:
        """Create directory ``full_path`` (with ``ttl``) unless it exists, by ``deadline``
        (default: the rendezvous ``timeout`` from now)."""
        self._conn.mkdir(full_path, ttl=ttl, deadline=deadline or Deadline(self._timeout))

    def store_extra_data(
        self, rdzv_version: str, key: str, value: Any, timeout: float | None = None
    ) -> None:
        """Store ``key: value`` (JSON-serialisable) in the version's ``extra_data`` key.

        Args:
            timeout: seconds to go on retrying when other workers keep changing the
                key first, and etcd failures; the rendezvous ``timeout`` if ``None``.

        Raises:
            RendezvousTimeoutError: the key could not be written within ``timeout``.
        """
        node = self._layout.extra_data_key(rdzv_version)
        encoded = json.dumps({key: value})
        retry = self._race_retry(node, f"store {key!r}", timeout)
        deadline = retry.deadline
        try:
            # No tag needed: a value holding our key and value is what we want stored.
            self._conn.create(node, encoded, deadline=deadline)
            return
        except KeyExistsError:
            pass
        while True:
            extra_data = self._conn.get(node, deadline=deadline)
            data = self._decode_extra_data(extra_data)
            data[key] = value
            try:
                # No tag needed, as for the create: a value holding our key is ours.
                self._conn.compare_and_swap(node, json.dumps(data), extra_data, deadline=deadline)
                return
            except CompareFailedError:
                logger.debug("Store extra_data CAS unsuccessful, retrying")
                retry.wait()

    def load_extra_data(self, rdzv_version: str, key: str, timeout: float | None = None) -> Any:
        """Return ``key`` from the version's ``extra_data``, waiting until it is stored
        (for ever if ``timeout`` is ``None``). Each read gives up after the connection's
        ``read_timeout`` of etcd failures.

        Raises:
            RendezvousTimeoutError: ``key`` was not stored within ``timeout`` seconds.
            RendezvousConnectionError: etcd was unreachable for ``read_timeout``.
        """
        node = self._layout.extra_data_key(rdzv_version)
        deadline = Deadline.never() if timeout is None else Deadline(timeout)
        while True:
            try:
                extra_data = self._conn.get(
                    node, deadline=deadline.earliest(self._conn.read_timeout)
                )
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
            self._conn.watch(node, index, deadline.earliest(60.0))

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


def progress_line(
    state: dict[str, Any] | None,
    member_key: str | None,
    run_id: str,
    workers: tuple[int, int],
    remaining: float,
) -> str | None:
    """The progress line of a worker waiting in ``rendezvous_barrier()`` with
    ``remaining`` seconds left, from ``state`` as it last saw it (``None``: none) and its
    own ``member_key`` (``None``: none yet); ``workers`` are the minimum and maximum
    number of workers. ``None``: nothing to say (a final version with this worker in it:
    its call is returning)."""
    min_workers, max_workers = workers
    left = seconds_left(remaining)
    head = f"Rendezvous of run '{run_id}'"
    if state is None:
        return f"{head}: waiting for a worker to create the rendezvous state; {left}"
    status, version = state.get("status"), state.get("version")
    joined = len(state.get("participants", []))
    if status == "joinable":
        if joined < min_workers:
            wants = f"waiting for {min_workers - joined} more"
        else:
            wants = "in its last call for more workers"
        return (
            f"{head}: {joined} of {min_workers} workers joined version {version} "
            f"(max {max_workers}), {wants}; {left}"
        )
    if status == "frozen":
        confirmed = len(state.get("keep_alives", []))
        return (
            f"{head}: version {version} is frozen with {joined} workers, {confirmed} "
            f"confirmed; waiting for the others to confirm; {left}"
        )
    if status == "final":
        if member_key is not None and normalize_key(member_key) in confirmed_keys(state):
            return None
        return (
            f"{head}: version {version} is complete with {joined} workers without us; "
            f"waiting for it to end (a member leaving, or the job restarting), "
            f"{state.get('num_workers_waiting', 0)} workers waiting; {left}"
        )
    if status == "setup":
        return f"{head}: a worker is setting up a new version; {left}"
    return None
