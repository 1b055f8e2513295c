"""The PyTorch side of the package: TorchEtcdStore, the torchrun entry points, the
replacement of PyTorch's ``etcd``/``etcd-v2`` backends, and ``--rdzv-conf`` strings.

Skipped when PyTorch is not installed (CI installs ``torch==2.13.0``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any

import pytest

from etcd_rendezvous import torchrun
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from support import TORCH_PG_WORKER

dist = pytest.importorskip("torch.distributed", reason="PyTorch is not installed")
torch_rdzv = pytest.importorskip("torch.distributed.elastic.rendezvous")
torch_registry = pytest.importorskip("torch.distributed.elastic.rendezvous.registry")

from etcd_rendezvous.torch_store import StoreTimeoutError, TorchEtcdStore  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def store(conn: Transport, run_id: str) -> TorchEtcdStore:
    return TorchEtcdStore(EtcdStore(conn, f"/test/{run_id}/kv", timeout=timedelta(seconds=5)))


# -- TorchEtcdStore ---------------------------------------------------------------------------


def test_torch_etcd_store_is_a_torch_store_with_etcd_semantics(store: TorchEtcdStore) -> None:
    assert isinstance(store, dist.Store)
    store.set("k", b"\x00v\xff")
    assert store.get("k") == b"\x00v\xff"
    store.set("s", "text")
    assert store.get("s") == b"text"
    assert store.add("n", 3) == 3
    assert store.add("n", -1) == 2
    assert store.compare_set("k", b"\x00v\xff", b"new") == b"new"
    assert store.compare_set("k", b"wrong", b"newer") == b"new"
    assert store.check(["k", "n"]) is True
    assert store.check(["k", "absent"]) is False
    store.multi_set(["m1", "m2"], [b"1", "2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    store.append("log", b"a")
    store.append("log", b"b")
    assert store.get("log") == b"ab"
    assert store.has_extended_api() is True
    assert store.num_keys() == 6
    assert store.delete_key("log") is True
    assert store.delete_key("log") is False
    assert store.num_keys() == 5


def test_values_are_shared_with_the_plain_store_and_torch_prefix_store(
    store: TorchEtcdStore,
) -> None:
    plain = store.etcd_store
    assert store.prefix == plain.prefix
    assert store.connection is plain.connection
    plain.set("from_plain", b"1")
    assert store.get("from_plain") == b"1"
    store.set("from_torch", b"2")
    assert plain.get("from_torch") == b"2"
    # c10d's C++ PrefixStore calls back into the Python store.
    prefixed = dist.PrefixStore("round.3", store)
    prefixed.set("x", b"y")
    assert plain.get("round.3/x") == b"y"
    assert prefixed.add("c", 5) == 5
    prefixed.wait(["x"])


def test_timeouts_raise_an_error_both_kinds_of_caller_catch(store: TorchEtcdStore) -> None:
    store.set_timeout(timedelta(milliseconds=300))
    assert store.timeout == timedelta(milliseconds=300)
    assert store.etcd_store.timeout == timedelta(milliseconds=300)
    with pytest.raises(StoreTimeoutError, match="missing") as caught:
        store.get("missing")
    assert isinstance(caught.value, LookupError)  # what EtcdStore users catch
    assert isinstance(caught.value, dist.DistStoreError)  # what PyTorch's stores raise
    with pytest.raises(StoreTimeoutError, match="also_missing"):
        store.wait(["also_missing"], timedelta(milliseconds=200))
    with pytest.raises(StoreTimeoutError):
        store.multi_get(["nope"])


def test_updates_that_keep_losing_raise_the_store_timeout_error(
    store: TorchEtcdStore, conn: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.set("n", "1")
    swap = conn.compare_and_swap
    counter = store.prefix + "bg=="  # base64 of "n"

    def rival_first(*args: Any, **kwargs: Any) -> Any:
        conn.set(counter, "MQ==")  # Another writer sets it to "1" again, first.
        return swap(*args, **kwargs)

    monkeypatch.setattr(conn, "compare_and_swap", rival_first)
    store.set_timeout(timedelta(milliseconds=300))
    for update in (
        lambda: store.add("n", 1),
        lambda: store.compare_set("n", "1", "2"),
        lambda: store.append("n", "0"),
    ):
        with pytest.raises(StoreTimeoutError, match="'n'") as caught:
            update()
        assert isinstance(caught.value, LookupError)
        assert isinstance(caught.value, dist.DistStoreError)
    assert store.get("n") == b"1"


def test_torch_etcd_store_wraps_only_an_etcd_store() -> None:
    with pytest.raises(TypeError, match="store: expected an EtcdStore, got dict"):
        TorchEtcdStore({})  # type: ignore[arg-type]


def _run_pg_workers(argv_per_rank: list[list[str]]) -> list[dict[str, Any]]:
    processes = [
        subprocess.Popen(
            [sys.executable, str(TORCH_PG_WORKER), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argv_per_rank
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_init_process_group_with_our_store_across_processes(
    etcd_server: EtcdServer, run_id: str
) -> None:
    endpoint = etcd_server.get_endpoint()
    prefix = f"/test/{run_id}/pg"
    results = _run_pg_workers([["store", endpoint, prefix, str(rank), "3"] for rank in range(3)])
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert {r["sum"] for r in results} == {1.0 + 2 + 3}
    assert {r["store_type"] for r in results} == {"TorchEtcdStore"}


@pytest.mark.parametrize("backend", [torchrun.BACKEND_NAME, torchrun.V2_BACKEND_NAME])
def test_pytorchs_registry_builds_our_handlers_whose_store_feeds_init_process_group(
    etcd_server: EtcdServer, run_id: str, backend: str
) -> None:
    argv = ["handler", backend, etcd_server.get_endpoint(), run_id, "2"]
    results = _run_pg_workers([argv, argv])
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["sum"] for r in results} == {3.0}
    assert {r["backend"] for r in results} == {backend}
    assert {r["is_torch_store"] for r in results} == {True}
    assert all(r["handler_module"].startswith("etcd_rendezvous.") for r in results)


# -- entry points and PyTorch's registry ------------------------------------------------------


def test_entry_points_are_registered_for_torchrun() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert found[torchrun.BACKEND_NAME] == "etcd_rendezvous.torchrun:etcd_rendezvous_handler"
    assert found[torchrun.V2_BACKEND_NAME] == "etcd_rendezvous.torchrun:etcd_rendezvous_v2_handler"
    # PyTorch loaded them when its rendezvous package was imported.
    registered = torch_rdzv.rendezvous_handler_registry._registry
    assert registered[torchrun.BACKEND_NAME] is torchrun.create_etcd_rendezvous_handler
    assert registered[torchrun.V2_BACKEND_NAME] is torchrun.create_etcd_rendezvous_v2_handler


def _torch_params(backend: str, endpoint: str, run_id: str, **config: Any) -> Any:
    return torch_rdzv.RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=2, **config
    )


@pytest.mark.parametrize("backend", [torchrun.BACKEND_NAME, torchrun.V2_BACKEND_NAME])
def test_handlers_report_the_requested_backend_name(
    etcd_server: EtcdServer, run_id: str, backend: str
) -> None:
    handler = torch_registry.get_rendezvous_handler(
        _torch_params(backend, etcd_server.get_endpoint(), run_id)
    )
    try:
        assert handler.get_backend() == backend
        assert type(handler).__module__.startswith("etcd_rendezvous.")
    finally:
        handler.shutdown()


def test_replace_torch_etcd_backends_in_a_registry(etcd_server: EtcdServer, run_id: str) -> None:
    registry = torch_rdzv.RendezvousHandlerRegistry()
    registry.register("etcd", lambda params: None)
    torchrun.replace_torch_etcd_backends(registry)
    for name in ("etcd", "etcd-v2"):
        handler = registry.create_handler(
            _torch_params(name, etcd_server.get_endpoint(), f"{run_id}-{name}")
        )
        try:
            assert handler.get_backend() == name
            assert type(handler).__module__.startswith("etcd_rendezvous.")
        finally:
            handler.shutdown()


def test_replace_torch_etcd_backends_in_pytorchs_global_registry(
    etcd_server: EtcdServer, run_id: str
) -> None:
    # A subprocess: the global registry is process state other tests rely on.
    script = f"""
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from etcd_rendezvous.torchrun import replace_torch_etcd_backends
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler
replace_torch_etcd_backends()
for name in ("etcd", "etcd-v2"):
    params = RendezvousParameters(name, {etcd_server.get_endpoint()!r}, {run_id!r} + name, 1, 1)
    handler = get_rendezvous_handler(params)
    ours = isinstance(handler, (EtcdRendezvousHandler, DynamicRendezvousHandler))
    print(name, handler.get_backend(), ours and type(handler).__name__)
    handler.shutdown()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert out[:2] == [
        "etcd etcd EtcdRendezvousHandler",
        "etcd-v2 etcd-v2 DynamicRendezvousHandler",
    ]


