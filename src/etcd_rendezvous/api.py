"""Public rendezvous interface, ported from ``torch.distributed.elastic.rendezvous.api``.

The names, signatures, validation and error messages match PyTorch 2.13 so that code
written against torch's module works unchanged with this one. The only torch type the
original depends on, ``torch.distributed.Store``, is replaced by the :class:`Store`
protocol, which any c10d-compatible store satisfies.
"""

from __future__ import annotations

import logging
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol

__all__ = [
    "Deadline",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "RequestTooLargeError",
    "Store",
    "rendezvous_handler_registry",
]

logger = logging.getLogger(__name__)


class Store(Protocol):
    """The subset of the c10d ``Store`` interface that rendezvous code relies on.

    Any c10d-compatible store works: ``torch.distributed.TCPStore``, ``FileStore``,
    ``PrefixStore`` or this package's ``EtcdStore``, without importing torch here.
    Parameters are positional-only so that implementations are free to name them
    (torch's ``EtcdStore.wait`` calls its timeout ``override_timeout``).
    """

    def set(self, key: str, value: bytes | str, /) -> None:
        """Write ``value`` under ``key``, overwriting any previous value."""

    def get(self, key: str, /) -> bytes:
        """Return the value under ``key``, waiting for it to be set if necessary."""

    def add(self, key: str, value: int, /) -> int:
        """Atomically add ``value`` to the counter under ``key`` and return the result."""

    def wait(self, keys: list[str], timeout: timedelta | None = None, /) -> None:
        """Block until every key in ``keys`` is set, or ``timeout`` elapses."""

    def check(self, keys: list[str], /) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""


