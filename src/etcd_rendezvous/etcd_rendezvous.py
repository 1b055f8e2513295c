"""The legacy ``etcd`` rendezvous backend, ported from PyTorch Elastic.

The names PyTorch's users import from
``torch.distributed.elastic.rendezvous.etcd_rendezvous``: the handler
(:class:`EtcdRendezvousHandler`, made by :func:`create_rdzv_handler` from a URL or
:class:`~etcd_rendezvous.api.RendezvousParameters`), the rendezvous it drives
(:class:`EtcdRendezvous`), its retry signals and PyTorch's TTL constants. The key
layout, the JSON state and the TTLs are PyTorch's, so this module's workers and
PyTorch's join the same rendezvous; how it works: :doc:`how-it-works`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# The CONST_* TTLs are PyTorch's names, importable from here as from PyTorch's module.
from ._legacy.rendezvous import (
    CONST_RUNID_SUBROOT_TTL,  # noqa: F401
    EtcdRendezvous,
    EtcdRendezvousRetryableFailure,
    EtcdRendezvousRetryImmediately,
)
from ._legacy.state import (
    CONST_ETCD_FROZEN_TTL,  # noqa: F401
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,  # noqa: F401
    CONST_ETCD_SETUP_TTL,  # noqa: F401
    CONST_WORKER_KEEPALIVE_TTL,
    member_ranks,
    parse_state,
)
from ._torch_errors import torch_errors
from ._torch_store import adapt_store, load_torch_store, torch_available, torch_store_wanted
from ._transport.interface import KeyNotFoundError
from ._transport.options import create_etcd_connection as _create_etcd_connection
from ._transport.options import seconds as _seconds
from .api import (
    Deadline,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from .layout import DEFAULT_PREFIX
from .prometheus import serve_metrics_from_environment

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

#: Default time for :meth:`EtcdRendezvous.rendezvous_barrier` to succeed, in seconds.
_DEFAULT_TIMEOUT: int = 600
#: Default extra wait for more workers once ``min_workers`` joined, in seconds.
_DEFAULT_LAST_CALL_TIMEOUT: int = 30


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
        load_torch_store(self._torch_store)

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
        # Rank 0 publishes its address just after the barrier: the exchange gets at
        # least a member key's TTL (a rank 0 silent for longer is taken for dead) even
        # if the barrier completed right at the deadline.
        remaining = rdzv.deadline.remaining()
        exchange = Deadline(max(remaining, CONST_WORKER_KEEPALIVE_TTL))
        store = rdzv.setup_kv_store(rdzv_version, create_dir=False)
        bootstrap_store_info = RendezvousStoreInfo.build(
            rank, store.with_deadline(exchange), local_addr=self._local_addr
        )
        return RendezvousInfo(
            adapt_store(store, self._torch_store), rank, world_size, bootstrap_store_info
        )

    @torch_errors
    def is_closed(self) -> bool:
        """Whether the rendezvous of this run is closed (asking etcd for at most the
        rendezvous ``timeout``)."""
        try:
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
        return self._rdzv_impl.num_workers_waiting()

    def get_run_id(self) -> str:
        """Return the run id."""
        return self._rdzv_impl.layout.run_id

    def shutdown(self) -> bool:
        """Close the rendezvous, delete this worker's member key (which would otherwise
        lapse by its TTL, as PyTorch's do) and stop this worker's threads
        (keep-alive, and the watch stream of :meth:`num_nodes_waiting`).

        Returns:
            Whether the rendezvous could be marked closed. The threads are stopped
            either way; the key is deleted only once the run is closed.
        """
        try:
            self.set_closed()
        except Exception:
            logger.warning("Shutdown failed", exc_info=True)
            self._rdzv_impl.stop_threads()
            return False
        self._rdzv_impl.withdraw(Deadline(self._rdzv_impl.connection.request_timeout))
        self._rdzv_impl.stop_threads()
        return True

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
    serve_metrics_from_environment()
    timeout = _seconds(params, "timeout", _DEFAULT_TIMEOUT)
    last_call_timeout = _seconds(
        params, "last_call_timeout", _DEFAULT_LAST_CALL_TIMEOUT, allow_zero=True
    )
    prefix = params.get("etcd_prefix", DEFAULT_PREFIX)
    torch_store = torch_store_wanted(params)
    # Creation, too, ends within the rendezvous timeout, whatever etcd does.
    deadline = Deadline(timeout)
    conn = _create_etcd_connection(params, deadline=deadline)
    rdzv = EtcdRendezvous(
        client=conn,
        prefix=str(prefix),
        run_id=params.run_id,
        num_min_workers=params.min_nodes,
        num_max_workers=params.max_nodes,
        timeout=timeout,
        last_call_timeout=last_call_timeout,
        owns_connection=True,
        deadline=deadline,
    )
    return EtcdRendezvousHandler(
        rdzv_impl=rdzv,
        local_addr=params.local_addr,
        backend_name=params.backend or "etcd",
        torch_store=torch_store,
    )
