"""The interface of the backend that holds the state of a dynamic rendezvous.

Re-exported by :mod:`etcd_rendezvous.dynamic_rendezvous` (users import
:class:`RendezvousBackend` and :data:`Token` from there).
Also holds the poll that stands in for a watch when a backend cannot watch
(:data:`POLL_INTERVAL`, :func:`delay`), and :func:`as_backend`, which gives a backend
written for PyTorch this class's defaults.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["POLL_INTERVAL", "RendezvousBackend", "Token", "as_backend", "delay"]

#: An opaque fencing token used by the rendezvous backend (documented as
#: :data:`etcd_rendezvous.dynamic_rendezvous.Token`).
Token = Any

#: Longest a node waits for a state change before reading the state anyway, in seconds,
#: when the backend cannot watch (PyTorch's fixed poll interval).
POLL_INTERVAL = 1.0


def delay(seconds: float | tuple[float, float]) -> None:
    """Suspend the current thread for ``seconds``, or a random time in a ``(low, high)`` range.

    Delays under 10 ms are skipped, as in PyTorch.
    """
    if isinstance(seconds, tuple):
        seconds = random.uniform(*seconds)
    if seconds >= 0.01:
        time.sleep(seconds)


class RendezvousBackend(ABC):
    """Represent a backend that holds the rendezvous state.

    The state is an opaque byte string (the encoded :class:`_RendezvousState`), stored
    together with a fencing token that changes with every write. The abstract methods
    are PyTorch's; :attr:`state_key`, :meth:`wait_for_change`, :attr:`reports_changes`
    and :meth:`close` are optional additions with defaults that keep PyTorch's
    behaviour. A backend bounds its own calls (as PyTorch's do, with their clients'
    timeouts); this package's ``etcd-v2`` backend also takes the deadline of the
    handler's operation, as a keyword PyTorch's callers never pass (see
    :class:`~etcd_rendezvous.etcd_rendezvous_backend.EtcdRendezvousBackend`).
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """Get the name of the backend."""

    @property
    def state_key(self) -> str | None:
        """Where the backend keeps the state (e.g. an etcd key), for error messages.

        ``None`` (the default) if the backend has no such notion.
        """
        return None

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """Get the rendezvous state.

        Returns:
            A tuple of the encoded rendezvous state and its fencing token or ``None`` if
            no state is found in the backend.

        Raises:
            RendezvousConnectionError: The connection to the backend has failed.
            RendezvousStateError: The rendezvous state is corrupt.
        """

    @abstractmethod
    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Set the rendezvous state.

        The new rendezvous state is set conditionally:

        - If ``token`` matches the fencing token stored in the backend, the state is
          updated, and the new state is returned with its fencing token.
        - If ``token`` does not match, the state is not updated; the existing state is
          returned with its fencing token.
        - If ``token`` is ``None``, the new state is set only if there is no existing
          state. Either the new or the existing state is returned with its token.

        Args:
            state: The encoded rendezvous state.
            token: An optional fencing token that was retrieved by a previous call to
                :meth:`get_state` or ``set_state()``.

        Returns:
            A tuple of the serialized rendezvous state, its fencing token, and a
            boolean value indicating whether our set attempt succeeded.

        Raises:
            RendezvousConnectionError: The connection to the backend has failed.
            RendezvousStateError: The rendezvous state is corrupt.
        """

    def wait_for_change(self, token: Token | None, timeout: float) -> tuple[bytes, Token] | None:
        """Block until the state is no longer the one identified by ``token``, or ``timeout``.

        Called by a node that has nothing to do until another node writes the state
        (or until ``timeout``, which the caller computes from its next deadline). A
        backend that can watch (such as etcd) overrides this to return as soon as a
        write after ``token`` happens, or at once if one already did; ``token=None``
        means "no state yet", so the creation of the state counts as a change. It must
        not write anything; returning early is harmless.

        It may return the new state and its token, if the change brought them (as
        :meth:`get_state` would return them); the caller then adopts them without
        reading. With ``None``, the caller reads the state with :meth:`get_state`.

        The default implementation cannot watch: it sleeps ``min(timeout, 1 s)``, i.e.
        PyTorch's polling once per second, and returns ``None``.

        Args:
            token: The fencing token of the state the caller holds, or ``None``.
            timeout: The longest to block, in seconds (may be 0).

        Raises:
            RendezvousConnectionError: The connection to the backend has failed.
        """
        delay(min(max(timeout, 0.0), POLL_INTERVAL))
        return None

    @property
    def reports_changes(self) -> bool:
        """Whether :meth:`wait_for_change` returns the new states it sees, also with a
        timeout of 0 for changes it already received: the handler then asks it before
        reading the state (``False`` by default)."""
        return False

    def close(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Release what the backend owns (such as its connection). Idempotent.

        A handler calls it from its own ``close()`` only if it owns the backend (see
        ``owns_backend`` of :func:`create_handler`). The default does nothing.
        """


class _PyTorchBackend(RendezvousBackend):
    """A backend that does not derive from :class:`RendezvousBackend` (one written for
    PyTorch, deriving from PyTorch's class of the same name): its three members, and
    this class's defaults for the others."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    @property
    def name(self) -> str:
        """See base class."""
        return str(self._backend.name)

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        state: tuple[bytes, Token] | None = self._backend.get_state()
        return state

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        result: tuple[bytes, Token, bool] | None = self._backend.set_state(state, token)
        return result

    def close(self) -> None:
        """The backend's ``close()``, if it has one (PyTorch's interface has none)."""
        close = getattr(self._backend, "close", None)
        if close is not None:
            close()


def as_backend(backend: object) -> RendezvousBackend:
    """``backend`` as a :class:`RendezvousBackend`: itself, or, for a backend written for
    PyTorch, a view with this class's defaults for what PyTorch's interface lacks."""
    return backend if isinstance(backend, RendezvousBackend) else _PyTorchBackend(backend)
