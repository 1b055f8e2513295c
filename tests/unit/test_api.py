"""Unit tests for etcd_rendezvous.api: errors, parameters, store info and the registry."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest

import etcd_rendezvous
from etcd_rendezvous import api, registry
from etcd_rendezvous.api import (
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
    Store,
)


class DictStore:
    """In-memory stand-in for a c10d store, shared by every "rank" of a test."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, value: int) -> int:
        total = int(self.data.get(key, b"0")) + value
        self.data[key] = str(total).encode()
        return total

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        missing = [key for key in keys if key not in self.data]
        if missing:
            raise TimeoutError(missing)

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)


class FakeHandler(RendezvousHandler):
    """Minimal concrete handler reporting whatever backend name it is given."""

    def __init__(self, backend: str) -> None:
        self._backend = backend

    def get_backend(self) -> str:
        return self._backend

    def next_rendezvous(self) -> RendezvousInfo:
        raise RendezvousClosedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "run"

    def shutdown(self) -> bool:
        return True


def create_fake(params: RendezvousParameters) -> RendezvousHandler:
    """Creator returning a handler that reports the requested backend."""
    return FakeHandler(params.backend)


def make_params(backend: str = "dummy", **kwargs: Any) -> RendezvousParameters:
    return RendezvousParameters(backend, "localhost:2379", "run", 1, 2, **kwargs)


# Errors


@pytest.mark.parametrize(
    "error",
    [
        RendezvousClosedError,
        RendezvousTimeoutError,
        RendezvousConnectionError,
        RendezvousStateError,
        RendezvousGracefulExitError,
    ],
)
def test_errors_derive_from_rendezvous_error(error: type[Exception]) -> None:
    assert issubclass(error, RendezvousError)
    assert issubclass(error, Exception)


def test_all_names_exist() -> None:
    names = vars(api)
    assert [name for name in api.__all__ if name not in names] == []
    assert len(set(api.__all__)) == len(api.__all__)
    # Every public class and function the module defines is exported.
    defined = {
        name
        for name, value in names.items()
        if not name.startswith("_") and getattr(value, "__module__", None) == api.__name__
    }
    assert defined - set(api.__all__) == set()


@pytest.mark.torch
def test_all_is_superset_of_torch_api() -> None:
    torch_api = pytest.importorskip("torch.distributed.elastic.rendezvous.api")
    assert set(torch_api.__all__) <= set(api.__all__)
    for name in torch_api.__all__:
        ours, theirs = getattr(api, name), getattr(torch_api, name)
        if isinstance(theirs, type) and issubclass(theirs, BaseException):
            assert ours.__name__ == theirs.__name__
            assert [c.__name__ for c in ours.__mro__[:-2]] == [
                c.__name__ for c in theirs.__mro__[:-2]
            ]


# RendezvousParameters


def test_parameters_store_fields_and_config() -> None:
    params = RendezvousParameters(
        "etcd", "host:2379", "job", 2, 4, local_addr="10.0.0.1", timeout="30"
    )
    assert params.backend == "etcd"
    assert params.endpoint == "host:2379"
    assert params.run_id == "job"
    assert (params.min_nodes, params.max_nodes) == (2, 4)
    assert params.local_addr == "10.0.0.1"
    assert params.config == {"timeout": "30"}
    assert params.get("timeout") == "30"
    assert params.get("missing") is None
    assert params.get("missing", 7) == 7


def test_parameters_reject_empty_backend() -> None:
    with pytest.raises(ValueError, match=r"^The rendezvous backend name must be a non-empty"):
        RendezvousParameters("", "host", "run", 1, 1)


def test_parameters_reject_min_nodes_below_one() -> None:
    with pytest.raises(
        ValueError,
        match=r"^The minimum number of rendezvous nodes \(0\) must be greater than zero\.$",
    ):
        RendezvousParameters("etcd", "host", "run", 0, 1)


def test_parameters_reject_max_below_min() -> None:
    with pytest.raises(
        ValueError,
        match=(
            r"^The maximum number of rendezvous nodes \(2\) must be greater than or equal to "
            r"the minimum number of rendezvous nodes \(3\)\.$"
        ),
    ):
        RendezvousParameters("etcd", "host", "run", 3, 2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        ("1", True),
        ("TRUE", True),
        ("t", True),
        ("Yes", True),
        ("y", True),
        ("0", False),
        ("false", False),
        ("F", False),
        ("no", False),
        ("N", False),
    ],
)
def test_get_as_bool_accepts(value: object, expected: bool) -> None:
    assert make_params(flag=value).get_as_bool("flag") is expected


@pytest.mark.parametrize("value", [2, -1, "maybe", "", 1.0, [1]])
def test_get_as_bool_rejects_naming_key(value: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous configuration option 'flag' does not represent a valid boolean",
    ):
        make_params(flag=value).get_as_bool("flag")


def test_get_as_bool_default() -> None:
    params = make_params()
    assert params.get_as_bool("flag") is None
    assert params.get_as_bool("flag", True) is True
    assert params.get_as_bool("flag", False) is False


