"""Lookup of rendezvous handlers by backend name.

Importing this module registers the built-in ``etcd`` and ``etcd-v2`` backends (also
under their torchrun plugin names ``etcd-rendezvous`` and ``etcd-rendezvous-v2``) in
:data:`~etcd_rendezvous.api.rendezvous_handler_registry`, as torch's rendezvous package
does on import. Backends are imported only when a handler is created, so importing
this module does not import python-etcd.

Where torch's rendezvous is loaded (a handler made for torch's agent, through its
registry or ``torchrun``), the handlers and their creators raise this package's errors
as torch's too: a class deriving from both, so that ``except`` clauses written for
either package catch them (a surplus node of ``etcd-v2`` ends with torch's "Rendezvous
gracefully exited").
"""

from __future__ import annotations

from ._torch_errors import torch_errors
from .api import RendezvousHandler, RendezvousParameters
from .api import rendezvous_handler_registry as handler_registry

__all__ = ["get_rendezvous_handler"]


@torch_errors
def _create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd`` backend's handler, importing its module on first use."""
    # Imported here, as the backend is needed, so that importing the registry does not
    # import python-etcd. No cycle is dodged: the backend does not import the registry.
    from .etcd_rendezvous import create_rdzv_handler  # noqa: PLC0415

    return create_rdzv_handler(params)


@torch_errors
def _create_etcd_v2_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the dynamic rendezvous handler over the ``etcd-v2`` backend, lazily.

    The handler owns the backend, and so the connection ``create_backend`` opened: its
    ``close()`` releases them.
    """
    # Imported here, as the backend is needed: the backend loads python-etcd, and the
    # dynamic rendezvous (most of the package's import time) comes with it. No cycle is
    # dodged: neither module imports the registry.
    from .dynamic_rendezvous import create_handler  # noqa: PLC0415
    from .etcd_rendezvous_backend import create_backend  # noqa: PLC0415

    backend, store = create_backend(params)
    return create_handler(store, backend, params, backend_name=params.backend, owns_backend=True)


def _register_default_handlers() -> None:
    """Register the built-in backends; safe to call more than once.

    Each backend is registered under PyTorch's name and under the name of this
    package's ``torchrun`` plugin (:mod:`etcd_rendezvous.torchrun`), so a configuration
    written for either works here; handlers report the name they were created under.
    """
    handler_registry.register("etcd", _create_etcd_handler)
    handler_registry.register("etcd-v2", _create_etcd_v2_handler)
    handler_registry.register("etcd-rendezvous", _create_etcd_handler)
    handler_registry.register("etcd-rendezvous-v2", _create_etcd_v2_handler)


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the :class:`~etcd_rendezvous.api.RendezvousHandler` for ``params.backend``.

    Custom backends are registered in the global registry first::

        from etcd_rendezvous.api import rendezvous_handler_registry
        from etcd_rendezvous.registry import get_rendezvous_handler


        def create_my_rdzv(params: RendezvousParameters) -> RendezvousHandler:
            return MyCustomRdzv(params)


        rendezvous_handler_registry.register("my_rdzv_backend_name", create_my_rdzv)
        my_rdzv_handler = get_rendezvous_handler(params)

    Raises:
        ValueError: ``params.backend`` is not registered.
        RuntimeError: The created handler reports a different backend name.
    """
    return handler_registry.create_handler(params)


_register_default_handlers()
