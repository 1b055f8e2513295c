"""The shared state of the dynamic rendezvous and its wire format (private).

:class:`_RendezvousState` and :class:`_NodeDesc` are PyTorch's classes of the same
names, attribute for attribute; :func:`_encode_state` writes exactly the bytes
``pickle.dumps(state)`` writes in PyTorch, and :func:`decode_state` reads them back with
a restricted unpickler (never ``pickle.loads``). Re-exported by
:mod:`etcd_rendezvous.dynamic_rendezvous`. The format: see docs/how-it-works.rst,
section "The dynamic rendezvous".
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from ..api import RendezvousStateError
from ..metrics import record_metric

__all__ = ["NodeDesc", "RendezvousState", "decode_state"]

_V = TypeVar("_V")


# -- the shared state -----------------------------------------------------------------------


@dataclass(eq=True, order=True, frozen=True)
class _NodeDesc:
    """Describe a node in the rendezvous.

    Its order is the rank order. Pickles as PyTorch's class of the same name.

    Attributes:
        addr: The FQDN of the node or user specified local node address.
        pid: The id of the process in which the rendezvous handler runs.
        local_id: A process-wide unique id.
    """

    addr: str
    pid: int
    local_id: int

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


class _NodeDescGenerator:
    """Generate node descriptors.

    A node descriptor is a combination of an FQDN, a process id, and an auto-incremented
    integer that uniquely identifies a node in the rendezvous.
    """

    _lock: threading.Lock
    _local_id: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # An integer that is incremented with each call to generate().
        self._local_id = 0

    def generate(self, local_addr: str | None = None) -> _NodeDesc:
        """Return a descriptor unique to this process and call (thread-safe)."""
        with self._lock:
            local_id = self._local_id
            self._local_id += 1

        return _NodeDesc(local_addr or socket.getfqdn(), os.getpid(), local_id)


class _RendezvousState:
    """Hold the state of a rendezvous.

    The attributes, their order and their types are PyTorch's wire format.

    Attributes:
        round: The current round of the rendezvous.
        complete: Whether the current round of the rendezvous is complete.
        deadline: The time at which the current round of the rendezvous will be
            considered complete if it is still waiting for nodes to join.
        closed: Whether the rendezvous is closed.
        participants: The participants and their corresponding ranks.
        wait_list: The nodes waiting to participate in the next round.
        redundancy_list: The nodes that are redundant in the current round and can join
            the next rendezvous without triggering re-rendezvous.
        last_heartbeats: Each node's last heartbeat time.
    """

    round: int
    complete: bool
    deadline: datetime | None
    closed: bool
    participants: dict[_NodeDesc, int]
    wait_list: set[_NodeDesc]
    redundancy_list: set[_NodeDesc]
    last_heartbeats: dict[_NodeDesc, datetime]

    def __init__(self) -> None:
        self.round = 0
        self.complete = False
        self.deadline = None
        self.closed = False
        self.participants = {}
        self.wait_list = set()
        self.redundancy_list = set()
        self.last_heartbeats = {}


#: The shared state as :func:`decode_state` returns it: PyTorch's private
#: ``_RendezvousState`` (``round``, ``complete``, ``deadline``, ``closed``,
#: ``participants`` with their ranks, ``wait_list``, ``redundancy_list`` and
#: ``last_heartbeats``), under a public name for tools that read it.
RendezvousState = _RendezvousState
#: A node of the state (``addr``, ``pid``, ``local_id``; ordered by rank): PyTorch's
#: private ``_NodeDesc``, under a public name for tools that read the state.
NodeDesc = _NodeDesc


# -- the state codec --------------------------------------------------------------------------

#: The module under which PyTorch's state classes live; our classes pickle as if they were
#: defined there.
_TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

_WIRE_NAMES: dict[type, tuple[str, str]] = {
    _RendezvousState: (_TORCH_MODULE, "_RendezvousState"),
    _NodeDesc: (_TORCH_MODULE, "_NodeDesc"),
}

#: Every global a rendezvous state pickle may name (protocols 3 to 5), mapped to what it
#: is resolved to. Instances are created only through these; nothing else is importable.
_ALLOWED_GLOBALS: dict[tuple[str, str], type] = {
    (_TORCH_MODULE, "_RendezvousState"): _RendezvousState,
    (_TORCH_MODULE, "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
    # Protocol 3 pickles a set as set([...]); protocols 4 and 5 have opcodes for it.
    ("builtins", "set"): set,
}

_STATE_FIELDS = (
    "round",
    "complete",
    "deadline",
    "closed",
    "participants",
    "wait_list",
    "redundancy_list",
    "last_heartbeats",
)
_NODE_FIELDS = ("addr", "pid", "local_id")

#: How much of a bad payload an error message quotes.
_PREVIEW_BYTES = 80


class _StatePickler(pickle._Pickler):
    """A pickler that writes our state classes under PyTorch's names.

    PyTorch's workers load the result with ``pickle.loads`` into their own classes. The
    pure-Python pickler is used because it lets :meth:`save_global` be overridden; the C
    one would import ``torch`` to check the class. Everything else is pickled by the
    standard machinery, so the bytes are those of ``pickle.dumps`` in PyTorch.
    """

    def save_global(self, obj: Any, name: str | None = None) -> None:
        """Write a reference to PyTorch's class for our state classes, else the default."""
        wire_name = _WIRE_NAMES.get(obj) if isinstance(obj, type) else None
        if wire_name is None or self.proto < 4:  # type: ignore[attr-defined]
            # Protocols < 4 are never used for the state (see _encode_state).
            super().save_global(obj, name)  # type: ignore[misc]
            return
        module, qualname = wire_name
        # What pickle.Pickler does for a global with protocol 4 and later.
        self.save(module)  # type: ignore[attr-defined]
        self.save(qualname)  # type: ignore[attr-defined]
        self.write(pickle.STACK_GLOBAL)  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


