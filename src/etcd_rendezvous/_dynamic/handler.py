"""The handler of the dynamic rendezvous and its factory.

Part of :mod:`etcd_rendezvous.dynamic_rendezvous`, which re-exports
:class:`DynamicRendezvousHandler` and :func:`create_handler` (users import them from
there). How the handler works: :doc:`/how-it-works`, section "The dynamic rendezvous".
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from .._progress_log import ProgressLog, progress_interval, seconds_left
from .._torch_store import adapt_store, bounded_store, torch_available, torch_store_wanted
from .._transport.retry import Deadline
from ..api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    Store,
)
from ..events import NodeState, _records_failure
from ..layout import dynamic_store_prefix
from ..metrics import MetricKind, record_metric
from ..prometheus import serve_metrics_from_environment
from .admission import Admission
from .backend import RendezvousBackend, as_backend, delay
from .executor import OpExecutor
from .holder import BackendStateHolder, StateHolder
from .keys import KeyedBackend
from .ops import CloseOp, ExitOp, JoinOp, KeepAliveOp
from .periodic import _PeriodicTimer
from .prefix_store import prefix_store
from .settings import (
    LOGGER_NAME,
    RendezvousSettings,
    RendezvousTimeout,
    event_source,
    record_node_event,
)
from .state import _NodeDesc, _NodeDescGenerator, _RendezvousState

__all__ = ["DynamicRendezvousHandler", "create_handler", "progress_line"]

logger = logging.getLogger(LOGGER_NAME)

#: Environment variable with which PyTorch opts out of sharing the agent's TCPStore.
_DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


#: Longest a node spends deleting its key when it leaves without a deadline of its own
#: (``close()``, a failed ``next_rendezvous()``), in seconds: the key expires anyway.
_WITHDRAW_TIMEOUT = 1.0
#: Seconds during which :meth:`DynamicRendezvousHandler.num_nodes_waiting` trusts the
#: progress key's count of zero after a read of the whole state (our writes keep the key
#: current; PyTorch's are relayed by the heartbeat aggregator within an interval).
_WAITING_RECHECK = 10.0
#: Seconds during which it answers from the last read of the progress key.
_WAITING_POLL = 2.0


# -- the handler ----------------------------------------------------------------------------


class DynamicRendezvousHandler(RendezvousHandler):
    """Represent a handler that sets up a rendezvous among a set of nodes.

    Created with :meth:`from_backend` or :func:`create_handler`. Use one handler per
    agent, and call :meth:`shutdown` when done: it closes the rendezvous and stops the
    keep-alive thread. :meth:`close` (also called on leaving a ``with`` block) stops
    the thread and releases the backend if the handler owns it, without closing the
    rendezvous for the other nodes.
    """

    # Static
    _node_desc_generator = _NodeDescGenerator()

    _this_node: _NodeDesc
    _settings: RendezvousSettings
    _backend_name: str
    _store: Store
    _state_holder: StateHolder
    _op_executor: OpExecutor
    _heartbeat_lock: threading.Lock
    _keep_alive_timer: _PeriodicTimer | None

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Store,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: int = 5,
        keep_alive_max_attempt: int = 3,
        *,
        backend_name: str | None = None,
        owns_backend: bool = False,
    ) -> DynamicRendezvousHandler:
        """Create a new :class:`DynamicRendezvousHandler`.

        Args:
            run_id: The run id of the rendezvous.
            store: The c10d store to return as part of the rendezvous.
            backend: The backend to use to hold the rendezvous state.
            min_nodes: The minimum number of nodes to admit to the rendezvous.
            max_nodes: The maximum number of nodes to admit to the rendezvous.
            local_addr: The local node address.
            timeout: The timeout configuration of the rendezvous.
            keep_alive_interval: The amount of time, in seconds, a node waits before
                sending a heartbeat to keep it alive in the rendezvous.
            keep_alive_max_attempt: The maximum number of failed heartbeat attempts after
                which a node is considered dead.
            backend_name: What :meth:`get_backend` reports; ``backend.name`` if ``None``.
            owns_backend: Whether :meth:`close` closes ``backend`` (set by whoever
                created the backend and hands it over).

        Raises:
            ValueError: A setting is invalid; the message names it.
        """
        # We associate each handler instance with a unique node descriptor.
        node = cls._node_desc_generator.generate(local_addr)

        settings = RendezvousSettings(
            run_id,
            min_nodes,
            max_nodes,
            timeout or RendezvousTimeout(),
            keep_alive_interval=timedelta(seconds=keep_alive_interval),
            keep_alive_max_attempt=keep_alive_max_attempt,
        )

        state_holder = BackendStateHolder(backend, settings)
        # This package's backend keeps node keys: batched admission, aggregated heartbeats.
        admission = None
        if isinstance(backend, KeyedBackend):
            admission = Admission(backend, node, settings, state_clock=state_holder.clock)

        return cls(
            node,
            settings,
            backend_name or backend.name,
            store,
            state_holder,
            owned_backend=backend if owns_backend else None,
            admission=admission,
        )

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Store,
        state_holder: StateHolder,
        *,
        owned_backend: RendezvousBackend | None = None,
        admission: Admission | None = None,
    ) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")

        if settings.min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({settings.min_nodes}) must be greater than zero."
            )

        if settings.max_nodes < settings.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({settings.max_nodes}) must be greater than or "
                f"equal to the minimum number of nodes ({settings.min_nodes})."
            )

        self._this_node = node
        self._settings = settings
        self._backend_name = backend_name
        #: The participants of the last round this node completed (for the metrics).
        self._last_participants: set[_NodeDesc] = set()
        self._store = store
        self._state_holder = state_holder
        self._admission = admission
        # When num_nodes_waiting() last read the whole state.
        self._waiting_read_at = -math.inf
        # When the progress key was last read for it, and whether it said none waits.
        self._waiting_hint: tuple[float, bool] = (-math.inf, False)
        self._op_executor = OpExecutor(self._this_node, state_holder, settings, admission)
        self._heartbeat_lock = threading.Lock()
        # Guards starting and stopping the keep-alive timer.
        self._timer_lock = threading.Lock()
        self._keep_alive_timer = None
        # The shared TCPStore server, when this node hosts it (rank 0, torch installed).
        self._shared_tcp_store_server: Any = None
        self._bootstrap_store_info: RendezvousStoreInfo | None = None
        # The port of the last shared TCPStore server this node hosted (0: none yet).
        self._tcp_store_port = 0
        # The backend released by close(), if the handler owns it.
        self._owned_backend = None if owned_backend is None else as_backend(owned_backend)
        self._close_lock = threading.Lock()
        self._closed = False
        self._events = event_source(type(self).__name__, settings.run_id)

    def __enter__(self) -> DynamicRendezvousHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _record(
        self,
        method: str,
        message: str,
        node_state: NodeState = NodeState.RUNNING,
        *,
        rank: int | None = None,
    ) -> None:
        """Record an event of ``method`` for this node."""
        record_node_event(self._events, method, message, node_state, self._this_node, rank=rank)

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
        """Start the agent's shared ``TCPStore`` server (needs PyTorch)."""
        # Imported by name: PyTorch is optional and must not be imported at import time.
        dist = importlib.import_module("torch.distributed")
        return dist.TCPStore(
            host_name=master_addr, port=master_port, is_master=True, multi_tenant=True
        )

    def _start_tcp_store_server(self, master_addr: str, *, same_port: bool) -> None:
        """Start a new, empty shared ``TCPStore`` server: with ``same_port``, on the port
        of this node's last one (where PyTorch's nodes of an earlier round still look
        for it) if it can, else on a free port.

        The server is held by the handler alone (no local variable: a frame kept alive
        by a traceback would keep it running after :meth:`_stop_tcp_store_server`).
        """
        port = self._tcp_store_port if same_port else 0
        if port:
            try:
                self._shared_tcp_store_server = self._create_tcp_store_server(master_addr, port)
            except Exception as exc:  # torch's DistNetworkError (a RuntimeError), say
                logger.warning(
                    "The node '%s' could not start the shared TCPStore on %s:%d again (%s); "
                    "using a new port: PyTorch nodes of an earlier round that keep the old "
                    "one will not reach it.",
                    self._this_node,
                    master_addr,
                    port,
                    exc,
                )
            else:
                return
        self._shared_tcp_store_server = self._create_tcp_store_server(master_addr, 0)
        self._tcp_store_port = self._shared_tcp_store_server.port

    def _stop_tcp_store_server(self) -> bool:
        """Stop the shared ``TCPStore`` server this node hosts, if any. Returns whether
        its port is free for a new server (``False``: the old one still runs).

        A ``TCPStore`` has no close(): its server stops, closing its port and its
        clients' connections, when the last reference to it goes, which should be the
        handler's. Were another reference left, a new server on the same port would be
        the old one, with its keys (torch shares one server per port in a process).
        """
        server = self._shared_tcp_store_server
        if server is None:
            return True
        port = server.port
        try:
            still_running: weakref.ReferenceType[Any] | None = weakref.ref(server)
        except TypeError:  # not weak-referenceable: taken as stopped
            still_running = None
        del server
        self._shared_tcp_store_server = None
        if still_running is None or still_running() is None:
            logger.debug(
                "The node '%s' stopped its shared TCPStore on port %d", self._this_node, port
            )
            return True
        logger.warning(
            "The shared TCPStore of the node '%s' on port %d is still referenced elsewhere in "
            "this process: it keeps running, and the next one takes a new port.",
            self._this_node,
            port,
        )
        return False

    @property
    def settings(self) -> RendezvousSettings:
        """Get the settings of the rendezvous."""
        return self._settings

    def get_backend(self) -> str:
        """See base class."""
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        """Whether rank 0 hosts a ``TCPStore`` shared with the trainers.

        As in PyTorch, true unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; but a
        ``TCPStore`` needs PyTorch, so without it installed this is always false.
        """
        return os.getenv(_DISABLE_SHARED_STORE_ENV, "0") != "1" and torch_available()

    @_records_failure
    def next_rendezvous(self) -> RendezvousInfo:
        """See base class.

        Joins within ``join_timeout`` (plus about a second), whatever the ``etcd-v2``
        backend does: every call to it is given the join deadline, and retries failures
        such as an etcd election until then. A node of ours that times out then takes
        up to a second more to withdraw, lest a batch admit it after it gave up (see the
        documentation, "A node whose join timed out"). Only a node on the redundancy
        list waits on past it (it then has a whole ``join_timeout`` again from leaving
        the list). The
        exchange of rank 0's address that follows is bounded by what is left of that
        deadline (at least the heartbeat lifetime, ``keep_alive_interval x
        keep_alive_max_attempt``, after which a silent rank 0 counts as dead) when the
        store is an
        :class:`~etcd_rendezvous.etcd_store.EtcdStore`, by the store's timeout otherwise,
        and raises :class:`~etcd_rendezvous.api.RendezvousTimeoutError` naming the round,
        its rank 0 and the key (PyTorch waits for the store's timeout, 300 s by default,
        and raises the store's error).

        A state write that etcd refuses as larger than its ``--max-request-bytes``
        raises :class:`~etcd_rendezvous.api.RequestTooLargeError`, in every node that
        waited for it too, within seconds (see the documentation, "etcd's limits").
        """
        join = self._settings.timeout.join
        deadlines = [self._get_deadline(join)]

        def renew() -> Deadline:
            # Leaving the redundancy list starts a new join_timeout (as in PyTorch).
            deadlines.append(self._get_deadline(join))
            return deadlines[-1]

        self._begin_attempt(deadlines[0])
        started = time.monotonic()
        with self._joining(deadlines[0]):
            self._op_executor.run(ExitOp(), deadlines[0])
            self._op_executor.run(JoinOp(), deadlines[0], renew)
        # The round joined, read before the first heartbeat, which may come at once and
        # replace the state held.
        joined = self._state_holder.state
        self._start_heartbeats()

        rank, world_size = joined.participants[self._this_node], len(joined.participants)
        self._record_round_metrics(time.monotonic() - started, world_size)
        round_ = joined.round
        store = self._round_store(self._store, round_)
        rank_0 = min(joined.participants, key=joined.participants.__getitem__)
        # Rank 0 publishes its address as soon as it sees the round complete: the
        # exchange gets at least a heartbeat lifetime (a rank 0 silent for longer is
        # taken for dead) even if the round completed right at the deadline.
        lifetime = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        exchange = Deadline(max(deadlines[-1].remaining(), lifetime.total_seconds()))
        try:
            exchange_store = self._exchange_store(exchange, round_)
            return self._bootstrap(round_, rank, world_size, store, exchange_store)
        except LookupError as exc:  # the exchange's bound passed: rank 0 never published
            raise RendezvousTimeoutError(self._exchange_failure(exc, round_, rank_0)) from exc

    def _exchange_store(self, exchange: Deadline, round_: int) -> Store:
        """The store of round ``round_`` for the exchange of rank 0's address: the round's, each
        of its calls bounded by ``exchange`` too when it is an
        :class:`~etcd_rendezvous.etcd_store.EtcdStore` (also inside a
        :class:`~etcd_rendezvous.torch_store.TorchEtcdStore`): a view of it, which costs
        no request. Another store bounds the exchange by its own timeout.

        Invariants: liveness: a node whose round's rank 0 died, froze or was dropped
        before it published fails within ``join_timeout`` (or a heartbeat lifetime
        after the round completed, if later), not the store's timeout; the exchange
        sends exactly the requests it sends without a bound (the same reads and
        watches: the scale tests count them); the workers get the round's store,
        unbounded. Interleavings: rank 0 publishes after
        another rank's bound passed (that rank fails with the error below; rank 0 and
        the others go on, and the failed node's next attempt takes them all to a new
        round, as any member's failure does); a round completed right at the deadline
        (the heartbeat lifetime); a node admitted from the redundancy list (its renewed deadline).
        """
        bounded = bounded_store(self._store, exchange)
        return self._round_store(self._store if bounded is None else bounded, round_)

    def _exchange_failure(self, exc: LookupError, round_: int, rank_0: _NodeDesc) -> str:
        """The message of a failed exchange of rank 0's address after round ``round_``
        completed (``exc``, the store's error), with why the address never came, if the
        state as it is now tells: this node or rank 0 (``rank_0``) is no longer a
        participant of the round."""
        run_id = self._settings.run_id
        key = f"{dynamic_store_prefix(run_id, round_)}/{RendezvousStoreInfo.MASTER_ADDR_KEY}"
        notes = [
            f"The node '{self._this_node}' did not get the address of rank 0 of round "
            f"{round_} of the rendezvous '{run_id}', the node '{rank_0}' (store key "
            f"'{key}'): {exc}",
            f"Rank 0 of round {round_} publishes its address once the round completed.",
        ]
        holder = self._state_holder
        deadline = Deadline(_WITHDRAW_TIMEOUT)
        try:
            with self._locked(deadline, "read the state of"):
                holder.invalidate()  # the state now, not the one held
                holder.sync(deadline)
                now_round, participants = holder.state.round, set(holder.state.participants)
        except RendezvousError:  # nothing more is known
            now_round, participants = round_, {self._this_node, rank_0}
        if now_round != round_ or self._this_node not in participants:
            notes.append(
                f"This node is no longer a participant of round {round_} of the rendezvous "
                f"'{run_id}' (its state is at round {now_round}): it was dropped from the "
                "round (its heartbeat lapsed), or the round ended, while it waited."
            )
        elif rank_0 not in participants:
            notes.append(
                f"Rank 0 of round {round_}, the node '{rank_0}', is no longer one of its "
                "participants: it was dropped (its heartbeat lapsed), or left, before it "
                "published its address."
            )
        return " ".join(notes)

    def _begin_attempt(self, deadline: Deadline) -> None:
        """Report the attempt, stop the heartbeats and take the handler's lock (all by
        ``deadline``); without node keys, spread the first attempts as PyTorch does."""
        msg = (
            f"The node '{self._this_node}' attempts to join the next round of the rendezvous "
            f"'{self._settings.run_id}'."
        )
        self._record("next_rendezvous", msg)
        logger.info(msg)

        # A heartbeat in progress ends by its own deadline; we wait no longer than ours.
        self._stop_heartbeats(deadline)
        with self._locked(deadline, "join"):
            pass

        # PyTorch delays its first attempt by a random 0-0.3 s, to spread the nodes'
        # compare-and-swaps of the state. A node that announces itself with a node key
        # writes no state to join, so it does not wait.
        if self._admission is None and self._state_holder.state.round == 0:
            delay(seconds=(0, 0.3))

    @contextlib.contextmanager
    def _joining(self, deadline: Deadline) -> Iterator[None]:
        """The block in which the node joins: progress lines logged, and with node keys,
        the node waits on the progress key. On a failure other than etcd out of reach,
        withdraw the node's key (if it has one), lest a batch admit it after all."""
        admission = self._admission
        if admission is not None:
            admission.begin()
            holder = self._state_holder
            if holder.token is None and holder.fetches == 0:
                # A fresh node (in no round, never read the state) announces itself and
                # waits on the progress key: it reads the state once the key says so (a
                # batch admitted it, or it must make one), not before.
                holder.keep()
        progress = ProgressLog(
            lambda: self._describe_progress(deadline),
            progress_interval(self._settings.timeout.join.total_seconds()),
            run_id=self._settings.run_id,
            log=logger,
        )
        try:
            with progress:
                yield
        except RendezvousConnectionError:
            raise  # etcd is out of reach: the key expires on its own.
        except BaseException:
            self._withdraw(Deadline(_WITHDRAW_TIMEOUT))
            raise
        finally:
            if admission is not None:
                admission.end()

    def _record_round_metrics(self, seconds: float, world_size: int) -> None:
        """The ``rendezvous.*`` metrics of a round this node completed (see
        :mod:`etcd_rendezvous.metrics`)."""
        labels = {"backend": self._backend_name}
        participants = set(self._state_holder.state.participants)
        previous = self._last_participants
        self._last_participants = participants
        record_metric("rendezvous.rounds", **labels)
        record_metric("rendezvous.time_to_form", seconds, MetricKind.TIMING, **labels)
        record_metric("rendezvous.world_size", world_size, MetricKind.GAUGE, **labels)
        record_metric("rendezvous.nodes_admitted", len(participants - previous), **labels)
        record_metric("rendezvous.nodes_removed", len(previous - participants), **labels)

    def _describe_progress(self, deadline: Deadline) -> str | None:
        """The progress line of a waiting :meth:`next_rendezvous`, from the state last
        read (see :mod:`etcd_rendezvous._progress_log`)."""
        state = self._state_holder.state
        return progress_line(state, self._this_node, self._settings, deadline.remaining())

    def _bootstrap(
        self, round_: int, rank: int, world_size: int, store: Store, exchange_store: Store
    ) -> RendezvousInfo:
        """The end of :meth:`next_rendezvous` for round ``round_``: exchange the master
        address through ``exchange_store`` (see :meth:`_exchange_store`); the workers get
        ``store``."""
        msg = (
            f"The node '{self._this_node}' has joined round {round_} of "
            f"the rendezvous '{self._settings.run_id}' as rank {rank} in a world of size "
            f"{world_size}."
        )
        self._record("next_rendezvous", msg, rank=rank)
        logger.info(msg)

        if not self.use_agent_store:
            # Opted out of TCPStore sharing (or no PyTorch): rank 0 publishes a free port.
            bootstrap_store_info = RendezvousStoreInfo.build(
                rank, exchange_store, local_addr=self._this_node.addr
            )
            return RendezvousInfo(store, rank, world_size, bootstrap_store_info)

        # PyTorch builds the bootstrap info only in a node's first round, so a node
        # admitted in a later round waits for a MASTER_ADDR that rank 0 never publishes
        # under the new round's prefix (until the store times out). Here rank 0 hosts
        # the shared TCPStore and publishes its address every round, and the other ranks
        # read it every round. The server is a new one every round: torch's workers use
        # it without a prefix per attempt, so a server kept from the last round would
        # hand the new world's workers the last world's keys (gloo's addresses among
        # them: they fail to connect). But PyTorch's nodes other than rank 0 keep the
        # address and port of their first round, so the new server listens on the port
        # of the last one. A node no longer rank 0 stops its server.
        port_free = self._stop_tcp_store_server()
        if rank == 0:
            self._start_tcp_store_server(self._this_node.addr, same_port=port_free)
            self._bootstrap_store_info = RendezvousStoreInfo.build(
                rank,
                exchange_store,
                local_addr=self._this_node.addr,
                server_port=self._shared_tcp_store_server.port,
            )
        else:
            self._bootstrap_store_info = RendezvousStoreInfo.build(
                rank, exchange_store, local_addr=self._this_node.addr
            )

        return RendezvousInfo(store, rank, world_size, self._bootstrap_store_info)

    @_records_failure
    def is_closed(self) -> bool:
        """See base class. Ends within ``join_timeout`` (plus about a second)."""
        with self._synced(self._settings.timeout.join, "read the state of") as state:
            return state.closed

    @_records_failure
    def set_closed(self) -> None:
        """See base class. Ends within ``close_timeout`` (plus about a second)."""
        deadline = self._get_deadline(self._settings.timeout.close)
        with self._locked(deadline, "close"):
            self._close(deadline)

    @_records_failure
    def num_nodes_waiting(self) -> int:
        """See base class. Ends within ``join_timeout`` (plus about a second)."""
        if self._progress_says_none_waiting():
            return 0  # No need to read the whole state.
        with self._synced(self._settings.timeout.join, "read the state of") as state:
            self._waiting_read_at = time.monotonic()
            return len(state.wait_list)

    def _progress_says_none_waiting(self) -> bool:
        """Whether the progress key says that no node waits, trusted for
        ``_WAITING_RECHECK`` s after a read of the whole state and read every
        ``_WAITING_POLL`` s at most (polls come often: torchrun, 10 a second)."""
        admission, now = self._admission, time.monotonic()
        holder = self._state_holder
        cached = isinstance(holder, BackendStateHolder) and holder.cached
        if admission is None or cached or now - self._waiting_read_at >= _WAITING_RECHECK:
            return False
        at, none_waiting = self._waiting_hint
        if now - at < _WAITING_POLL:
            return none_waiting
        deadline = self._get_deadline(self._settings.timeout.join)
        with self._locked(deadline, "read the progress of"):
            token = holder.token
            progress = admission.waiting_hint(token, deadline)
        if progress is not None and progress.token == token:
            holder.keep()  # The state held is still the latest: no need to read it.
        none_waiting = progress is not None and progress.waiting == 0
        self._waiting_hint = (now, none_waiting)
        return none_waiting

    @contextlib.contextmanager
    def _synced(self, timeout: timedelta, what: str) -> Iterator[_RendezvousState]:
        """The state, synced with the backend within ``timeout``."""
        deadline = self._get_deadline(timeout)
        with self._locked(deadline, what):
            self._state_holder.sync(deadline)
            yield self._state_holder.state

    @contextlib.contextmanager
    def _locked(self, deadline: Deadline, what: str) -> Iterator[None]:
        """Hold the heartbeat lock, waiting for it (a heartbeat in progress) no later
        than ``deadline``.

        Raises:
            RendezvousTimeoutError: the lock was not free by ``deadline``.
        """
        if not self._heartbeat_lock.acquire(timeout=deadline.remaining()):
            raise RendezvousTimeoutError(
                f"Could not {what} the rendezvous '{self._settings.run_id}' in time: a "
                "keep-alive heartbeat held on to the backend until the deadline."
            )
        try:
            yield
        finally:
            self._heartbeat_lock.release()

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    @_records_failure
    def shutdown(self) -> bool:
        """Stop the keep-alive thread and close the rendezvous.

        As in PyTorch, the backend stays open; :meth:`close` releases it.

        Returns:
            Whether the rendezvous could be closed; the thread is stopped either way.
        """
        deadline = self._get_deadline(self._settings.timeout.close)
        self._stop_heartbeats(deadline)

        try:
            with self._locked(deadline, "close"):
                self._close(deadline)
                self._withdraw(deadline)
        except RendezvousError as ex:
            msg = (
                f"The node '{self._this_node}' has failed to shutdown the rendezvous "
                f"'{self._settings.run_id}' due to an error of type {type(ex).__name__}."
            )
            self._record("shutdown", msg, NodeState.FAILED)
            logger.warning(msg)
            return False
        return True

    def close(self) -> None:
        """Stop the keep-alive thread and close the backend if the handler owns it.

        Unlike :meth:`shutdown`, the rendezvous is not closed for the other nodes: they
        see this node's heartbeats stop. Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_heartbeats()
        self._withdraw(Deadline(_WITHDRAW_TIMEOUT))
        if self._owned_backend is not None:
            self._owned_backend.close()

    def _withdraw(self, deadline: Deadline) -> None:
        """Delete the node's key (with node keys), by ``deadline``; a failure is only
        logged: the key expires on its own."""
        if self._admission is None:
            return
        try:
            self._admission.withdraw(deadline)
        except RendezvousError as ex:
            logger.warning(
                "The node '%s' could not delete its key from the rendezvous '%s' (%s: %s); "
                "it expires on its own.",
                self._this_node,
                self._settings.run_id,
                type(ex).__name__,
                ex,
            )

    def _close(self, deadline: Deadline) -> None:
        self._op_executor.run(CloseOp(), deadline)
        msg = f"The node '{self._this_node}' has closed the rendezvous '{self._settings.run_id}'."
        self._record("_close", msg, NodeState.SUCCEEDED)
        logger.info(msg)

    @staticmethod
    def _keep_alive_weak(weak_self: weakref.ref[DynamicRendezvousHandler]) -> float | None:
        self = weak_self()
        return None if self is None else self._keep_alive()

    def _keep_alive(self) -> float | None:
        """One heartbeat; returns the seconds within which the next one is due, if
        sooner than the interval (a node with a key whose heartbeat in the state will be
        due for its own write before then, see :meth:`.OpExecutor.heartbeat_due`)."""
        with self._heartbeat_lock:
            deadline = self._get_deadline(self._settings.timeout.heartbeat)
            try:
                self._op_executor.run(KeepAliveOp(), deadline)
            except (RendezvousConnectionError, RendezvousTimeoutError) as ex:
                # Transient: the next heartbeat tries again.
                self._record_heartbeat_failure(ex)
                logger.warning(
                    "The node '%s' has failed to send a keep-alive heartbeat to the rendezvous "
                    "'%s' due to an error of type %s (%s); will retry.",
                    self._this_node,
                    self._settings.run_id,
                    type(ex).__name__,
                    ex,
                )
            except Exception as ex:
                self._record_heartbeat_failure(ex)
                logger.exception(
                    "The node '%s' has failed to send a keep-alive heartbeat to the rendezvous "
                    "'%s'; will retry.",
                    self._this_node,
                    self._settings.run_id,
                )
            else:
                self._record(
                    "_keep_alive",
                    f"The node '{self._this_node}' has sent a keep-alive heartbeat to "
                    f"the rendezvous '{self._settings.run_id}'.",
                )
                logger.debug(
                    "The node '%s' has sent a keep-alive heartbeat to the rendezvous '%s'.",
                    self._this_node,
                    self._settings.run_id,
                )
                return self._op_executor.heartbeat_due()
            return None

    def _record_heartbeat_failure(self, ex: Exception) -> None:
        self._record(
            "_keep_alive",
            f"The node '{self._this_node}' has failed to send a keep-alive heartbeat to "
            f"the rendezvous '{self._settings.run_id}' due to an error of type "
            f"{type(ex).__name__}.",
            NodeState.FAILED,
        )

    def _start_heartbeats(self) -> None:
        with self._timer_lock:
            if self._keep_alive_timer is not None:
                self._keep_alive_timer.cancel()
            self._keep_alive_timer = _PeriodicTimer(
                self._settings.keep_alive_interval, self._keep_alive_weak, weakref.ref(self)
            )
            self._keep_alive_timer.set_name(f"RendezvousKeepAliveTimer_{self._this_node.local_id}")
            # Sooner than an interval if the node's heartbeat in the state it joined
            # with falls due before then (see OpExecutor.heartbeat_due).
            self._keep_alive_timer.start(first=self._op_executor.heartbeat_due())

    def _stop_heartbeats(self, deadline: Deadline | None = None) -> None:
        """Stop the keep-alive timer, waiting for a heartbeat in progress to end (no
        later than ``deadline``, if given). A heartbeat still in progress at the
        deadline keeps its timer, so that the next stop (:meth:`close`'s, before the
        backend's connection revokes its leases) or start waits for it."""
        with self._timer_lock:
            if self._keep_alive_timer is None:
                return
            timeout = None if deadline is None else deadline.remaining()
            if self._keep_alive_timer.cancel(timeout):
                self._keep_alive_timer = None

    def _round_store(self, store: Store, round_: int) -> Store:
        """``store`` as round ``round_`` sees it (below the round's prefix)."""
        return prefix_store(dynamic_store_prefix(self._settings.run_id, round_), store)

    def _get_deadline(self, timeout: timedelta) -> Deadline:
        return Deadline(timeout.total_seconds())


def _get_timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    timeout = params.get_as_int(key + "_timeout")
    if timeout is None:
        return None
    return timedelta(seconds=timeout)


def create_handler(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    *,
    backend_name: str | None = None,
    owns_backend: bool = False,
) -> DynamicRendezvousHandler:
    """Create a new :class:`DynamicRendezvousHandler` from the specified parameters.

    Args:
        store: The c10d store to return as part of the rendezvous. An
            :class:`~etcd_rendezvous.etcd_store.EtcdStore` is handed out as a
            :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` when PyTorch is
            installed (see ``torch_store`` below).
        backend: The backend to use to hold the rendezvous state.
        backend_name: What the handler's ``get_backend()`` reports; ``backend.name``
            if ``None``.
        owns_backend: Whether the handler's ``close()`` closes ``backend`` (and with it
            the connection :func:`~etcd_rendezvous.etcd_rendezvous_backend.create_backend`
            opened); set it when handing over a backend nobody else closes. The backend
            is then also closed if this function raises.
        params: The rendezvous parameters; these options are read from its config:

    +--------------------------+--------------------------------------------------------+
    | Parameter                | Description                                            |
    +==========================+========================================================+
    | join_timeout             | The total time, in seconds, within which the           |
    |                          | rendezvous is expected to complete. Defaults to 600.   |
    +--------------------------+--------------------------------------------------------+
    | last_call_timeout        | An additional wait amount, in seconds, before          |
    |                          | completing the rendezvous once the minimum number of   |
    |                          | nodes has been reached. Defaults to 30.                |
    +--------------------------+--------------------------------------------------------+
    | close_timeout            | The time, in seconds, within which the rendezvous is   |
    |                          | expected to close after a call to ``set_closed`` or    |
    |                          | ``shutdown``. Defaults to 30.                          |
    +--------------------------+--------------------------------------------------------+
    | heartbeat_timeout        | The time, in seconds, within which a keep-alive        |
    |                          | heartbeat is expected to complete. Defaults to 5.      |
    +--------------------------+--------------------------------------------------------+
    | keep_alive_interval      | Seconds between heartbeats. Defaults to 5.             |
    +--------------------------+--------------------------------------------------------+
    | keep_alive_max_attempt   | Missed heartbeats after which a node is dead.          |
    |                          | Defaults to 3.                                         |
    +--------------------------+--------------------------------------------------------+
    | torch_store              | ``auto``, ``true`` or ``false``: whether an            |
    |                          | ``EtcdStore`` is handed out as a                       |
    |                          | ``torch.distributed.Store``. ``auto`` (the default)    |
    |                          | does so when PyTorch is installed.                     |
    +--------------------------+--------------------------------------------------------+

    Raises:
        ValueError: An option is invalid; the message names it.
        TypeError: ``keep_alive_interval`` or ``keep_alive_max_attempt`` is ``None``.
    """
    try:
        serve_metrics_from_environment()
        return _handler_from_params(store, backend, params, backend_name, owns_backend)
    except BaseException as e:
        if isinstance(e, Exception):
            event_source("", params.run_id).record(
                "create_handler", f"{type(e).__name__}: {e}", NodeState.FAILED
            )
        if owns_backend:
            as_backend(backend).close()
        raise


def _handler_from_params(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    backend_name: str | None,
    owns_backend: bool,
) -> DynamicRendezvousHandler:
    """The body of :func:`create_handler`: read the options, then build the handler."""
    timeout = RendezvousTimeout(
        _get_timeout(params, "join"),
        _get_timeout(params, "last_call"),
        _get_timeout(params, "close"),
        _get_timeout(params, "heartbeat"),
    )
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    if keep_alive_interval is None:
        raise TypeError(
            "You passed 'keep_alive_interval=None' as a rendezvous configuration option"
        )
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive_max_attempt is None:
        raise TypeError(
            "You passed 'keep_alive_max_attempt=None' as a rendezvous configuration option"
        )

    store = adapt_store(store, torch_store_wanted(params))

    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
        backend_name=backend_name,
        owns_backend=owns_backend,
    )


def progress_line(
    state: _RendezvousState, node: _NodeDesc, settings: RendezvousSettings, remaining: float
) -> str | None:
    """The progress line of ``node`` waiting in ``next_rendezvous()`` with ``remaining``
    seconds left, from ``state`` as it last read it; ``None``: nothing to say (the round
    is closed, or complete with the node, whose call is returning)."""
    head = f"Rendezvous '{settings.run_id}' round {state.round}"
    joined = len(state.participants)
    left = seconds_left(remaining)
    if state.closed or (state.complete and node in state.participants):
        return None
    if node in state.redundancy_list:
        return (
            f"{head}: complete with {joined} nodes, the most it takes; this node is on "
            "the redundancy list, waiting for a place"
        )
    if state.complete:
        return (
            f"{head}: complete with {joined} nodes without this node; waiting for the "
            f"next round ({len(state.wait_list)} nodes waiting); {left}"
        )
    if joined < settings.min_nodes:
        wants = f"waiting for {settings.min_nodes - joined} more"
    else:
        wants = "in its last call for more nodes"
    return (
        f"{head}: {joined} of {settings.min_nodes} nodes joined (max {settings.max_nodes}), "
        f"{wants}; {left}"
    )
