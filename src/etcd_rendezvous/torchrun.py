"""PyTorch ``torchrun`` plugin: this package's backends as ``etcd-rendezvous`` and
``etcd-rendezvous-v2``.

The package registers :func:`etcd_rendezvous_handler` (the ``etcd`` backend) and
:func:`etcd_rendezvous_v2_handler` (the dynamic rendezvous over ``etcd-v2``) in the
``torchrun.handlers`` entry-point group. :func:`replace_torch_etcd_backends` serves them
under PyTorch's names ``etcd`` and ``etcd-v2`` instead, and the ``etcd-torchrun``
command (:func:`main`) is ``torchrun`` with that done. Nothing here imports PyTorch at
import time. How to use them: :doc:`torchrun`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .api import RendezvousHandler, RendezvousParameters
from .registry import _create_etcd_handler, _create_etcd_v2_handler

__all__ = [
    "BACKEND_NAME",
    "V2_BACKEND_NAME",
    "as_rendezvous_parameters",
    "create_etcd_rendezvous_handler",
    "create_etcd_rendezvous_v2_handler",
    "etcd_rendezvous_handler",
    "etcd_rendezvous_v2_handler",
    "main",
    "replace_torch_etcd_backends",
]

#: The torchrun name of the legacy ``etcd`` backend.
BACKEND_NAME = "etcd-rendezvous"
#: The torchrun name of the dynamic rendezvous over etcd (PyTorch's ``etcd-v2``).
V2_BACKEND_NAME = "etcd-rendezvous-v2"

HandlerCreator = Callable[[Any], RendezvousHandler]


def as_rendezvous_parameters(params: Any) -> RendezvousParameters:
    """This package's :class:`~etcd_rendezvous.api.RendezvousParameters` for ``params``.

    ``params`` is ours (returned as is) or PyTorch's ``RendezvousParameters``, which has
    the same attributes; its ``config`` values are kept as given (torchrun passes
    ``--rdzv-conf`` values as strings, which every option parses).

    Raises:
        TypeError: ``params`` lacks the attributes of ``RendezvousParameters``.
    """
    if isinstance(params, RendezvousParameters):
        return params
    try:
        fields = (params.backend, params.endpoint, params.run_id)
        nodes = (params.min_nodes, params.max_nodes)
        local_addr = params.local_addr
        config = dict(params.config)
    except (AttributeError, TypeError):
        raise TypeError(
            f"params: expected RendezvousParameters (ours or PyTorch's), got "
            f"{type(params).__name__}."
        ) from None
    return RendezvousParameters(*fields, *nodes, local_addr=local_addr, **config)


def create_etcd_rendezvous_handler(params: Any) -> RendezvousHandler:
    """Create the legacy ``etcd`` backend's handler from ``params`` (ours or PyTorch's).

    The handler reports ``params.backend`` from ``get_backend()``. See
    :func:`etcd_rendezvous.etcd_rendezvous.create_rdzv_handler` for the options.
    """
    return _create_etcd_handler(as_rendezvous_parameters(params))


def create_etcd_rendezvous_v2_handler(params: Any) -> RendezvousHandler:
    """Create the dynamic rendezvous handler over etcd from ``params`` (ours or PyTorch's).

    The handler reports ``params.backend`` from ``get_backend()``. See
    :func:`etcd_rendezvous.etcd_rendezvous_backend.create_backend` and
    :func:`etcd_rendezvous.dynamic_rendezvous.create_handler` for the options.
    """
    return _create_etcd_v2_handler(as_rendezvous_parameters(params))


def etcd_rendezvous_handler() -> HandlerCreator:
    """Entry point ``torchrun.handlers: etcd-rendezvous``.

    PyTorch calls an entry point with no arguments and registers what it returns as the
    backend's handler creator.
    """
    return create_etcd_rendezvous_handler


def etcd_rendezvous_v2_handler() -> HandlerCreator:
    """Entry point ``torchrun.handlers: etcd-rendezvous-v2``.

    See :func:`etcd_rendezvous_handler`.
    """
    return create_etcd_rendezvous_v2_handler


def replace_torch_etcd_backends(registry: Any = None) -> None:
    """Make PyTorch's ``etcd`` and ``etcd-v2`` backend names create this package's handlers.

    Call it in the launcher process (the one running the elastic agent) before the
    handler is created, e.g. in a wrapper around ``torch.distributed.run.main()``.

    PyTorch's registry refuses to re-register a taken name, so the built-in entries are
    removed first through the registry's private ``_registry`` dict (checked against
    PyTorch 2.13).

    Args:
        registry: the ``RendezvousHandlerRegistry`` to change; PyTorch's global
            ``rendezvous_handler_registry`` if ``None``.

    Raises:
        TypeError: the registry does not have the layout this relies on (a PyTorch
            version that changed it); use ``etcd-rendezvous`` instead.
    """
    if registry is None:
        # Imported by name: PyTorch is optional, and mypy must not analyse it.
        rendezvous = importlib.import_module("torch.distributed.elastic.rendezvous")
        registry = rendezvous.rendezvous_handler_registry
    entries = getattr(registry, "_registry", None)
    if not isinstance(entries, dict) or not callable(getattr(registry, "register", None)):
        raise TypeError(
            f"registry: {type(registry).__name__} has no private _registry dict to replace "
            f"backends in; use --rdzv-backend={BACKEND_NAME} or {V2_BACKEND_NAME} instead."
        )
    for name, creator in (
        ("etcd", create_etcd_rendezvous_handler),
        ("etcd-v2", create_etcd_rendezvous_v2_handler),
    ):
        entries.pop(name, None)
        registry.register(name, creator)


def main(args: list[str] | None = None) -> None:
    """The ``etcd-torchrun`` console script: ``torchrun`` (same arguments, same exit
    codes) with PyTorch's ``etcd`` and ``etcd-v2`` backend names served by this package.

    ``args`` are torchrun's arguments (``sys.argv[1:]`` if ``None``). The etcd password
    is best given by ``--rdzv-conf=password_file=<path>`` or the environment variable
    ``ETCD_RENDEZVOUS_PASSWORD`` rather than ``password=``: torchrun logs ``--rdzv-conf``.
    """
    # Imported by name: PyTorch is optional, and mypy must not analyse it.
    run = importlib.import_module("torch.distributed.run")
    replace_torch_etcd_backends()
    run.main(args)


if __name__ == "__main__":
    main()
