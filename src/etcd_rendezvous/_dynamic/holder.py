"""The rendezvous state as a node holds it, kept in sync with the other nodes through the
backend.

:class:`BackendStateHolder` (PyTorch's ``_BackendRendezvousStateHolder``) reads the
state (or adopts the one a watching backend brought), writes the node's changes back
with the fencing token it read, and drops the nodes whose heartbeats lapsed. Every call
takes the deadline of the step that makes it, and passes it to this package's backend
(see :class:`~etcd_rendezvous._dynamic.keys.KeyedBackend`); any other backend bounds its
calls itself, as PyTorch's do.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

from .._transport.retry import Deadline
from ..api import RequestTooLargeError
from .backend import POLL_INTERVAL, RendezvousBackend, Token, as_backend, delay
from .changes import remove_participant_epilogue
from .clock import LOCAL_CLOCK, Clock, state_clock
from .keys import KeyedBackend
from .settings import LOGGER_NAME, STATE_HOLDER_EVENTS, RendezvousSettings, event_source
from .state import _encode_state, _NodeDesc, _RendezvousState, decode_state

__all__ = ["BackendStateHolder", "StateHolder"]

logger = logging.getLogger(LOGGER_NAME)


class StateHolder(ABC):
    """Hold the shared rendezvous state synced with other nodes (PyTorch's
    ``_RendezvousStateHolder``)."""

    @property
    @abstractmethod
    def state(self) -> _RendezvousState:
        """Get the local state."""

    @abstractmethod
    def sync(self, deadline: Deadline) -> bool | None:
        """Read or write the latest state, by ``deadline``.

        Returns:
            Whether the local state, if marked dirty, was successfully synced with
            other nodes; ``None`` if it was not dirty.
        """

    @abstractmethod
    def mark_dirty(self) -> None:
        """Mark the local state as dirty."""

    @property
    def clock(self) -> Clock:
        """The clock of the times in the state (heartbeats, the last-call deadline),
        which every part of the handler writes and judges them on (the default: the
        local wall clock, as in PyTorch)."""
        return LOCAL_CLOCK

    def wait_for_change(self, timeout: float, deadline: Deadline) -> None:
        """Wait up to ``timeout`` seconds for another node to change the state (its
        requests end by ``deadline``).

        The next :meth:`sync` then returns the newest state. The default sleeps
        ``min(timeout, 1 s)``, PyTorch's poll interval.
        """
        delay(min(max(timeout, 0.0), POLL_INTERVAL))

    @property
    def token(self) -> Token:
        """The fencing token of the state held (``None``: unknown, the default)."""
        return None

    @property
    def fetches(self) -> int:
        """How many times the state was read from the backend (0: not counted)."""
        return 0

    def invalidate(self) -> None:  # noqa: B027 (an optional hook)
        """Make the next :meth:`sync` read the state (the default does nothing)."""

    def keep(self) -> None:  # noqa: B027 (an optional hook)
        """Serve the state held to the next :meth:`sync` (the default does nothing)."""


class BackendStateHolder(StateHolder):
    """Hold the rendezvous state synced with other nodes via a backend.

    Args:
        backend: The rendezvous backend to use (one written for PyTorch, too).
        settings: The rendezvous settings.
        cache_duration: The amount of time, in seconds, to cache the last rendezvous
            state before requesting it from the backend again.
        clock: The clock of the times in the state; by default etcd's with this
            package's backend, else the local wall clock (see
            :func:`~etcd_rendezvous._dynamic.clock.state_clock`).
    """

    def __init__(
        self,
        backend: RendezvousBackend,
        settings: RendezvousSettings,
        cache_duration: int = 1,
        clock: Clock | None = None,
    ) -> None:
        self._backend = as_backend(backend)
        # This package's backend, whose calls take the step's deadline.
        self._keyed = backend if isinstance(backend, KeyedBackend) else None
        self._state = _RendezvousState()
        self._settings = settings
        self._clock = clock or state_clock(backend, settings)
        self._cache_duration = cache_duration
        self._token: Token = None
        self._dirty = False
        self._last_sync_time = -1.0
        self._dead_nodes: list[_NodeDesc] = []
        self._events = event_source(STATE_HOLDER_EVENTS, settings.run_id)
        self._fetches = 0

    @property
    def state(self) -> _RendezvousState:
        """See base class."""
        return self._state

    @property
    def clock(self) -> Clock:
        """See base class."""
        return self._clock

    @property
    def token(self) -> Token:
        """See base class (``None``: no state was seen)."""
        return self._token

    @property
    def fetches(self) -> int:
        """See base class (reads of the backend, not changes its watch brought)."""
        return self._fetches

    @property
    def cached(self) -> bool:
        """Whether the next :meth:`sync` serves the state held without reading it."""
        return self._cache_duration > 0 and self._last_sync_time >= max(
            time.monotonic() - self._cache_duration, 0
        )

    def invalidate(self) -> None:
        """Make the next :meth:`sync` read the state from the backend."""
        self._last_sync_time = -1

    def keep(self) -> None:
        """Serve the state held to the next :meth:`sync`, as if just read: the caller
        knows (from the progress key) that no change concerns it."""
        self._last_sync_time = time.monotonic()

    def _source(self) -> str:
        key = self._backend.state_key
        if key is None:
            return f"the '{self._backend.name}' backend"
        return f"{self._backend.name} key '{key}'"

    def sync(self, deadline: Deadline) -> bool | None:
        """See base class."""
        state_bits: bytes | None = None
        token = None
        has_set: bool | None

        if self._dirty:
            has_set = False
            state_bits = _encode_state(self._state)
            try:
                set_response = self._set(state_bits, deadline)
            except RequestTooLargeError:
                # etcd refused our changes for their size: drop them, lest the next sync
                # (a close, say) send them again; it reads the state instead.
                self._dirty = False
                self._last_sync_time = -1
                raise
            if set_response is not None:
                state_bits, token, has_set = set_response
        else:
            has_set = None
            if self._adopt_known_change(deadline):
                # The backend's watch brought a newer state: no read needed.
                return None
            if self.cached:
                # Avoid overloading the backend if we are asked to retrieve the state
                # repeatedly. Serve the cached state.
                return None
            self._fetches += 1
            get_response = self._get(deadline)
            if get_response is not None:
                state_bits, token = get_response

        # As in PyTorch, the event is recorded only if the debug log is on.
        if has_set and self._dead_nodes and logger.isEnabledFor(logging.DEBUG):
            node_list = ", ".join(f"'{node}'" for node in self._dead_nodes)
            msg = (
                f"As part of the sync operation the node(s) {node_list} have been removed from "
                f"the rendezvous '{self._settings.run_id}' since they had no heartbeat."
            )
            self._events.record("sync", msg)
            logger.debug(msg)

        self._adopt(state_bits, token)
        return has_set

    def wait_for_change(self, timeout: float, deadline: Deadline) -> None:
        """Wait through the backend's :meth:`RendezvousBackend.wait_for_change`.

        If the backend returns the new state, it becomes the local state (as a
        :meth:`sync` would make it); otherwise the cache is invalidated, so that the
        next :meth:`sync` reads the backend. A backend that cannot watch is polled
        every second, as in PyTorch.
        """
        if self._dirty:
            return
        change = self._wait(max(timeout, 0.0), deadline)
        if isinstance(change, tuple) and len(change) == 2:
            # The backend knows the new state: adopt it without reading it again.
            self._adopt(change[0], change[1])
        else:
            self._last_sync_time = -1

    def _adopt_known_change(self, deadline: Deadline) -> bool:
        """Adopt a newer state the backend already received (from its watch), if it
        returns one without waiting: then no read is needed (see
        :attr:`RendezvousBackend.reports_changes`)."""
        if self._token is None or not self._backend.reports_changes:
            return False
        change = self._wait(0.0, deadline)
        if isinstance(change, tuple) and len(change) == 2:
            self._adopt(change[0], change[1])
            return True
        return False

    # -- the backend's calls, with the step's deadline for this package's backend ----------

    def _get(self, deadline: Deadline) -> tuple[bytes, Token] | None:
        if self._keyed is not None:
            return self._keyed.get_state(deadline=deadline)
        return self._backend.get_state()

    def _set(self, state_bits: bytes, deadline: Deadline) -> tuple[bytes, Token, bool] | None:
        if self._keyed is not None:
            return self._keyed.set_state(state_bits, self._token, deadline=deadline)
        return self._backend.set_state(state_bits, self._token)

    def _wait(self, timeout: float, deadline: Deadline) -> tuple[bytes, Token] | None:
        if self._keyed is not None:
            return self._keyed.wait_for_change(self._token, timeout, deadline=deadline)
        return self._backend.wait_for_change(self._token, timeout)

    # -- the state held ---------------------------------------------------------------------

    def _adopt(self, state_bits: bytes | None, token: Token) -> None:
        """Make the decoded ``state_bits`` (or a new state if ``None``) the local state."""
        if state_bits is not None:
            self._state = decode_state(state_bits, self._source())
        else:
            self._state = _RendezvousState()
        self._token = token
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self._sanitize()

    def _sanitize(self) -> None:
        """Remove the nodes whose heartbeats lapsed (locally; written with the next change)."""
        state = self._state
        expire_time = self._clock.now() - (
            self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        )

        self._dead_nodes = [
            node
            for node, last_heartbeat in state.last_heartbeats.items()
            if last_heartbeat < expire_time
        ]

        participant_removed = False
        for dead_node in self._dead_nodes:
            logger.debug("Detected dead node '%s', removing it from the rendezvous", dead_node)
            del state.last_heartbeats[dead_node]
            if state.participants.pop(dead_node, None) is not None:
                participant_removed = True
            state.wait_list.discard(dead_node)
            state.redundancy_list.discard(dead_node)

        if participant_removed:
            remove_participant_epilogue(state, self._settings)

    def mark_dirty(self) -> None:
        """See base class.

        If the local rendezvous state is dirty, the next sync call will try to write the
        changes back to the backend. However this attempt might fail if another node,
        which had the same state, also made changes and wrote them before us.
        """
        self._dirty = True