def test_replace_refuses_a_registry_without_the_private_layout() -> None:
    with pytest.raises(TypeError, match="registry: object has no private _registry"):
        torchrun.replace_torch_etcd_backends(object())


def test_params_of_the_wrong_type_are_named() -> None:
    with pytest.raises(TypeError, match="params: expected RendezvousParameters"):
        torchrun.create_etcd_rendezvous_handler({"backend": "etcd"})


# -- --rdzv-conf values arrive as strings -----------------------------------------------------


def test_every_legacy_option_parses_from_a_string(
    etcd_server: EtcdServer, run_id: str, tls_certs: dict[str, str]
) -> None:
    conf = {
        "timeout": "42",
        "last_call_timeout": "7",
        "etcd_prefix": "/custom/prefix",
        "protocol": "http",
        "read_timeout": "2.5",
        "connect_timeout": "1.5",
        "torch_store": "false",
        "etcd_api": "V3",
    }
    handler = torchrun.create_etcd_rendezvous_handler(
        _torch_params(torchrun.BACKEND_NAME, etcd_server.get_endpoint(), run_id, **conf)
    )
    try:
        rdzv = handler.rendezvous  # type: ignore[attr-defined]
        assert rdzv._timeout == 42.0
        assert rdzv._last_call_timeout == 7.0
        assert rdzv._prefix == "/custom/prefix/"
        assert rdzv.connection.read_timeout == 2.5
        assert rdzv.connection.connect_timeout == 1.5
        assert rdzv.connection.api == "v3"
        assert handler._torch_store is False  # type: ignore[attr-defined]
    finally:
        handler.close()


