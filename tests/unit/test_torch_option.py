"""Unit tests for the ``torch_store`` option (etcd_rendezvous._torch_store), torch or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from etcd_rendezvous import _torch_store as _torch
from etcd_rendezvous.api import RendezvousParameters


def _params(**config: object) -> RendezvousParameters:
    return RendezvousParameters("etcd", "localhost:2379", "run", 1, 1, **config)


@pytest.mark.parametrize("installed", [True, False])
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "installed"),
        ("auto", "installed"),
        ("AUTO", "installed"),
        ("false", False),
        ("0", False),
        (False, False),
        ("no", False),
    ],
)
def test_auto_follows_the_installation_and_false_never_adapts(
    monkeypatch: pytest.MonkeyPatch, installed: bool, value: object, expected: object
) -> None:
    monkeypatch.setattr(_torch, "torch_available", lambda: installed)
    params = _params() if value is None else _params(torch_store=value)
    assert _torch.torch_store_wanted(params) is (installed if expected == "installed" else expected)


@pytest.mark.parametrize("value", ["true", "1", True, "yes"])
def test_true_needs_pytorch(monkeypatch: pytest.MonkeyPatch, value: object) -> None:
    monkeypatch.setattr(_torch, "torch_available", lambda: True)
    assert _torch.torch_store_wanted(_params(torch_store=value)) is True
    monkeypatch.setattr(_torch, "torch_available", lambda: False)
    with pytest.raises(ValueError, match="torch_store: true needs PyTorch"):
        _torch.torch_store_wanted(_params(torch_store=value))


@pytest.mark.parametrize("value", ["maybe", "2", 2, ""])
def test_other_values_are_refused_naming_the_option(value: object) -> None:
    with pytest.raises(ValueError, match=r"torch_store: expected auto, true or false, got"):
        _torch.torch_store_wanted(_params(torch_store=value))


def test_stores_other_than_etcd_store_are_left_alone() -> None:
    store = object()
    assert _torch.adapt_store(store, True) is store  # type: ignore[arg-type]


def test_deciding_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from etcd_rendezvous import _torch_store as _torch\n"
        "from etcd_rendezvous.api import RendezvousParameters as P\n"
        "p = P('etcd', 'h:1', 'r', 1, 1, torch_store='auto')\n"
        "_torch.torch_store_wanted(p)\n"
        "_torch.adapt_store(object(), False)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
