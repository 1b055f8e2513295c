"""Optional PyTorch integration, decided without importing PyTorch.

PyTorch is optional. When it is installed, the handlers hand out a
:class:`~etcd_rendezvous.torch_store.TorchEtcdStore` (a real
``torch.distributed.Store``) instead of the plain :class:`~etcd_rendezvous.etcd_store.EtcdStore`,
so that the result of ``next_rendezvous()`` can go straight into torch's elastic agent or
``torch.distributed.init_process_group(store=...)``. The rendezvous option ``torch_store``
controls this:

* ``auto`` (the default): adapt when PyTorch is installed;
* ``true``: always adapt; creating the handler fails if PyTorch is missing;
* ``false``: never adapt, and never import PyTorch (PyTorch takes seconds to import).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

from .api import Deadline, RendezvousParameters, Store

__all__ = [
    "TORCH_STORE_OPTION",
    "adapt_store",
    "bounded_store",
    "load_torch_store",
    "torch_available",
    "torch_store_wanted",
]

#: The rendezvous option that chooses between the plain and the torch-compatible store.
TORCH_STORE_OPTION = "torch_store"


@functools.lru_cache(maxsize=1)
def torch_available() -> bool:
    """Whether PyTorch can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


def torch_store_wanted(params: RendezvousParameters) -> bool:
    """Whether handlers built from ``params`` should hand out a torch ``Store``.

    Reads the ``torch_store`` option: ``auto``, or a boolean as
    :meth:`~etcd_rendezvous.api.RendezvousParameters.get_as_bool` reads it.

    Raises:
        ValueError: the option has another value, or is true while PyTorch is not
            installed; the message names ``torch_store``.
    """
    value: Any = params.get(TORCH_STORE_OPTION, "auto")
    wanted: bool | None = None
    if not (isinstance(value, str) and value.strip().lower() == "auto"):
        try:
            wanted = params.get_as_bool(TORCH_STORE_OPTION)
        except ValueError:
            raise ValueError(
                f"{TORCH_STORE_OPTION}: expected auto, true or false, got {value!r}."
            ) from None
    if wanted is None:
        return torch_available()
    if wanted and not torch_available():
        raise ValueError(
            f"{TORCH_STORE_OPTION}: true needs PyTorch, which is not installed "
            "(use auto or false, or install torch)."
        )
    return wanted


def load_torch_store(wanted: bool) -> None:
    """Import PyTorch now if ``wanted``: a handler that will hand out a torch store does
    so when it is created, not in ``next_rendezvous()``, where an import (seconds of
    CPU, far more in a process whose threads compete for it) could not honour the
    rendezvous deadline."""
    if wanted:
        importlib.import_module("etcd_rendezvous.torch_store")


def adapt_store(store: Store, wanted: bool) -> Store:
    """``store`` as a ``torch.distributed.Store`` if ``wanted`` and it is an ``EtcdStore``.

    Other stores (a torch store already, or a custom one) are returned unchanged.
    """
    # An EtcdStore exists only once etcd_store is loaded, so it is looked up, not
    # imported: importing etcd_store loads python-etcd, which the dynamic rendezvous
    # (and a backend of the user's own) must not load when it does not use it.
    etcd_store = sys.modules.get("etcd_rendezvous.etcd_store")
    if not wanted or etcd_store is None or not isinstance(store, etcd_store.EtcdStore):
        return store
    # Imported when wanted: torch_store imports PyTorch, which is optional and slow to load.
    module = importlib.import_module("etcd_rendezvous.torch_store")
    adapted: Store = module.TorchEtcdStore(store)
    return adapted


def bounded_store(store: Store, deadline: Deadline) -> Store | None:
    """The :class:`~etcd_rendezvous.etcd_store.EtcdStore` that ``store`` is (or that a
    :class:`~etcd_rendezvous.torch_store.TorchEtcdStore` ``store`` wraps) as seen by a
    caller whose every call also ends by ``deadline`` (its
    :meth:`~etcd_rendezvous.etcd_store.EtcdStore.with_deadline` view, which costs no
    request); ``None`` for any other store."""
    # Looked up, not imported, as in adapt_store.
    etcd_store = sys.modules.get("etcd_rendezvous.etcd_store")
    if etcd_store is None:
        return None
    torch_store = sys.modules.get("etcd_rendezvous.torch_store")
    if torch_store is not None and isinstance(store, torch_store.TorchEtcdStore):
        store = store.etcd_store
    if not isinstance(store, etcd_store.EtcdStore):
        return None
    view: Store = store.with_deadline(deadline)
    return view
