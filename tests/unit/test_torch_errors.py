"""This package's rendezvous errors as torch's where torch's rendezvous is loaded.

With a stand-in for torch's API module (so these run without torch), with real torch
when it is installed, and without either (nothing changes, torch is never imported).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import types

import pytest

from etcd_rendezvous import api
from etcd_rendezvous._torch_errors import TORCH_API_MODULE, as_torch_error, torch_errors
from etcd_rendezvous.events import NodeState, _records_failure

NAMES = [
    "RendezvousError",
    "RendezvousClosedError",
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousStateError",
    "RendezvousGracefulExitError",
]


def _stand_in() -> types.ModuleType:
    """A module with torch's rendezvous error tree (same names, its own classes)."""
    module = types.ModuleType(TORCH_API_MODULE)
    base = type("RendezvousError", (Exception,), {})
    module.RendezvousError = base  # type: ignore[attr-defined]
    for name in NAMES[1:]:
        setattr(module, name, type(name, (base,), {}))
    return module


@pytest.fixture
def torch_api(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = _stand_in()
    monkeypatch.setitem(sys.modules, TORCH_API_MODULE, module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_each_error_is_caught_as_torch_s_and_as_ours(
    torch_api: types.ModuleType, name: str
) -> None:
    ours: type[Exception] = getattr(api, name)
    theirs: type[Exception] = getattr(torch_api, name)
    error = ours("The rendezvous 'job' is closed.")
    assert as_torch_error(error) is error
    assert isinstance(error, theirs)
    assert isinstance(error, ours)
    assert isinstance(error, torch_api.RendezvousError)
    assert type(error).__name__ == name
    assert str(error) == "The rendezvous 'job' is closed."
    # Each maps to its namesake only: a closed error is no timeout of torch's.
    others = [getattr(torch_api, n) for n in NAMES[1:] if n != name]
    assert not any(isinstance(error, other) for other in others)


def test_torch_s_except_clause_catches_a_decorated_method_s_error(
    torch_api: types.ModuleType,
) -> None:
    @torch_errors
    def exit_gracefully() -> None:
        try:
            raise KeyError("cause")
        except KeyError as cause:
            raise api.RendezvousGracefulExitError("Not in the round.") from cause

    with pytest.raises(torch_api.RendezvousGracefulExitError) as raised:
        exit_gracefully()
    assert isinstance(raised.value, api.RendezvousGracefulExitError)
    # Message, cause and traceback are the original's.
    assert str(raised.value) == "Not in the round."
    assert isinstance(raised.value.__cause__, KeyError)
    assert raised.traceback[-1].name == "exit_gracefully"


def test_our_subclasses_map_to_their_nearest_base_torch_has(
    torch_api: types.ModuleType,
) -> None:
    class LeaseLost(api.RendezvousConnectionError):
        pass

    error = as_torch_error(LeaseLost("lease 7 is gone"))
    assert isinstance(error, torch_api.RendezvousConnectionError)
    assert isinstance(error, LeaseLost)
    assert type(error).__name__ == "LeaseLost"


def test_a_request_too_large_is_torch_s_plain_rendezvous_error(
    torch_api: types.ModuleType,
) -> None:
    """A state over etcd's limit is a configuration error: torch's base class, which ends
    the agent, never its graceful exit (a success) nor a timeout or closed rendezvous;
    it pickles with what it names."""
    error = api.RequestTooLargeError(
        "too large: --max-request-bytes", key="/k", size=9000, endpoint="e", answer="a", api="v3"
    )
    assert as_torch_error(error) is error
    assert isinstance(error, torch_api.RendezvousError)
    assert not any(isinstance(error, getattr(torch_api, n)) for n in NAMES[1:])
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, torch_api.RendezvousError)
    assert isinstance(copy, api.RequestTooLargeError)
    assert (copy.key, copy.size, copy.endpoint, copy.answer, copy.api) == (
        "/k",
        9000,
        "e",
        "a",
        "v3",
    )
    assert str(copy) == "too large: --max-request-bytes"


def test_other_errors_and_torch_s_own_pass_unchanged(torch_api: types.ModuleType) -> None:
    value_error = ValueError("join_timeout: not a number")
    assert type(as_torch_error(value_error)) is ValueError
    theirs = torch_api.RendezvousClosedError("closed")
    assert type(as_torch_error(theirs)) is torch_api.RendezvousClosedError


def test_handler_methods_raise_torch_s_errors_through_records_failure(
    torch_api: types.ModuleType,
) -> None:
    recorded: list[str] = []

    class Handler:
        def _record(self, message: str, node_state: NodeState, *, method: str) -> None:
            recorded.append(message)

        @_records_failure
        def next_rendezvous(self) -> None:
            raise api.RendezvousTimeoutError("The node could not join within 600 s.")

    with pytest.raises(torch_api.RendezvousTimeoutError):
        Handler().next_rendezvous()
    assert recorded == ["RendezvousTimeoutError: The node could not join within 600 s."]


def test_without_torch_s_rendezvous_loaded_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, TORCH_API_MODULE, raising=False)
    error = api.RendezvousClosedError("closed")
    assert as_torch_error(error) is error
    assert type(error) is api.RendezvousClosedError


def test_the_mapping_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from etcd_rendezvous import api, registry, torchrun\n"
        "from etcd_rendezvous._torch_errors import as_torch_error\n"
        "e = as_torch_error(api.RendezvousGracefulExitError('x'))\n"
        "assert type(e) is api.RendezvousGracefulExitError, type(e).__mro__\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.torch
@pytest.mark.parametrize("name", NAMES)
def test_real_torch_catches_our_errors(name: str) -> None:
    torch_api = pytest.importorskip(TORCH_API_MODULE, reason="PyTorch is not installed")
    error = as_torch_error(getattr(api, name)("message"))
    assert isinstance(error, getattr(torch_api, name))
    assert isinstance(error, getattr(api, name))


@pytest.mark.parametrize("name", NAMES)
def test_a_re_classed_error_pickles_and_stays_torch_s(
    torch_api: types.ModuleType, name: str
) -> None:
    """torch's agent sends a worker's error through pickle (multiprocessing)."""
    error = as_torch_error(getattr(api, name)("The rendezvous 'job' is closed.", 7))
    error.endpoint = "http://127.0.0.1:2379"  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert isinstance(copy, getattr(torch_api, name))
    assert copy.args == ("The rendezvous 'job' is closed.", 7)
    assert copy.endpoint == "http://127.0.0.1:2379"


def test_a_re_classed_error_unpickles_as_ours_where_torch_is_not_loaded(
    torch_api: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = pickle.dumps(as_torch_error(api.RendezvousTimeoutError("x")))
    monkeypatch.delitem(sys.modules, TORCH_API_MODULE)
    copy = pickle.loads(data)
    assert type(copy) is api.RendezvousTimeoutError
    assert copy.args == ("x",)


@pytest.mark.torch
@pytest.mark.parametrize("name", NAMES)
def test_real_torch_error_pickles(name: str) -> None:
    torch_api = pytest.importorskip(TORCH_API_MODULE, reason="PyTorch is not installed")
    error = as_torch_error(getattr(api, name)("message"))
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, getattr(torch_api, name))
    assert isinstance(copy, getattr(api, name))
    assert str(copy) == "message"
