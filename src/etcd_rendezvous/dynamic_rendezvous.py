"""The dynamic rendezvous, ported from ``torch.distributed.elastic.rendezvous.dynamic_rendezvous``.

:class:`DynamicRendezvousHandler` is PyTorch's recommended rendezvous: all nodes share
one :class:`RendezvousState`, kept by a :class:`RendezvousBackend` (for instance the
``etcd-v2`` backend of :mod:`etcd_rendezvous.etcd_rendezvous_backend`) and changed only
by fenced writes. The state is written in PyTorch's pickle format, so PyTorch 2.13
workers and this package's share one rendezvous; it is decoded without
``pickle.loads`` (see :func:`decode_state`). PyTorch is never imported at import time.

How it works, and where it differs from PyTorch's: :doc:`/how-it-works`, section
"The dynamic rendezvous".
"""

from __future__ import annotations

from ._dynamic.backend import RendezvousBackend
from ._dynamic.backend import Token as _Token
from ._dynamic.handler import DynamicRendezvousHandler, create_handler
from ._dynamic.settings import RendezvousSettings, RendezvousTimeout
from ._dynamic.state import NodeDesc, RendezvousState, _NodeDesc, _RendezvousState, decode_state

__all__ = [
    "DynamicRendezvousHandler",
    "NodeDesc",
    "RendezvousBackend",
    "RendezvousSettings",
    "RendezvousState",
    "RendezvousTimeout",
    "Token",
    "create_handler",
    "decode_state",
]

# A state pickled with Python's own pickler (a decoded state sent to another process)
# names the module its classes are found in: this one, as PyTorch's name its own
# dynamic_rendezvous, with the same class names; not the private module behind it, which
# may move. (The state written to etcd names PyTorch's module: see decode_state.)
_NodeDesc.__module__ = __name__
_RendezvousState.__module__ = __name__

# Bound (and documented) here, where users import it from.
Token = _Token
"""An opaque fencing token used by the rendezvous backend."""
