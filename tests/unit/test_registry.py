"""Unit tests for etcd_rendezvous.registry: default backends and handler lookup."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

from etcd_rendezvous import api, registry
from etcd_rendezvous.api import RendezvousParameters, rendezvous_handler_registry
from etcd_rendezvous.registry import get_rendezvous_handler

from .test_api import FakeHandler, create_fake


@pytest.fixture
def dummy_backend() -> Iterator[str]:
    """Register a throw-away backend in the global registry and remove it afterwards."""
    name = "dummy-test-backend"
    rendezvous_handler_registry.register(name, create_fake)
    yield name
    del rendezvous_handler_registry._registry[name]


def make_params(backend: str) -> RendezvousParameters:
    return RendezvousParameters(backend, "localhost:2379", "run", 1, 1)


def test_all() -> None:
    assert registry.__all__ == ["get_rendezvous_handler"]


def test_get_handler_for_registered_backend(dummy_backend: str) -> None:
    handler = get_rendezvous_handler(make_params(dummy_backend))

    assert isinstance(handler, FakeHandler)
    assert handler.get_backend() == dummy_backend


def test_get_handler_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"^The rendezvous backend 'no-such' is not registered"):
        get_rendezvous_handler(make_params("no-such"))


def test_get_handler_backend_mismatch() -> None:
    name = "mismatching-test-backend"
    rendezvous_handler_registry.register(name, lambda params: FakeHandler("something-else"))
    try:
        with pytest.raises(RuntimeError, match=r"does not match the requested backend"):
            get_rendezvous_handler(make_params(name))
    finally:
        del rendezvous_handler_registry._registry[name]


def test_etcd_is_registered_with_lazy_creator() -> None:
    assert rendezvous_handler_registry._registry["etcd"] is registry._create_etcd_handler


def test_backends_are_also_registered_under_their_torchrun_names() -> None:
    entries = rendezvous_handler_registry._registry
    assert entries["etcd-rendezvous"] is registry._create_etcd_handler
    assert entries["etcd-rendezvous-v2"] is registry._create_etcd_v2_handler


def test_register_default_handlers_is_idempotent() -> None:
    registry._register_default_handlers()
    registry._register_default_handlers()
    assert rendezvous_handler_registry._registry["etcd"] is registry._create_etcd_handler


def test_etcd_cannot_be_reregistered_with_other_creator() -> None:
    with pytest.raises(ValueError, match=r"^The rendezvous backend 'etcd' cannot be registered"):
        api.rendezvous_handler_registry.register("etcd", create_fake)


def test_etcd_creator_imports_backend_module_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RendezvousParameters] = []

    def create_rdzv_handler(params: RendezvousParameters) -> FakeHandler:
        seen.append(params)
        return FakeHandler("etcd")

    fake_module = types.ModuleType("etcd_rendezvous.etcd_rendezvous")
    fake_module.create_rdzv_handler = create_rdzv_handler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etcd_rendezvous.etcd_rendezvous", fake_module)
    params = make_params("etcd")

    handler = get_rendezvous_handler(params)

    assert isinstance(handler, FakeHandler)
    assert seen == [params]


def test_etcd_v2_is_registered_with_lazy_creator() -> None:
    assert rendezvous_handler_registry._registry["etcd-v2"] is registry._create_etcd_v2_handler


def test_etcd_v2_creator_builds_backend_then_dynamic_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, object]] = []
    backend, store = object(), object()

    def create_backend(params: RendezvousParameters) -> tuple[object, object]:
        calls.append(("create_backend", params))
        return backend, store

    def create_handler(
        s: object, b: object, params: RendezvousParameters, *, backend_name: str, owns_backend: bool
    ) -> FakeHandler:
        calls.append(("create_handler", (s, b, params, backend_name, owns_backend)))
        return FakeHandler(backend_name)

    fake_backend = types.ModuleType("etcd_rendezvous.etcd_rendezvous_backend")
    fake_backend.create_backend = create_backend  # type: ignore[attr-defined]
    fake_dynamic = types.ModuleType("etcd_rendezvous.dynamic_rendezvous")
    fake_dynamic.create_handler = create_handler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etcd_rendezvous.etcd_rendezvous_backend", fake_backend)
    monkeypatch.setitem(sys.modules, "etcd_rendezvous.dynamic_rendezvous", fake_dynamic)
    params = make_params("etcd-v2")

    handler = get_rendezvous_handler(params)

    assert isinstance(handler, FakeHandler)
    assert calls == [
        ("create_backend", params),
        # The handler owns the backend (and its connection): its close() releases them.
        ("create_handler", (store, backend, params, "etcd-v2", True)),
    ]


def test_importing_the_registry_imports_no_backend() -> None:
    code = (
        "import sys, etcd_rendezvous.registry\n"
        "loaded = [m for m in ('etcd', 'etcd_rendezvous.dynamic_rendezvous',\n"
        "          'etcd_rendezvous.etcd_rendezvous_backend') if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