def _encode_state(state: _RendezvousState) -> bytes:
    """Encode ``state`` exactly as PyTorch's ``pickle.dumps(state)`` would.

    The protocol is this interpreter's default, as in PyTorch (4 up to Python 3.13),
    at least 4, which every supported Python reads.
    """
    buffer = io.BytesIO()
    _StatePickler(buffer, protocol=max(4, pickle.DEFAULT_PROTOCOL)).dump(state)
    return buffer.getvalue()


class _ForbiddenGlobalError(pickle.UnpicklingError):
    """A state pickle named a global outside the allow-list."""


class _StateUnpickler(pickle.Unpickler):
    """An unpickler that can only create the types a rendezvous state is made of.

    ``find_class`` is the only way a pickle reaches callables; here it resolves the few
    globals in :data:`_ALLOWED_GLOBALS` and refuses everything else, so a hostile pickle
    fails before anything runs. Persistent ids and out-of-band buffers are refused by
    the base class since neither hook is provided.
    """

    def find_class(self, module: str, name: str, /) -> Any:
        """Resolve ``module.name`` if it is in the allow-list, else raise."""
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _ForbiddenGlobalError(
                f"it refers to {module}.{name}, which is not part of a rendezvous state"
            ) from None


def _describe(value: object) -> str:
    return type(value).__name__


def _check_int(value: object, what: str) -> int:
    if type(value) is not int:
        raise RendezvousStateError(f"{what} must be an int, not {_describe(value)}")
    return value


def _check_time(value: object, what: str) -> datetime:
    if type(value) is not datetime or value.utcoffset() is None:
        raise RendezvousStateError(f"{what} must be a timezone-aware datetime, not {value!r}")
    return value


def _check_fields(obj: object, fields: Sequence[str], what: str) -> dict[str, Any]:
    attributes = vars(obj)
    if set(attributes) != set(fields):
        missing = sorted(set(fields) - set(attributes), key=str)
        extra = sorted(set(attributes) - set(fields), key=str)
        raise RendezvousStateError(
            f"{what} has missing attributes {missing} or unexpected attributes {extra}"
        )
    return attributes


class _NodeInterner:
    """Rebuilds decoded node descriptors as fresh, validated, shared instances.

    A node appears several times in a state (as a participant and in the heartbeats),
    as one object of the pickle: each such object is checked once. The caller keeps
    the decoded objects alive meanwhile, so their ids are not reused.
    """

    def __init__(self) -> None:
        self._nodes: dict[tuple[str, int, int], _NodeDesc] = {}
        self._checked: dict[int, _NodeDesc] = {}

    def node(self, value: object, where: str) -> _NodeDesc:
        node = self._checked.get(id(value))
        if node is not None:
            return node
        if type(value) is _NodeDesc:
            # The common case first, without building error messages.
            fields = vars(value)
            key = (fields.get("addr"), fields.get("pid"), fields.get("local_id"))
            if (
                len(fields) == len(_NODE_FIELDS)
                and type(key[0]) is str
                and type(key[1]) is int
                and type(key[2]) is int
            ):
                node = self._intern(key)  # type: ignore[arg-type]
                self._checked[id(value)] = node
                return node
        return self._intern(self._checked_key(value, where))

    def _intern(self, key: tuple[str, int, int]) -> _NodeDesc:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _NodeDesc(*key)
        return node

    def _checked_key(self, value: object, where: str) -> tuple[str, int, int]:
        """The fields of a node that failed the quick check (raises, as a rule)."""
        if type(value) is not _NodeDesc:
            raise RendezvousStateError(f"{where} must hold nodes, not {_describe(value)}")
        fields = _check_fields(value, _NODE_FIELDS, f"a node in {where}")
        addr = fields["addr"]
        if type(addr) is not str:
            raise RendezvousStateError(f"a node address in {where} must be a str, not {addr!r}")
        return (
            addr,
            _check_int(fields["pid"], f"a node pid in {where}"),
            _check_int(fields["local_id"], f"a node local_id in {where}"),
        )


