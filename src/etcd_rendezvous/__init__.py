"""etcd-rendezvous: PyTorch Elastic's etcd rendezvous and ``EtcdStore``, without PyTorch.

The package mirrors ``torch.distributed.elastic.rendezvous``: the same module names
(:mod:`~etcd_rendezvous.api`, :mod:`~etcd_rendezvous.etcd_rendezvous`,
:mod:`~etcd_rendezvous.etcd_store`, :mod:`~etcd_rendezvous.registry`,
:mod:`~etcd_rendezvous.utils`), the same classes and the same etcd key layout, so
workers using this package and workers using PyTorch's ``etcd`` backend rendezvous
together.

Importing the package registers the ``etcd`` backend with
:data:`~etcd_rendezvous.api.rendezvous_handler_registry`. It never configures logging;
the library logs under the ``etcd_rendezvous`` logger hierarchy.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    RequestTooLargeError,
    rendezvous_handler_registry,
)
from .registry import get_rendezvous_handler

if TYPE_CHECKING:
    from .etcd_rendezvous import EtcdRendezvousHandler
    from .etcd_store import EtcdStore

__version__ = "0.1.0"

__all__ = [
    "EtcdRendezvousHandler",
    "EtcdStore",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "RequestTooLargeError",
    "__version__",
    "get_rendezvous_handler",
    "rendezvous_handler_registry",
]

_LAZY = {
    "EtcdRendezvousHandler": ".etcd_rendezvous",
    "EtcdStore": ".etcd_store",
}


def __getattr__(name: str) -> Any:
    """Import the etcd-backed classes on first use (keeps ``import etcd_rendezvous`` cheap)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    return getattr(import_module(module, __name__), name)
