"""The legacy ``etcd`` rendezvous backend, ported from PyTorch Elastic.

Every worker of a job runs the same state machine over one etcd key,
``<prefix>/run_<run_id>/rdzv/active_version``, changed only by compare-and-swap::

    (absent) -> setup -> joinable -> frozen -> final      (any state) -> closed

* **setup** (TTL 5 s): one worker holds the right to open the next version; it
  increments ``rdzv/version_counter`` and publishes ``joinable``.
* **joinable**: workers are added to ``participants``; the list position is the rank.
  Once ``min_workers`` joined, the key gets a 10 s TTL kept alive by the "last call"
  worker (rank ``min_workers - 1``), which freezes the set after
  ``last_call_timeout``; reaching ``max_workers`` freezes it at once.
* **frozen** (TTL 10 s): each participant's keep-alive key (TTL 10 s, refreshed every
  5 s) is added to ``keep_alives``; the write that completes the list makes the state
  **final** (no TTL).
* **final**: the rendezvous is complete. Late workers increment
  ``num_workers_waiting`` and wait; if a member's keep-alive key expires they delete the
  state so that the next version starts.
* **closed**: the job is over; every ``next_rendezvous`` fails with
  :class:`~etcd_rendezvous.api.RendezvousClosedError`.

The key layout, the JSON encoding and the TTLs are PyTorch's, so workers using this
module and workers using ``torch.distributed.elastic.rendezvous.etcd_rendezvous`` join
the same rendezvous. What differs is how the states are driven:

* a PyTorch worker joins by appending itself to ``participants``, then confirms by
  creating ``rdzv/v_<version>/rank_<rank>`` and appending it to ``keep_alives``: two
  compare-and-swaps of the one state key each, which N workers make in O(N²) requests.
  Ours announce themselves with a member key ``rdzv/v_<version>/node_<hex>`` (also
  their keep-alive key) and one of them admits all that announced, ranks in announce
  order recorded in the state's extra ``members`` field, in one compare-and-swap; the
  write that freezes the state confirms them too. A worker joins in a few requests
  whatever N (see :mod:`etcd_rendezvous._legacy.admission`);
* a worker reads the state before trying to create it, and of many finding none at
  once only a few try;
* waiting is done with one etcd watch stream on the state, whose events carry the new
  state, and failed attempts back off with jitter instead of sleeping a fixed second,
  so a rendezvous completes in milliseconds;
* compare-and-swap compares the modification index as well as the value, and a write
  whose answer was lost is recognised as applied (see :mod:`etcd_rendezvous._transport.v2`);
* a corrupt state key raises :class:`~etcd_rendezvous.api.RendezvousStateError` naming
  the key, and is left as it is for an operator to inspect;
* every etcd request runs under the deadline of the call that made it (the rendezvous
  ``timeout``): etcd failures, a leader election included, are retried until then, and
  no call outlives it by more than about a second, whatever etcd does;
* keep-alive threads survive etcd outages, stop on :meth:`EtcdRendezvousHandler.shutdown`,
  and on etcd 3.5, which cannot refresh a directory's TTL, the run directory is created
  without one instead of silently expiring after two hours;
* importing the module does not configure logging;
* phase changes (joined, complete, waiting, a member's keep-alive lapsed, closed, failed
  or timed out) are recorded as rendezvous events, see :mod:`etcd_rendezvous.events`.

This module holds the barrier (:class:`EtcdRendezvous`: the state machine above), the
handler and its construction from parameters. The rest of the rendezvous (set-up and
tear-down, the run's keys, reading the state, closing the run, ``extra_data`` and the
store) is its base, in :mod:`etcd_rendezvous._legacy.base`; the state's validation is in
:mod:`etcd_rendezvous._legacy.state`, the keep-alive threads in
:mod:`etcd_rendezvous._legacy.lease_keeper`, the batched join in
:mod:`etcd_rendezvous._legacy.admission`.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ._legacy.admission import (
    CONST_ETCD_FROZEN_TTL,  # noqa: F401 (PyTorch's name, importable from here as there)
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
    CONST_ETCD_SETUP_TTL,
    CONST_WORKER_KEEPALIVE_TTL,  # noqa: F401 (PyTorch's name, importable from here as there)
    RestartAttempt,
    create_spread,
)
from ._legacy.base import (
    CONST_RUNID_SUBROOT_TTL,  # noqa: F401 (PyTorch's name, importable from here as there)
    EtcdRendezvousBase,
)
from ._legacy.state import member_ranks, parse_state, preview
from ._legacy.waiting import WAITER_TTL, await_end_of_final
from ._progress import ProgressLog, progress_interval, seconds_left
from ._torch.errors import torch_errors
from ._torch.store import adapt_store, torch_available, torch_store_wanted
from ._transport.options import create_etcd_connection as _create_etcd_connection
from ._transport.options import seconds as _seconds
from ._transport.retry import CONNECTION, Deadline
from ._transport.v2 import CompareFailedError, KeyExistsError, KeyNotFoundError, Node
from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from .events import NodeState, _records_failure, record_rdzv_event
from .layout import DEFAULT_PREFIX, new_waiter_name
from .metrics import MetricKind, record_metric, timed

__all__ = [
    "EtcdRendezvous",
    "EtcdRendezvousHandler",
    "EtcdRendezvousRetryImmediately",
    "EtcdRendezvousRetryableFailure",
    "create_rdzv_handler",
    "member_ranks",
    "parse_state",
]

logger = logging.getLogger(__name__)


class EtcdRendezvousRetryableFailure(Exception):  # noqa: N818 (PyTorch's name)
    """We were too late for a state transition and must start again, after a short delay."""


class EtcdRendezvousRetryImmediately(Exception):  # noqa: N818 (PyTorch's name)
    """The state we observed allows starting again at once, without a delay."""


#: Default time for :meth:`EtcdRendezvous.rendezvous_barrier` to succeed, in seconds.
_DEFAULT_TIMEOUT: int = 600
#: Default extra wait for more workers once ``min_workers`` joined, in seconds.
_DEFAULT_LAST_CALL_TIMEOUT: int = 30

# The TTLs of the protocol (CONST_ETCD_SETUP_TTL, ...: PyTorch's workers use the same
# ones) are defined with the join, in _legacy_admission, and CONST_RUNID_SUBROOT_TTL
# with the run directory, in _legacy_base; all are importable from here.

#: Least time given to the exchange of the master address after the barrier, in seconds
#: (rank 0 publishes it at once; see :meth:`EtcdRendezvousHandler.next_rendezvous`).
_EXCHANGE_GRACE = 0.5

# -- the state machine -------------------------------------------------------------------


class EtcdRendezvous(EtcdRendezvousBase):
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

    The rendezvous is a context manager: leaving the block calls :meth:`close`.

    Raises:
        ValueError: a parameter is invalid (the message names it).
        RendezvousConnectionError: etcd cannot be reached.
        RendezvousStateError: on the v2 API, the prefix exists in etcd as a value, not a
            directory.
    """

    def __enter__(self) -> EtcdRendezvous:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _record(
        self,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        rank: int | None = None,
        *,
        method: str | None = None,
    ) -> None:
        """Record a phase change as a rendezvous event named after ``method`` (by
        default, the caller): see :mod:`etcd_rendezvous.events`."""
        # Here, not in the base: record_rdzv_event names the event after this file.
        record_rdzv_event(
            name=f"{type(self).__name__}.{method or sys._getframe(1).f_code.co_name}",
            run_id=self._run_id,
            message=message,
            node_state=node_state,
            rank=rank,
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
            RendezvousError: other non-retryable errors.
        """
        self._rendezvous_deadline = Deadline(self._timeout)
        self._record(f"The worker attempts to join the next rendezvous of run '{self._run_id}'.")
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
        with progress, self._conn.bounded_by(self._rendezvous_deadline):
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
        read (see :mod:`etcd_rendezvous._progress`)."""
        state = self._feed.last_state
        left = seconds_left(self._rendezvous_deadline.remaining())
        head = f"Rendezvous of run '{self._run_id}'"
        if state is None:
            return f"{head}: waiting for a worker to create the rendezvous state; {left}"
        status, version = state.get("status"), state.get("version")
        joined = len(state.get("participants", []))
        if status == "joinable":
            if joined < self._num_min_workers:
                wants = f"waiting for {self._num_min_workers - joined} more"
            else:
                wants = "in its last call for more workers"
            return (
                f"{head}: {joined} of {self._num_min_workers} workers joined version {version} "
                f"(max {self._num_max_workers}), {wants}; {left}"
            )
        if status == "frozen":
            confirmed = len(state.get("keep_alives", []))
            return (
                f"{head}: version {version} is frozen with {joined} workers, {confirmed} "
                f"confirmed; waiting for the others to confirm; {left}"
            )
        if status == "final":
            return (
                f"{head}: version {version} is complete with {joined} workers without us; "
                f"waiting for it to end (a member leaving, or the job restarting), "
                f"{state.get('num_workers_waiting', 0)} workers waiting; {left}"
            )
        if status == "setup":
            return f"{head}: a worker is setting up a new version; {left}"
        return None

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
        observed = self._feed.current()
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
        if self._feed.wait(create_spread(self._num_max_workers, self._feed.read_seconds)):
            return None
        try:
            active_version = self.try_create_rendezvous()
        except KeyExistsError:
            self._await_change()
            return None
        state = self._feed.note(active_version).state or {}
        logger.info("New rendezvous state created: %s", state)
        return str(state["version"])

    def _await_change(self) -> None:
        """Wait for the state to change, until the rendezvous deadline."""
        self._feed.wait(self._rendezvous_deadline.remaining())
        self._check_deadline()

    def join_phase(self, expected_version: str) -> tuple[str, int, int]:
        """Join the joinable rendezvous ``expected_version`` and wait for the others.

        We announce ourselves with a member key and are admitted with others in one
        write (see :mod:`etcd_rendezvous._legacy.admission`).
        """
        this_rank = self._join.admit(expected_version)
        logger.info("Joined rendezvous version %s as rank %s", expected_version, this_rank)
        self._record(
            f"The worker joined version {expected_version} of the rendezvous of run "
            f"'{self._run_id}' as rank {this_rank}.",
            rank=this_rank,
        )
        # The worker ranked num_min_workers - 1 waits out the last call, then freezes
        # the rendezvous. Should it die meanwhile, the state (now with a TTL) expires
        # and everyone starts over.
        if (
            this_rank == self._num_min_workers - 1
            and self._feed.current().status_in(expected_version) == "joinable"
        ):
            logger.info("Rank %s is responsible for join last call.", this_rank)
            self.handle_join_last_call(expected_version, Deadline(self._last_call_timeout))
            logger.info("Rank %s finished join last call.", this_rank)
        return self.confirm_phase(expected_version, this_rank)

    def confirm_phase(self, expected_version: str, this_rank: int) -> tuple[str, int, int]:
        """Wait until every member of ``expected_version`` confirmed (our members are
        confirmed together; see :mod:`etcd_rendezvous._legacy.admission`)."""
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
            rank=this_rank,
        )
        return expected_version, this_rank, world_size

    def handle_existing_rendezvous(self, expected_version: str) -> None:
        """Announce ourselves as waiting on a final rendezvous, then wait for it to end.

        We announce ourselves with a wait key, and are counted in
        ``num_workers_waiting`` with the others that did (one write for many; see
        :mod:`etcd_rendezvous._legacy.waiting`), where PyTorch's workers each increment
        it (:meth:`announce_self_waiting`).
        """
        if self._waiting_as is None or self._waiting_as[0] != expected_version:
            self._waiting_as = (expected_version, new_waiter_name(secrets.randbits(64)))
        waiter = self._waiting_as[1]
        key = self._layout.waiter_key(expected_version, waiter)
        self._conn.set(key, None, ttl=WAITER_TTL)
        logger.info("Waiting on rendezvous version %s as %s", expected_version, key)
        self._record(
            f"The worker waits for the next rendezvous of run '{self._run_id}': version "
            f"{expected_version} is complete."
        )
        self._await_free(expected_version, waiter)
        logger.info("Previously existing rendezvous state changed. Will re-try joining.")

    def try_create_rendezvous(self) -> Node:
        """Create a new joinable rendezvous version, with us admitted to it.

        Raises:
            KeyExistsError: a rendezvous state already exists.
            RendezvousStateError: the version counter is missing or corrupt.
        """
        # The state is ephemeral until joinable, in case we die half-way through. Its
        # "tag" (which PyTorch's workers ignore) makes it ours alone: a create whose answer
        # was lost recognises itself, never another worker's setup.
        setup = {"status": "setup", "tag": secrets.token_hex(8)}
        active_version = self._conn.create(
            self._layout.state_key, json.dumps(setup), ttl=CONST_ETCD_SETUP_TTL
        )
        version = self._next_version()
        version_dir = self._layout.version_dir(version)
        if not self._conn.mkdir(version_dir):
            raise RendezvousStateError(
                f"{version_dir!r} already exists although the version counter "
                f"{self._layout.counter_key!r} just handed out {version}: the counter went "
                f"backwards. Delete {self._layout.run_dir!r} once no worker uses it."
            )
        self.create_path_if_not_exists(self._layout.store_dir(version))
        opening = self._join.opening_state(version)
        return self._conn.compare_and_swap(
            self._layout.state_key, json.dumps(opening.state), active_version, ttl=opening.ttl
        )

    def _next_version(self) -> str:
        """Increment the version counter; return the new version.

        Raises:
            RendezvousStateError: the counter is missing or corrupt.
            EtcdRendezvousRetryableFailure: another worker incremented it first.
        """
        counter_key = self._layout.counter_key
        try:
            counter = self._conn.get(counter_key)
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
            # ours unless our setup state lapsed meanwhile -- then mkdir below fails.
            self._conn.compare_and_swap(counter_key, version, counter)
        except (CompareFailedError, KeyNotFoundError):
            # Our setup state expired and another worker took over.
            raise EtcdRendezvousRetryableFailure("Lost the right to set up a rendezvous.") from None
        return version

    def announce_self_waiting(self, expected_version: str) -> Node:
        """Increment ``num_workers_waiting`` of the final rendezvous ``expected_version``."""
        retry = self._contention_retry()
        while True:
            self._check_deadline()
            active_version, state = self.get_rdzv_state()
            if state["status"] != "final" or state["version"] != expected_version:
                raise EtcdRendezvousRetryImmediately
            state["num_workers_waiting"] += 1
            # A tag (which PyTorch's workers ignore and carry along) tells our increment
            # from a concurrent announcer's identical one.
            state["tag"] = secrets.token_hex(8)
            try:
                return self._conn.compare_and_swap(
                    active_version.key, json.dumps(state), active_version
                )
            except CompareFailedError:
                logger.debug("Announce self as waiting CAS unsuccessful, retrying")
                retry.wait()

    def wait_for_rendezvous_to_free(self, expected_version: str) -> None:
        """Wait until the final rendezvous ``expected_version`` ends.

        It ends when its state changes or is deleted, or when a member stops renewing
        its keep-alive key; in that case we delete the state (if it has not changed) so
        that a new version can start. One read, one listing and one watch stream,
        whatever the number of workers (see :mod:`etcd_rendezvous._legacy.waiting`).
        """
        self._await_free(expected_version, None)

    def _await_free(self, expected_version: str, waiter: str | None) -> None:
        """:meth:`wait_for_rendezvous_to_free`, counting the wait keys when our wait
        key ``waiter`` calls for it."""

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

        await_end_of_final(
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
        """
        half_ttl = CONST_ETCD_JOINABLE_EPHEMERAL_TTL / 2
        refreshed_at = float("-inf")
        while True:
            observed = self._feed.current()
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
            self._feed.wait(min(half_ttl - age, deadline.remaining() + 0.01))
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
            )  # the same value: another worker's identical refresh serves as well
        except CompareFailedError:
            logger.debug("Join last-call TTL refresh CAS unsuccessful; the state changed")
            return
        self._feed.note(node)


# -- the handler -------------------------------------------------------------------------


class EtcdRendezvousHandler(RendezvousHandler):
    """A :class:`~etcd_rendezvous.api.RendezvousHandler` backed by :class:`EtcdRendezvous`.

    Usually created by :func:`create_rdzv_handler` (the ``etcd`` backend) from a URL or
    :class:`~etcd_rendezvous.api.RendezvousParameters`, e.g.
    ``etcd://localhost:2379/1234?min_workers=1&max_workers=3``: the etcd endpoint(s),
    the job id (any string unique among the jobs sharing the etcd) and the range of
    workers.

    The handler is a context manager: leaving the block calls :meth:`close`.

    Args:
        rdzv_impl: the rendezvous implementation. The handler takes it over (as in
            PyTorch, it is this one worker's state): :meth:`close` closes it, which
            releases the connection if ``rdzv_impl`` owns it.
        local_addr: the address other nodes reach this node at (published by rank 0 as
            ``MASTER_ADDR``); the host's FQDN if ``None``.
        backend_name: what :meth:`get_backend` reports: the name the handler was
            registered under (``etcd``, or ``etcd-rendezvous`` for torchrun's plugin).
        torch_store: whether ``next_rendezvous()`` returns the store as a
            :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` (a real
            ``torch.distributed.Store``); ``None`` means "if PyTorch is installed".
    """

    def __init__(
        self,
        rdzv_impl: EtcdRendezvous,
        local_addr: str | None,
        *,
        backend_name: str = "etcd",
        torch_store: bool | None = None,
    ) -> None:
        self._rdzv_impl = rdzv_impl
        self._local_addr = local_addr
        self._backend_name = backend_name
        self._torch_store = torch_available() if torch_store is None else torch_store

    def __enter__(self) -> EtcdRendezvousHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def rendezvous(self) -> EtcdRendezvous:
        """The :class:`EtcdRendezvous` this handler drives (PyTorch's ``_rdzv_impl``), for
        tools that read the run's state (:meth:`EtcdRendezvous.get_rdzv_state`) or keys
        (:attr:`EtcdRendezvous.layout`)."""
        return self._rdzv_impl

    def get_backend(self) -> str:
        """Return the backend name: ``"etcd"`` unless created under another name."""
        return self._backend_name

    @torch_errors
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next rendezvous and return its store, our rank and the world size.

        The store is the rendezvous version's :class:`EtcdStore`, as a
        :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` when PyTorch is installed
        (see ``torch_store``).

        Returns or raises within the rendezvous ``timeout`` plus about a second,
        whatever etcd does (see :meth:`EtcdRendezvous.rendezvous_barrier`).
        """
        rdzv = self._rdzv_impl
        rdzv_version, rank, world_size = rdzv.rendezvous_barrier()
        logger.info("Creating EtcdStore as the c10d::Store implementation")
        # Rank 0 publishes its address just after the barrier, so the exchange gets a
        # moment even if the barrier completed right at the deadline.
        remaining = rdzv._rendezvous_deadline.remaining()
        with rdzv.connection.bounded_by(Deadline(max(remaining, _EXCHANGE_GRACE))):
            store = rdzv.setup_kv_store(rdzv_version, create_dir=False)
            bootstrap_store_info = RendezvousStoreInfo.build(
                rank, store, local_addr=self._local_addr
            )
        return RendezvousInfo(
            adapt_store(store, self._torch_store), rank, world_size, bootstrap_store_info
        )

    @torch_errors
    def is_closed(self) -> bool:
        """Whether the rendezvous of this run is closed (asking etcd for at most the
        rendezvous ``timeout``)."""
        try:
            with self._rdzv_impl.bounded():
                _, state = self._rdzv_impl.get_rdzv_state()
        except KeyNotFoundError:
            return False
        return bool(state["status"] == "closed")

    @torch_errors
    def set_closed(self) -> None:
        """Close the rendezvous of this run."""
        self._rdzv_impl.set_closed()

    @torch_errors
    def num_nodes_waiting(self) -> int:
        """Number of workers waiting to join while the current rendezvous is final.

        Raises:
            RendezvousConnectionError: etcd stayed unreachable for the rendezvous
                ``timeout``.
        """
        try:
            with self._rdzv_impl.bounded():
                _, state = self._rdzv_impl.get_rdzv_state()
        except KeyNotFoundError:
            return 0
        if state["status"] == "final":
            return int(state["num_workers_waiting"])
        return 0

    def get_run_id(self) -> str:
        """Return the run id."""
        return self._rdzv_impl._run_id

    def shutdown(self) -> bool:
        """Close the rendezvous and stop this worker's keep-alive threads.

        Returns:
            Whether the rendezvous could be marked closed. The threads are stopped
            either way.
        """
        try:
            self.set_closed()
            return True
        except Exception:
            logger.warning("Shutdown failed", exc_info=True)
            return False
        finally:
            self._rdzv_impl.stop_lease_renewals()

    def close(self) -> None:
        """Stop the keep-alive threads and release the connection the rendezvous owns,
        without closing the rendezvous for the other workers. Idempotent."""
        self._rdzv_impl.close()


# -- construction from parameters --------------------------------------------------------


def _params_from_url(url: str) -> RendezvousParameters:
    """Parse ``etcd://host:port[,host:port...]/run_id?min_workers=N&max_workers=M&...``."""
    parts = urlsplit(url)
    if parts.scheme != "etcd":
        raise ValueError(f"url: expected an etcd:// URL, got {url!r}.")
    run_id = parts.path.strip("/")
    query: Mapping[str, str] = dict(parse_qsl(parts.query, keep_blank_values=True))
    config: dict[str, Any] = dict(query)
    try:
        min_nodes = int(config.pop("min_workers"))
        max_nodes = int(config.pop("max_workers", min_nodes))
    except KeyError:
        raise ValueError(f"url: {url!r} does not give min_workers.") from None
    except ValueError:
        raise ValueError(f"url: min_workers/max_workers in {url!r} must be integers.") from None
    return RendezvousParameters(
        backend="etcd",
        endpoint=parts.netloc,
        run_id=run_id,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        local_addr=config.pop("local_addr", None),
        **config,
    )


def create_rdzv_handler(params: RendezvousParameters | str) -> EtcdRendezvousHandler:
    """Create the handler of the ``etcd`` backend.

    ``params`` is a :class:`~etcd_rendezvous.api.RendezvousParameters` or an
    ``etcd://`` URL (``etcd://h1:2379,h2:2379/run_id?min_workers=2&max_workers=4``).
    ``endpoint`` may list several etcd endpoints, comma-separated. Configuration keys:

    ===================  ===================================================  ==================
    key                  meaning                                              default
    ===================  ===================================================  ==================
    timeout              seconds for ``next_rendezvous`` to succeed           600
    last_call_timeout    extra wait once ``min_nodes`` joined, seconds        30
    etcd_prefix          key prefix inside etcd                               /torchelastic/p2p
    protocol             ``http`` or ``https``                                http
    cacert               CA bundle that verifies the server (https)
    cert, key            client certificate and its key (https)
    username, password   etcd authentication
    read_timeout         the longest one etcd request may wait, and how       60
                         long failures are retried outside a deadline
    request_timeout      seconds one etcd request waits for an answer         3
                         (then the next endpoint is tried)
    silence_timeout      seconds a wait may hear nothing from its member      10
                         (then it is re-armed on the next endpoint)
    connect_timeout      seconds to connect to one endpoint                   5
    torch_store          hand out a ``torch.distributed.Store``: auto,        auto
                         true or false (auto: if PyTorch is installed)
    ===================  ===================================================  ==================

    The handler's :meth:`~EtcdRendezvousHandler.get_backend` reports
    ``params.backend`` (``etcd`` for a URL). It owns the connection opened here:
    :meth:`~EtcdRendezvousHandler.close` releases it.

    Time bounds: creating the handler, ``next_rendezvous()``, ``num_nodes_waiting()``,
    ``is_closed()``, ``set_closed()`` and ``shutdown()`` each return or raise within
    ``timeout`` plus about a second, however etcd fails (refused, never answering,
    killed or suspended); etcd errors are retried until then. An endpoint that refuses
    connections or does not answer is reported by this function within
    ``connect_timeout`` (or ``timeout``, if shorter).

    Raises:
        ValueError: a parameter is invalid; the message names it.
        RendezvousConnectionError: etcd cannot be reached at any endpoint; the message
            names the endpoints.
    """
    if isinstance(params, str):
        params = _params_from_url(params)
    timeout = _seconds(params, "timeout", _DEFAULT_TIMEOUT)
    last_call_timeout = _seconds(
        params, "last_call_timeout", _DEFAULT_LAST_CALL_TIMEOUT, allow_zero=True
    )
    prefix = params.get("etcd_prefix", DEFAULT_PREFIX)
    torch_store = torch_store_wanted(params)
    # Creation, too, ends within the rendezvous timeout, whatever etcd does.
    deadline = Deadline(timeout)
    conn = _create_etcd_connection(params, deadline=deadline)
    with conn.bounded_by(deadline):
        rdzv = EtcdRendezvous(
            client=conn,
            prefix=str(prefix),
            run_id=params.run_id,
            num_min_workers=params.min_nodes,
            num_max_workers=params.max_nodes,
            timeout=timeout,
            last_call_timeout=last_call_timeout,
            owns_connection=True,
        )
    return EtcdRendezvousHandler(
        rdzv_impl=rdzv,
        local_addr=params.local_addr,
        backend_name=params.backend or "etcd",
        torch_store=torch_store,
    )