class RendezvousError(Exception):
    """Represents the base type for rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """Raised when a rendezvous is closed."""


class RendezvousTimeoutError(RendezvousError):
    """Raised when a rendezvous did not complete on time."""


class RendezvousConnectionError(RendezvousError):
    """Raised when the connection to a rendezvous backend has failed."""


class RendezvousStateError(RendezvousError):
    """Raised when the state of a rendezvous is corrupt."""


class RendezvousGracefulExitError(RendezvousError):
    """Raised when node wasn't included in rendezvous and gracefully exits.

    Exception is a mechanism to exit the stack, however does not mean a failure.
    """


class RequestTooLargeError(RendezvousError):
    """Raised when etcd refused a write as larger than it accepts: a rendezvous state (or
    a store value) that outgrew etcd's ``--max-request-bytes``.

    Not one of PyTorch's classes. A configuration error, never retried: the message
    names the key, the size of the request, etcd's answer, the endpoint and the flag
    that raises the limit. Every node waiting for the refused write raises it too (see
    the documentation's "etcd's limits"). Where PyTorch's rendezvous is loaded it is
    also PyTorch's ``RendezvousError``, which ends torch's agent.

    Args:
        message: what was refused, and what to do.
        key: the etcd key written.
        size: the bytes of the request as etcd counts them, roughly (v3: its keys and
            values; v2: its form).
        endpoint: the etcd endpoint that refused it.
        answer: etcd's answer.
        api: the etcd API of the request (``v2`` or ``v3``).
    """

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        size: int = 0,
        endpoint: str = "",
        answer: str = "",
        api: str = "",
    ) -> None:
        super().__init__(message)
        #: The etcd key written.
        self.key = key
        #: The bytes of the request, as etcd counts them, roughly.
        self.size = size
        #: The etcd endpoint that refused it, and its answer.
        self.endpoint = endpoint
        self.answer = answer
        #: The etcd API of the request (``v2`` or ``v3``).
        self.api = api


class Deadline:
    """A point in monotonic time: made once from a caller's timeout and passed down to
    every etcd request and wait made on the caller's behalf, each of which uses what
    remains of it.

    Not one of PyTorch's classes. The store's
    :meth:`~etcd_rendezvous.etcd_store.EtcdStore.with_deadline` takes one.

    Args:
        seconds: how far from now the deadline is.
        clock: the monotonic clock, replaceable in tests.
    """

    __slots__ = ("_at", "_clock", "_seconds")

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seconds = seconds
        self._at = clock() + seconds

    @classmethod
    def at(cls, when: float, *, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """The deadline at ``when``, a reading of ``clock`` (``time.monotonic()`` seconds).

        For code that keeps deadlines as raw monotonic times, as PyTorch's dynamic
        rendezvous does.
        """
        deadline = cls(0.0, clock=clock)
        deadline._seconds = when - deadline._at
        deadline._at = when
        return deadline

    @classmethod
    def never(cls) -> Deadline:
        """A deadline far enough in the future to mean 'no deadline'."""
        return cls(10.0 * 365 * 24 * 3600)

    @property
    def seconds(self) -> float:
        """The time the deadline was set to from its creation, in seconds."""
        return self._seconds

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self._at - self._clock())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self._clock() >= self._at

    def earlier(self, other: Deadline) -> Deadline:
        """The earlier of this deadline and ``other``."""
        return self if self.remaining() <= other.remaining() else other

    def earliest(self, seconds: float) -> Deadline:
        """The earlier of this deadline and ``seconds`` from now."""
        other = Deadline(seconds, clock=self._clock)
        return self if self._at <= other._at else other

    def __repr__(self) -> str:
        return f"Deadline(remaining={self.remaining():.3f})"


def _get_free_port() -> int:
    """Return a port on localhost that was unused a moment ago.

    Binds an ephemeral port and releases it, like torch's ``get_free_port``. The port
    is not reserved, so another process may take it before the caller binds it.

    Raises:
        RuntimeError: No address family of ``localhost`` could bind a socket.
    """
    addrs = socket.getaddrinfo(
        host="localhost", port=None, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM
    )
    for family, sock_type, proto, _, _ in addrs:
        sock = socket.socket(family, sock_type, proto)
        with closing(sock):
            try:
                sock.bind(("localhost", 0))
                sock.listen(0)
            except OSError:
                logger.debug("Could not bind a socket for family %s.", family, exc_info=True)
                continue
            port: int = sock.getsockname()[1]
            return port
    raise RuntimeError("Failed to create a socket")


@dataclass
class RendezvousStoreInfo:
    """Store address and port that can be used to bootstrap trainer distributed comms.

    Rank 0 publishes them in the rendezvous store under :attr:`MASTER_ADDR_KEY` and
    :attr:`MASTER_PORT_KEY`; the other ranks read them back from there.
    """

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    """Store key under which rank 0 publishes the master address."""

    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"
    """Store key under which rank 0 publishes the master port."""

    master_addr: str
    master_port: int

    @staticmethod
    def build(
        rank: int,
        store: Store,
        local_addr: str | None,
        server_port: int | None = None,
    ) -> RendezvousStoreInfo:
        """Publish (on rank 0) and read (on every rank) the master address and port.

        Rank 0 picks an unused port on its host unless ``server_port`` is given. If the
        master address and port are already known, use the constructor instead.

        Args:
            rank: Rank of the current node.
            store: Store to use for the exchange.
            local_addr: Address of the current node; resolved from the hostname if not
                provided.
            server_port: Port of the TCPStore server, when the TCPStore is shared.

        Returns:
            The address and port published by rank 0.
        """
        if rank == 0:
            addr = local_addr or socket.getfqdn()
            # When the TCPStore is not shared, fall back to a free port.
            port = server_port or _get_free_port()
            # The port first: a rank that finds the address (read first) finds the port
            # too, so that it waits for one key, not two.
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode(encoding="UTF-8"))
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode(encoding="UTF-8"))

        addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(encoding="UTF-8")
        port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode(encoding="UTF-8"))
        return RendezvousStoreInfo(master_addr=addr, master_port=port)


class RendezvousInfo:
    """Holds the information about the rendezvous.

    Returned by :meth:`RendezvousHandler.next_rendezvous` once the worker group formed.

    Args:
        store: Store used by the torchelastic control plane.
        rank: Rank of this node within the group.
        world_size: Global group size.
        bootstrap_store_info: Where trainer code can bootstrap distributed comms.
    """

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> Store:
        """Store used by torchelastic control plane."""
        return self._store

    @property
    def rank(self) -> int:
        """Rank within a group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Global group size."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Store information that can used by trainer code to bootstrap distributed comms."""
        return self._bootstrap_store_info


class RendezvousHandler(ABC):
    """Main rendezvous interface.

    Note:
        Users normally **do not** need to implement their own ``RendezvousHandler``;
        use the one created for the ``etcd`` backend by the handler registry.
    """

    @abstractmethod
    def get_backend(self) -> str:
        """Return the name of the rendezvous backend."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the store returned by :meth:`next_rendezvous` can be shared with users.

        If true, the store stays available for the application's lifetime and its
        details are shared as a :class:`RendezvousStoreInfo`; applications by convention
        look it up through the ``MASTER_ADDR``/``MASTER_PORT`` environment variables.
        """
        return False

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Main entry-point into the rendezvous barrier.

        Blocks until the rendezvous is complete and the current process is included in
        the formed worker group, or a timeout occurs, or the rendezvous was marked
        closed.

        Returns:
            Instance of :class:`RendezvousInfo`.

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousConnectionError: The connection to the rendezvous backend has
                failed.
            RendezvousStateError: The rendezvous state is corrupt.
            RendezvousTimeoutError: The rendezvous did not complete on time.
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Check whether the rendezvous has been closed.

        A closed rendezvous means all future attempts to re-rendezvous within the same
        job will fail. ``is_closed()`` and :meth:`set_closed` propagate eventually and
        must not be used for synchronization: once one node decides the job is
        finished it closes the rendezvous, and the others soon observe it and stop.
        """

    @abstractmethod
    def set_closed(self) -> None:
        """Mark the rendezvous as closed."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """Return the number of nodes that arrived late at the rendezvous barrier.

        Those nodes were not included in the current worker group. Callers should poll
        this and, when it is non-zero, admit them by calling :meth:`next_rendezvous`
        again (re-rendezvous).
        """

    @abstractmethod
    def get_run_id(self) -> str:
        """Return the run id of the rendezvous.

        The run id is a user-defined id that uniquely identifies an instance of a
        distributed application, typically a job id, so nodes join the right one.
        """

    @abstractmethod
    def shutdown(self) -> bool:
        """Close all resources that were open for the rendezvous.

        Example::

            rdzv_handler = ...
            try:
                store, rank, world_size = rdzv_handler.next_rendezvous()
            finally:
                rdzv_handler.shutdown()
        """


class RendezvousParameters:
    """Hold the parameters to construct a :class:`RendezvousHandler`.

    Backend-specific options arrive through ``**kwargs`` and are kept in
    :attr:`config`; torchrun passes them as strings, hence the typed getters.

    Args:
        backend: The name of the backend to use to handle the rendezvous.
        endpoint: The endpoint of the rendezvous, usually in form <hostname>[:<port>].
        run_id: The id of the rendezvous.
        min_nodes: The minimum number of nodes to admit to the rendezvous.
        max_nodes: The maximum number of nodes to admit to the rendezvous.
        local_addr: The address of the local node.
        **kwargs: Additional parameters for the specified backend.

    Raises:
        ValueError: ``backend`` is empty, ``min_nodes`` is less than one, or
            ``max_nodes`` is less than ``min_nodes``.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")

        if min_nodes < 1:
            raise ValueError(
                f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero."
            )
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or "
                f"equal to the minimum number of rendezvous nodes ({min_nodes})."
            )

        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.config: dict[str, Any] = kwargs
        self.local_addr = local_addr

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value for ``key`` if ``key`` exists, else ``default``."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return the value for ``key`` as a ``bool``.

        Accepts booleans, the integers 0 and 1, and (case-insensitively) the strings
        ``1/true/t/yes/y`` and ``0/false/f/no/n``.

        Raises:
            ValueError: The value is none of the above; the message names ``key``.
        """
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value == 1:
                return True
            if value == 0:
                return False
        elif isinstance(value, str):
            if value.lower() in ["1", "true", "t", "yes", "y"]:
                return True
            if value.lower() in ["0", "false", "f", "no", "n"]:
                return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean value."
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the value for ``key`` as an ``int``.

        The value is converted with ``int()``, so the string ``"30"`` gives ``30``.

        Raises:
            ValueError: The value cannot be converted; the message names ``key``.
        """
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid "
                "integer value."
            ) from exc


RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]
"""A callable that builds a :class:`RendezvousHandler` from :class:`RendezvousParameters`."""


class RendezvousHandlerRegistry:
    """Represent a registry of :class:`RendezvousHandler` backends.

    Maps backend names (the ``--rdzv-backend`` of torchrun) to creators, so launchers
    can build a handler from parameters without knowing the implementation.
    """

    _registry: dict[str, RendezvousHandlerCreator]

    def __init__(self) -> None:
        self._registry = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register a new rendezvous backend.

        Registering the same creator twice is a no-op.

        Args:
            backend: The name of the backend.
            creator: The callback to invoke to construct the :class:`RendezvousHandler`.

        Raises:
            ValueError: ``backend`` is empty, or already registered with another creator.
        """
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")

        current_creator = self._registry.get(backend)
        if current_creator is not None and current_creator != creator:
            raise ValueError(
                f"The rendezvous backend '{backend}' cannot be registered with '{creator}' as it "
                f"is already registered with '{current_creator}'."
            )

        self._registry[backend] = creator

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Create a new :class:`RendezvousHandler` for ``params.backend``.

        Raises:
            ValueError: The backend is not registered.
            RuntimeError: The created handler reports a different backend name.
        """
        try:
            creator = self._registry[params.backend]
        except KeyError as exc:
            raise ValueError(
                f"The rendezvous backend '{params.backend}' is not registered. Did you forget "
                f"to call `{self.register.__name__}`?"
            ) from exc

        handler = creator(params)

        # Guard against a creator registered under the wrong name.
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                f"The rendezvous backend '{handler.get_backend()}' does not match the requested "
                f"backend '{params.backend}'."
            )

        return handler


rendezvous_handler_registry = RendezvousHandlerRegistry()
"""The default global registry, used by launcher scripts to instantiate handlers."""