def _validated_state(obj: object) -> _RendezvousState:
    """Return a fresh :class:`_RendezvousState` equal to the decoded ``obj``, or raise.

    Rebuilding every container and node means no object made by the unpickler survives,
    so hashes computed before a node was fully built cannot haunt a set or a dict.

    Raises:
        RendezvousStateError: ``obj`` is not a well-formed state (without the key name).
    """
    if type(obj) is not _RendezvousState:
        raise RendezvousStateError(f"it holds a {_describe(obj)}, not a rendezvous state")
    fields = _check_fields(obj, _STATE_FIELDS, "the state")
    nodes = _NodeInterner()
    state = _RendezvousState()

    state.round = _check_int(fields["round"], "'round'")
    for flag in ("complete", "closed"):
        if type(fields[flag]) is not bool:
            raise RendezvousStateError(f"'{flag}' must be a bool, not {fields[flag]!r}")
    state.complete = fields["complete"]
    state.closed = fields["closed"]
    deadline = fields["deadline"]
    state.deadline = None if deadline is None else _check_time(deadline, "'deadline'")

    state.participants = _node_map(fields, "participants", nodes, _check_int, "a rank")
    for name in ("wait_list", "redundancy_list"):
        members = fields[name]
        if type(members) is not set:
            raise RendezvousStateError(f"'{name}' must be a set, not {_describe(members)}")
        setattr(state, name, {nodes.node(node, f"'{name}'") for node in members})
    state.last_heartbeats = _node_map(fields, "last_heartbeats", nodes, _check_time, "a time")
    return state


def _node_map(
    fields: dict[str, Any],
    name: str,
    nodes: _NodeInterner,
    check: Callable[[object, str], _V],
    what: str,
) -> dict[_NodeDesc, _V]:
    """The field ``name``, a dict of nodes to values that ``check`` accepts (each ``what``
    in it), rebuilt; or raise :class:`RendezvousStateError`."""
    mapping = fields[name]
    if type(mapping) is not dict:
        raise RendezvousStateError(f"'{name}' must be a dict, not {_describe(mapping)}")
    return {
        nodes.node(node, f"'{name}'"): check(value, f"{what} in '{name}'")
        for node, value in mapping.items()
    }


def _preview(data: bytes) -> str:
    return repr(data if len(data) <= _PREVIEW_BYTES else data[:_PREVIEW_BYTES] + b"...")


def decode_state(data: bytes, source: str) -> RendezvousState:
    """Decode a state written by this module or by PyTorch, without ``pickle.loads``.

    For tools that inspect a run: ``data`` is what a backend's
    :meth:`~RendezvousBackend.get_state` returns. The result is read-only in spirit:
    the handlers own the state in the backend.

    Args:
        data: The encoded state (a pickle).
        source: Where it was read, for the error message (e.g. ``"etcd key '/a/b'"``).

    Raises:
        RendezvousStateError: ``data`` is not a rendezvous state, or names a type a
            state does not contain; the message names ``source``. No code from ``data``
            is run.
    """
    data = bytes(data)
    with _DECODED_LOCK:
        decoded = _DECODED.get(data)
    if decoded is not None:
        return _copy_state(decoded)
    record_metric("rendezvous.state_decodes", backend="etcd-v2")
    try:
        obj = _StateUnpickler(io.BytesIO(data)).load()
        decoded = _validated_state(obj)
    except RendezvousStateError as exc:
        problem = str(exc)
        cause: BaseException = exc
    except _ForbiddenGlobalError as exc:
        problem = str(exc)
        cause = exc
    except Exception as exc:  # Whatever a malformed pickle makes the unpickler raise.
        problem = f"it is not a valid pickle ({type(exc).__name__}: {exc})"
        cause = exc
    else:
        with _DECODED_LOCK:
            _DECODED[data] = decoded
            while len(_DECODED) > _DECODED_CAPACITY:
                del _DECODED[next(iter(_DECODED))]
        return _copy_state(decoded)
    raise RendezvousStateError(
        f"The rendezvous state in {source} is corrupt: {problem}. Stored value "
        f"({len(data)} bytes): {_preview(data)}. Nothing in it was executed."
    ) from cause


#: The last states decoded in this process, by their bytes (never handed out: copies
#: are). Every handler of a process decodes each state its backend shows it; with many
#: handlers in one process (tests, benchmarks, agents hosting several nodes), one
#: decoding serves them all. A single handler only keeps its last states.
_DECODED: dict[bytes, _RendezvousState] = {}
_DECODED_CAPACITY = 4
_DECODED_LOCK = threading.Lock()


def _copy_state(state: _RendezvousState) -> _RendezvousState:
    """A copy of ``state`` that shares only immutable parts (nodes, times)."""
    copy = _RendezvousState()
    copy.round = state.round
    copy.complete = state.complete
    copy.deadline = state.deadline
    copy.closed = state.closed
    copy.participants = dict(state.participants)
    copy.wait_list = set(state.wait_list)
    copy.redundancy_list = set(state.redundancy_list)
    copy.last_heartbeats = dict(state.last_heartbeats)
    return copy
