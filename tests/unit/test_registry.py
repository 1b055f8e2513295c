"""Unit tests for etcd_rendezvous.registry: default backends and handler lookup."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import uuid

import pytest

from etcd_rendezvous import api, registry
from etcd_rendezvous.api import RendezvousParameters, rendezvous_handler_registry
from etcd_rendezvous.registry import get_rendezvous_handler
from support.net import closed_port

from .test_api import FakeHandler, create_fake


@pytest.fixture
def dummy_backend() -> str:
    """A throw-away backend registered in the global registry, under a name of its own."""
    name = f"dummy-test-backend-{uuid.uuid4().hex[:8]}"
    rendezvous_handler_registry.register(name, create_fake)
    return name


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
    name = f"mismatching-test-backend-{uuid.uuid4().hex[:8]}"
    rendezvous_handler_registry.register(name, lambda params: FakeHandler("something-else"))
    with pytest.raises(RuntimeError, match=r"does not match the requested backend"):
        get_rendezvous_handler(make_params(name))


def test_etcd_cannot_be_reregistered_with_other_creator() -> None:
    with pytest.raises(ValueError, match=r"^The rendezvous backend 'etcd' cannot be registered"):
        api.rendezvous_handler_registry.register("etcd", create_fake)


@pytest.mark.parametrize("name", ["etcd", "etcd-rendezvous"])
def test_the_etcd_backends_handler_comes_from_its_module(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under PyTorch's name and torchrun's plugin name, the registry creates the handler
    with ``etcd_rendezvous.etcd_rendezvous.create_rdzv_handler``, imported when needed."""
    seen: list[RendezvousParameters] = []

    def create_rdzv_handler(params: RendezvousParameters) -> FakeHandler:
        seen.append(params)
        return FakeHandler(params.backend)

    fake_module = types.ModuleType("etcd_rendezvous.etcd_rendezvous")
    fake_module.create_rdzv_handler = create_rdzv_handler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etcd_rendezvous.etcd_rendezvous", fake_module)
    params = make_params(name)

    handler = get_rendezvous_handler(params)

    assert isinstance(handler, FakeHandler)
    assert seen == [params]


@pytest.mark.parametrize("name", ["etcd-v2", "etcd-rendezvous-v2"])
def test_etcd_v2_creator_builds_backend_then_dynamic_handler(
    name: str, monkeypatch: pytest.MonkeyPatch
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
    params = make_params(name)

    handler = get_rendezvous_handler(params)

    assert isinstance(handler, FakeHandler)
    assert calls == [
        ("create_backend", params),
        # The handler owns the backend (and its connection): its close() releases them.
        ("create_handler", (store, backend, params, name, True)),
    ]


#: What the first handler loads: python-etcd and the modules of the backends.
_LOADED_LATE = (
    "etcd",
    "etcd_rendezvous.etcd_rendezvous",
    "etcd_rendezvous.dynamic_rendezvous",
    "etcd_rendezvous.etcd_rendezvous_backend",
)


@pytest.mark.parametrize(
    ("backend", "loaded"),
    [
        ("etcd", ["etcd", "etcd_rendezvous.etcd_rendezvous"]),
        (
            "etcd-v2",
            [
                "etcd",
                "etcd_rendezvous.dynamic_rendezvous",
                "etcd_rendezvous.etcd_rendezvous_backend",
            ],
        ),
    ],
)
def test_the_backends_load_with_the_first_handler(backend: str, loaded: list[str]) -> None:
    """Importing the package (and its registry) loads neither python-etcd nor a backend's
    modules; creating the first handler of a backend loads them (here one that fails to
    reach etcd, at a port nothing listens on). In a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import sys
        import etcd_rendezvous, etcd_rendezvous.registry
        from etcd_rendezvous import RendezvousConnectionError, RendezvousParameters

        late = {_LOADED_LATE!r}
        print([m for m in late if m in sys.modules])
        params = RendezvousParameters(
            {backend!r}, "127.0.0.1:{closed_port()}", "run", 1, 1,
            connect_timeout="1", timeout="2", join_timeout="2",
        )
        try:
            etcd_rendezvous.get_rendezvous_handler(params)
        except RendezvousConnectionError:
            pass
        print([m for m in late if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]"
    assert after == str([m for m in _LOADED_LATE if m in loaded])