@pytest.mark.parametrize(("value", "expected"), [(30, 30), ("30", 30), (" 7 ", 7), ("-1", -1)])
def test_get_as_int_accepts(value: object, expected: int) -> None:
    assert make_params(timeout=value).get_as_int("timeout") == expected


@pytest.mark.parametrize("value", ["abc", "3.5", "", [1], object()])
def test_get_as_int_rejects_naming_key(value: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous configuration option 'timeout' does not represent a valid integer",
    ):
        make_params(timeout=value).get_as_int("timeout")


def test_get_as_int_default() -> None:
    params = make_params()
    assert params.get_as_int("timeout") is None
    assert params.get_as_int("timeout", 600) == 600


# RendezvousStoreInfo


def test_store_info_keys() -> None:
    assert RendezvousStoreInfo.MASTER_ADDR_KEY == "MASTER_ADDR"
    assert RendezvousStoreInfo.MASTER_PORT_KEY == "MASTER_PORT"
    assert RendezvousStoreInfo("h", 1) == RendezvousStoreInfo(master_addr="h", master_port=1)


def test_store_info_build_rank0_publishes_and_rank1_reads() -> None:
    store = DictStore()

    info0 = RendezvousStoreInfo.build(0, store, "10.0.0.1", server_port=29500)
    info1 = RendezvousStoreInfo.build(1, store, "10.0.0.2")

    assert store.data == {"MASTER_ADDR": b"10.0.0.1", "MASTER_PORT": b"29500"}
    assert info0 == RendezvousStoreInfo("10.0.0.1", 29500)
    assert info1 == info0


def test_store_info_build_rank0_picks_free_port_and_hostname() -> None:
    store = DictStore()

    info = RendezvousStoreInfo.build(0, store, None)

    assert info.master_addr == socket.getfqdn()
    assert 0 < info.master_port < 2**16


def test_store_info_build_nonzero_rank_does_not_write() -> None:
    store = DictStore()
    store.set("MASTER_ADDR", "a")
    store.set("MASTER_PORT", "1234")

    info = RendezvousStoreInfo.build(3, store, "ignored", server_port=1)

    assert info == RendezvousStoreInfo("a", 1234)
    assert store.data == {"MASTER_ADDR": b"a", "MASTER_PORT": b"1234"}


def test_get_free_port_is_bindable() -> None:
    port = api._get_free_port()
    assert 0 < port < 2**16
    with socket.socket() as sock:
        sock.bind(("localhost", port))


# RendezvousInfo and RendezvousHandler


def test_rendezvous_info_properties() -> None:
    store: Store = DictStore()
    store_info = RendezvousStoreInfo("h", 1)
    info = RendezvousInfo(store, 2, 4, store_info)
    assert info.store is store
    assert info.rank == 2
    assert info.world_size == 4
    assert info.bootstrap_store_info is store_info


def test_handler_is_abstract_and_defaults_use_agent_store_false() -> None:
    with pytest.raises(TypeError):
        RendezvousHandler()  # type: ignore[abstract]
    assert FakeHandler("x").use_agent_store is False


# RendezvousHandlerRegistry


def test_registry_creates_registered_handler() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("dummy", create_fake)

    handler = registry.create_handler(make_params("dummy"))

    assert isinstance(handler, FakeHandler)
    assert handler.get_backend() == "dummy"


def test_registry_rejects_empty_backend() -> None:
    with pytest.raises(ValueError, match=r"^The rendezvous backend name must be a non-empty"):
        RendezvousHandlerRegistry().register("", create_fake)


def test_registry_same_creator_twice_is_noop() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("dummy", create_fake)
    registry.register("dummy", create_fake)  # no error

    handler = registry.create_handler(make_params("dummy"))
    assert isinstance(handler, FakeHandler)
    assert handler.get_backend() == "dummy"


def test_registry_rejects_different_creator() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("dummy", create_fake)

    with pytest.raises(
        ValueError,
        match=r"^The rendezvous backend 'dummy' cannot be registered with .* as it is already "
        r"registered with ",
    ):
        registry.register("dummy", lambda params: FakeHandler("dummy"))


def test_registry_unknown_backend() -> None:
    with pytest.raises(
        ValueError,
        match=r"^The rendezvous backend 'nope' is not registered\. Did you forget to call "
        r"`register`\?$",
    ):
        RendezvousHandlerRegistry().create_handler(make_params("nope"))


def test_registry_backend_mismatch() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("dummy", lambda params: FakeHandler("other"))

    with pytest.raises(
        RuntimeError,
        match=r"^The rendezvous backend 'other' does not match the requested backend 'dummy'\.$",
    ):
        registry.create_handler(make_params("dummy"))


def test_global_registry_is_a_registry() -> None:
    # One global registry: the package root and etcd_rendezvous.registry use api's.
    assert etcd_rendezvous.rendezvous_handler_registry is api.rendezvous_handler_registry
    assert registry.handler_registry is api.rendezvous_handler_registry
    name = "test-global-registry"
    api.rendezvous_handler_registry.register(name, create_fake)
    try:
        handler = registry.get_rendezvous_handler(make_params(name))
    finally:
        del api.rendezvous_handler_registry._registry[name]
    assert handler.get_backend() == name