def test_every_v2_option_parses_from_a_string(etcd_server: EtcdServer, run_id: str) -> None:
    conf = {
        "join_timeout": "42",
        "last_call_timeout": "7",
        "close_timeout": "8",
        "heartbeat_timeout": "9",
        "keep_alive_interval": "2",
        "keep_alive_max_attempt": "4",
        "protocol": "http",
        "read_timeout": "2.5",
        "connect_timeout": "1.5",
        "torch_store": "true",
        "etcd_api": "v3",
    }
    handler = torchrun.create_etcd_rendezvous_v2_handler(
        _torch_params(torchrun.V2_BACKEND_NAME, etcd_server.get_endpoint(), run_id, **conf)
    )
    try:
        settings = handler.settings  # type: ignore[attr-defined]
        assert settings.timeout.join == timedelta(seconds=42)
        assert settings.timeout.last_call == timedelta(seconds=7)
        assert settings.timeout.close == timedelta(seconds=8)
        assert settings.timeout.heartbeat == timedelta(seconds=9)
        assert settings.keep_alive_interval == timedelta(seconds=2)
        assert settings.keep_alive_max_attempt == 4
        assert isinstance(handler._store, TorchEtcdStore)  # type: ignore[attr-defined]
        backend = handler._state_holder._backend  # type: ignore[attr-defined]
        assert backend.connection.read_timeout == 2.5
        assert backend.connection.connect_timeout == 1.5
        assert backend.connection.api == "v3"
    finally:
        handler.shutdown()


@pytest.mark.parametrize(
    ("backend", "option", "value"),
    [
        (torchrun.BACKEND_NAME, "last_call_timeout", "soon"),
        (torchrun.BACKEND_NAME, "read_timeout", "-1"),
        (torchrun.BACKEND_NAME, "torch_store", "maybe"),
        (torchrun.BACKEND_NAME, "protocol", "gopher"),
        (torchrun.BACKEND_NAME, "cacert", "/no/such/ca.crt"),
        (torchrun.BACKEND_NAME, "etcd_api", "v4"),
        (torchrun.V2_BACKEND_NAME, "keep_alive_interval", "often"),
        (torchrun.V2_BACKEND_NAME, "read_timeout", "slow"),
        (torchrun.V2_BACKEND_NAME, "connect_timeout", "0"),
        (torchrun.V2_BACKEND_NAME, "torch_store", "2"),
        (torchrun.V2_BACKEND_NAME, "ca_cert", "/no/such/ca.crt"),
        (torchrun.V2_BACKEND_NAME, "etcd_api", "3"),
    ],
)
def test_a_bad_string_option_is_named(
    etcd_server: EtcdServer, run_id: str, backend: str, option: str, value: str
) -> None:
    params = _torch_params(backend, etcd_server.get_endpoint(), run_id, **{option: value})
    create = (
        torchrun.create_etcd_rendezvous_handler
        if backend == torchrun.BACKEND_NAME
        else torchrun.create_etcd_rendezvous_v2_handler
    )
    with pytest.raises(ValueError, match=option):
        create(params)


# -- the torch_store option -------------------------------------------------------------------


def test_torch_store_option_chooses_the_store_type(etcd_server: EtcdServer, run_id: str) -> None:
    for value, expected in (("auto", TorchEtcdStore), ("false", EtcdStore), ("1", TorchEtcdStore)):
        params = RendezvousParameters(
            torchrun.BACKEND_NAME,
            etcd_server.get_endpoint(),
            f"{run_id}-{value}",
            1,
            1,
            last_call_timeout="0",
            torch_store=value,
        )
        with torchrun.create_etcd_rendezvous_handler(params) as handler:
            info = handler.next_rendezvous()
            assert type(info.store) is expected, value
            info.store.set("k", b"v")
            assert info.store.get("k") == b"v"
