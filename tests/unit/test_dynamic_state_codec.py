"""The dynamic rendezvous state codec: PyTorch's wire format, decoded without pickle.loads."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import pickletools
import subprocess
import sys
from base64 import b64encode
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous import dynamic_rendezvous as dr
from etcd_rendezvous._dynamic import state as codec
from etcd_rendezvous._dynamic.holder import BackendStateHolder
from etcd_rendezvous._transport.retry import Deadline
from etcd_rendezvous.api import RendezvousStateError

TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
SOURCE = "etcd key '/torch/elastic/rendezvous/run-1'"
T0 = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc)


def make_state(module: Any = codec) -> Any:
    """A state using every attribute, built from ``module``'s classes (ours or torch's)."""
    state = module._RendezvousState()
    a = module._NodeDesc("host-a.example.com", 101, 0)
    b = module._NodeDesc("host-b.example.com", 202, 1)
    c = module._NodeDesc("host-c.example.com", 303, 2)
    state.round = 7
    state.complete = True
    state.deadline = T0 + timedelta(seconds=30)
    state.closed = False
    state.participants = {a: 0, b: 1}
    state.wait_list = {c}
    state.redundancy_list = {module._NodeDesc("host-d", 404, 3)}
    state.last_heartbeats = {a: T0, b: T0 - timedelta(seconds=2), c: T0}
    return state


def as_plain(state: Any) -> dict[str, Any]:
    """The content of a state (ours or torch's) with nodes as tuples, for comparisons."""

    def node(n: Any) -> tuple[str, int, int]:
        return (n.addr, n.pid, n.local_id)

    return {
        "round": state.round,
        "complete": state.complete,
        "deadline": state.deadline,
        "closed": state.closed,
        "participants": {node(n): r for n, r in state.participants.items()},
        "wait_list": {node(n) for n in state.wait_list},
        "redundancy_list": {node(n) for n in state.redundancy_list},
        "last_heartbeats": {node(n): t for n, t in state.last_heartbeats.items()},
    }


def globals_in(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle refers to."""
    found: set[tuple[str, str]] = set()
    strings: list[str] = []
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(arg), str):
            strings.append(memo[arg])
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            module, name = arg.split(" ")
            found.add((module, name))
    return found


# -- without torch ----------------------------------------------------------------------------


def test_roundtrip_keeps_every_attribute() -> None:
    state = make_state()
    decoded = dr.decode_state(codec._encode_state(state), SOURCE)
    assert type(decoded) is codec._RendezvousState
    assert vars(decoded) == vars(state)
    assert list(vars(decoded)) == list(codec._STATE_FIELDS)


def test_roundtrip_of_the_initial_state() -> None:
    decoded = dr.decode_state(codec._encode_state(codec._RendezvousState()), SOURCE)
    assert vars(decoded) == vars(codec._RendezvousState())


def test_decoded_nodes_are_usable_as_keys_and_shared() -> None:
    decoded = dr.decode_state(codec._encode_state(make_state()), SOURCE)
    a = codec._NodeDesc("host-a.example.com", 101, 0)
    assert decoded.participants[a] == 0
    assert a in decoded.last_heartbeats
    assert codec._NodeDesc("host-c.example.com", 303, 2) in decoded.wait_list
    # One object per node, as in the pickles PyTorch writes (they memoize the node).
    (in_participants,) = (n for n in decoded.participants if n == a)
    (in_heartbeats,) = (n for n in decoded.last_heartbeats if n == a)
    assert in_participants is in_heartbeats


def test_encoding_names_pytorch_classes_and_nothing_else() -> None:
    data = codec._encode_state(make_state())
    assert data[:2] == pickle.PROTO + bytes([max(4, pickle.DEFAULT_PROTOCOL)])
    assert globals_in(data) == {
        (TORCH_MODULE, "_RendezvousState"),
        (TORCH_MODULE, "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
    }
    assert b"etcd_rendezvous" not in data


def test_encoding_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from etcd_rendezvous import dynamic_rendezvous as dr\n"
        "from etcd_rendezvous._dynamic import state as codec\n"
        "data = codec._encode_state(codec._RendezvousState())\n"
        "dr.decode_state(data, 'x')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_encoded_size_is_within_pytorchs_limits() -> None:
    """The same bounds as PyTorch's own test (base64 of the state, as etcd-v2 stores it)."""
    state = codec._RendezvousState()
    state.round = 1
    state.complete = True
    state.deadline = T0
    state.closed = True
    for num_nodes, max_bytes in ((5, 2 * 2**10), (50, 16 * 2**10), (500, 160 * 2**10)):
        for i in range(num_nodes):
            running = codec._NodeDesc(f"dummy{i}.dummy1-dummy1-dummy1-dummy1.com", 12345, i)
            waiting = codec._NodeDesc(f"dummy{i}.dummy2-dummy2-dummy2-dummy2.com", 67890, i)
            state.participants[running] = i
            state.wait_list.add(waiting)
            state.last_heartbeats[running] = T0
            state.last_heartbeats[waiting] = T0
        assert len(b64encode(codec._encode_state(state))) <= max_bytes, num_nodes


# -- interoperability with PyTorch 2.13 ----------------------------------------------------------


@pytest.fixture(scope="module")
def torch_dr() -> Any:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as module

    return module


@pytest.mark.torch
def test_torch_loads_our_state_into_its_classes(torch_dr: Any) -> None:
    loaded = pickle.loads(codec._encode_state(make_state()))
    assert type(loaded) is torch_dr._RendezvousState
    assert as_plain(loaded) == as_plain(make_state())
    assert all(type(n) is torch_dr._NodeDesc for n in loaded.participants)
    # Their dataclass equality, hashing and ordering work on the loaded nodes.
    a = torch_dr._NodeDesc("host-a.example.com", 101, 0)
    assert loaded.participants[a] == 0
    assert a in loaded.last_heartbeats
    assert torch_dr._NodeDesc("host-c.example.com", 303, 2) in loaded.wait_list
    assert sorted(loaded.participants) == [a, torch_dr._NodeDesc("host-b.example.com", 202, 1)]
    assert repr(a) == "host-a.example.com_101_0"


@pytest.mark.torch
def test_our_bytes_are_pytorchs_bytes(torch_dr: Any) -> None:
    assert codec._encode_state(make_state()) == pickle.dumps(make_state(torch_dr))
    assert codec._encode_state(codec._RendezvousState()) == pickle.dumps(
        torch_dr._RendezvousState()
    )


@pytest.mark.torch
@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_we_decode_pytorchs_state(torch_dr: Any, protocol: int) -> None:
    theirs = make_state(torch_dr)
    decoded = dr.decode_state(pickle.dumps(theirs, protocol=protocol), SOURCE)
    assert type(decoded) is codec._RendezvousState
    assert as_plain(decoded) == as_plain(theirs)
    assert vars(decoded) == vars(make_state())


@pytest.mark.torch
def test_pytorchs_globals_are_exactly_the_allow_list(torch_dr: Any) -> None:
    seen: set[tuple[str, str]] = set()
    for protocol in (3, 4, 5):
        seen |= globals_in(pickle.dumps(make_state(torch_dr), protocol=protocol))
    assert seen == set(codec._ALLOWED_GLOBALS)


@pytest.mark.torch
def test_torch_state_written_by_pytorchs_holder_decodes(torch_dr: Any) -> None:
    """A state as PyTorch's own state holder writes it, read back through ours."""
    settings = torch_dr.RendezvousSettings(
        "run-1", 1, 2, torch_dr.RendezvousTimeout(), timedelta(seconds=5), 3
    )
    written: list[bytes] = []

    class Capture(torch_dr.RendezvousBackend):  # type: ignore[misc]
        name = "capture"

        def get_state(self) -> None:
            return None

        def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, int, bool]:
            written.append(state)
            return state, 1, True

    holder = torch_dr._BackendRendezvousStateHolder(Capture(), settings)
    node = torch_dr._NodeDesc("host-a", 1, 0)
    holder.state.participants[node] = 0
    holder.state.last_heartbeats[node] = datetime.now(timezone.utc)
    holder.mark_dirty()
    holder.sync()
    decoded = dr.decode_state(written[0], SOURCE)
    assert decoded.participants == {codec._NodeDesc("host-a", 1, 0): 0}


# -- hostile and malformed payloads ------------------------------------------------------------


class _Reduce:
    """Pickles as ``func(*args)``: what an attacker writes into the key."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _hostile_payloads(marker: Path) -> dict[str, Any]:
    return {
        "os.system": _Reduce(os.system, f"touch {marker}"),
        "builtins.eval": _Reduce(eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": _Reduce(exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess.Popen": _Reduce(subprocess.Popen, ["touch", str(marker)]),
    }


@pytest.mark.parametrize(
    "kind", ["os.system", "builtins.eval", "builtins.exec", "subprocess.Popen"]
)
@pytest.mark.parametrize("where", ["top", "nested"])
def test_hostile_pickle_is_rejected_and_not_executed(tmp_path: Path, kind: str, where: str) -> None:
    marker = tmp_path / "pwned"
    payload = _hostile_payloads(marker)[kind]
    if where == "top":
        data = pickle.dumps(payload)
    else:
        # Hidden inside an otherwise valid state, as a participant's rank.
        state = make_state()
        state.participants[codec._NodeDesc("evil", 1, 1)] = payload
        data = codec._encode_state(state)

    with pytest.raises(RendezvousStateError) as excinfo:
        dr.decode_state(data, SOURCE)
    message = str(excinfo.value)
    assert SOURCE in message
    assert "not part of a rendezvous state" in message
    assert not marker.exists()

    # The payload is real: pickle.loads, as PyTorch decodes, runs it. (The nested one
    # names PyTorch's classes, so loading it needs PyTorch.)
    if where == "nested" and importlib.util.find_spec("torch") is None:
        return
    loaded = pickle.loads(data)
    if kind == "subprocess.Popen":
        if where == "nested":
            (loaded,) = (rank for n, rank in loaded.participants.items() if n.addr == "evil")
        loaded.wait()
    assert marker.exists()


def test_other_names_in_pytorchs_module_are_rejected() -> None:
    """Only the two state classes resolve, not the rest of PyTorch's module."""
    name = b"create_handler"
    forged = (
        b"\x80\x04\x8c"
        + bytes([len(TORCH_MODULE)])
        + TORCH_MODULE.encode()
        + b"\x8c"
        + bytes([len(name)])
        + name
        + b"\x93)R."
    )
    with pytest.raises(
        RendezvousStateError, match=rf"refers to {TORCH_MODULE}.create_handler, which is not"
    ):
        dr.decode_state(forged, SOURCE)


def test_persistent_ids_are_rejected() -> None:
    class WithPid(codec._StatePickler):
        def persistent_id(self, obj: Any) -> Any:
            return "pid" if isinstance(obj, codec._NodeDesc) else None

    buffer = io.BytesIO()
    WithPid(buffer, protocol=4).dump(make_state())
    with pytest.raises(RendezvousStateError, match=r"not a valid pickle \(UnpicklingError"):
        dr.decode_state(buffer.getvalue(), SOURCE)


def _with(**changes: Any) -> bytes:
    state = make_state()
    for name, value in changes.items():
        setattr(state, name, value)
    return codec._encode_state(state)


def _node_with(**changes: Any) -> bytes:
    state = make_state()
    node = codec._NodeDesc("host-x", 1, 9)
    for name, value in changes.items():
        object.__setattr__(node, name, value)
    state.wait_list = {node}
    return codec._encode_state(state)


def _without(name: str) -> bytes:
    state = make_state()
    delattr(state, name)
    return codec._encode_state(state)


NODE = codec._NodeDesc("host-a", 1, 0)

WRONG = {
    "bare list": (pickle.dumps([1, 2, 3]), "holds a list, not a rendezvous state"),
    "dict": (pickle.dumps({"round": 1}), "holds a dict"),
    "None": (pickle.dumps(None), "holds a NoneType"),
    "a node": (codec._encode_state(NODE), "holds a _NodeDesc"),
    "round str": (_with(round="3"), "'round' must be an int"),
    "round bool": (_with(round=True), "'round' must be an int"),
    "complete int": (_with(complete=1), "'complete' must be a bool"),
    "closed None": (_with(closed=None), "'closed' must be a bool"),
    "naive deadline": (_with(deadline=datetime(2024, 1, 1)), "'deadline' must be a timezone-aware"),
    "deadline timedelta": (_with(deadline=timedelta(1)), "'deadline' must be a timezone-aware"),
    "participants list": (_with(participants=[NODE]), "'participants' must be a dict"),
    "participant str key": (_with(participants={"host-a": 0}), "must hold nodes, not str"),
    "rank str": (_with(participants={NODE: "0"}), "a rank in 'participants' must be an int"),
    "wait_list list": (_with(wait_list=[NODE]), "'wait_list' must be a set"),
    "redundancy frozenset": (_with(redundancy_list=frozenset()), "'redundancy_list' must be a set"),
    "heartbeats list": (_with(last_heartbeats=[]), "'last_heartbeats' must be a dict"),
    "heartbeat int": (_with(last_heartbeats={NODE: 5}), "a time in 'last_heartbeats'"),
    "heartbeat naive": (
        _with(last_heartbeats={NODE: datetime(2024, 1, 1)}),
        "a time in 'last_heartbeats'",
    ),
    "node addr int": (_node_with(addr=5), "a node address in 'wait_list' must be a str"),
    "node pid str": (_node_with(pid="1"), "a node pid in 'wait_list' must be an int"),
    "node local_id bool": (_node_with(local_id=False), "a node local_id in 'wait_list'"),
    "node extra attribute": (_node_with(extra=1), "unexpected attributes ['extra']"),
    "missing attribute": (_without("closed"), "missing attributes ['closed']"),
    "extra attribute": (_with(shell="rm -rf /"), "unexpected attributes ['shell']"),
    "not a pickle": (b"corrupt_state", "not a valid pickle"),
    "empty": (b"", "not a valid pickle"),
    "truncated": (codec._encode_state(make_state())[:-20], "not a valid pickle"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_malformed_state_is_rejected_naming_the_source(case: str) -> None:
    data, problem = WRONG[case]
    with pytest.raises(RendezvousStateError) as excinfo:
        dr.decode_state(data, SOURCE)
    message = str(excinfo.value)
    assert message.startswith(f"The rendezvous state in {SOURCE} is corrupt: ")
    assert problem in message
    assert "Nothing in it was executed." in message


def test_node_hashed_before_it_was_built_does_not_corrupt_sets() -> None:
    """A node added to a set before its BUILD has no attributes yet: rejected cleanly."""
    # EMPTY_SET, then a _NodeDesc with no state yet added to it (hashing fails).
    forged = (
        b"\x80\x04"
        + b"\x8c"
        + bytes([len(TORCH_MODULE)])
        + TORCH_MODULE.encode()
        + b"\x8c\x09_NodeDesc\x93)\x81\x94"  # node, memoized as 0
        + b"\x8f(h\x00\x90."  # {node}
    )
    with pytest.raises(RendezvousStateError, match="not a valid pickle"):
        dr.decode_state(forged, SOURCE)


def test_holder_names_the_backends_key(tmp_path: Path) -> None:
    class NamedBackend(dr.RendezvousBackend):
        @property
        def name(self) -> str:
            return "etcd-v2"

        @property
        def state_key(self) -> str:
            return "/torch/elastic/rendezvous/run-1"

        def get_state(self) -> tuple[bytes, Any]:
            return pickle.dumps(_Reduce(os.system, f"touch {tmp_path / 'pwned'}")), 1

        def set_state(self, state: bytes, token: Any = None) -> None:
            return None

    settings = dr.RendezvousSettings("run-1", 1, 1, dr.RendezvousTimeout(), timedelta(seconds=5), 3)
    holder = BackendStateHolder(NamedBackend(), settings)
    with pytest.raises(
        RendezvousStateError, match=r"in etcd-v2 key '/torch/elastic/rendezvous/run-1' is corrupt"
    ):
        holder.sync(Deadline(10))
    assert not (tmp_path / "pwned").exists()
