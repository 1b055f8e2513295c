"""tests/etcd/build.py: a clear message without Go or without a pin, and a cache hit
that needs no Go."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "etcd" / "build.py"


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("etcd_build", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("ETCD_RENDEZVOUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GO", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(module, "GO_FALLBACKS", (str(tmp_path / "no-go"),))
    return module


def test_without_go_the_message_says_where_it_looked(build: ModuleType) -> None:
    with pytest.raises(build.BuildError, match=r"no Go toolchain found .*\$GO.*no-go"):
        build.build("3.6.16")


def test_an_unpinned_version_says_how_to_pin(build: ModuleType) -> None:
    with pytest.raises(build.BuildError, match=r"v3\.6\.99 is not pinned .*--pin"):
        build.build("3.6.99")
    with pytest.raises(build.BuildError, match="not of the form"):
        build.build("v3.6")


@pytest.mark.parametrize("version", ["3.6.16", "3.7.3"])
@pytest.mark.parametrize("tool", ["etcd", "etcdctl"])
def test_a_cached_build_is_reused_without_go(build: ModuleType, version: str, tool: str) -> None:
    out = build.cache_root() / f"etcd-v{version}"
    out.mkdir(parents=True)
    (out / tool).write_text("cached")
    (out / f"{tool}.inputs-sha256").write_text(build._stamp(version, tool))
    assert build.build(version, tool) == out / tool
    # A changed pin is not the cached build: it needs Go again.
    (out / f"{tool}.inputs-sha256").write_text("stale")
    with pytest.raises(build.BuildError, match="no Go toolchain"):
        build.build(version, tool)


def test_the_command_line_exits_2_with_the_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "3.6.99"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    assert "build.py: etcd v3.6.99 is not pinned" in result.stderr
