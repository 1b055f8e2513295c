#!/usr/bin/env python3
"""Build a real etcd (or etcdctl) of a given version from etcd's Go modules.

    python3 tests/etcd/build.py 3.6.16                 # prints the etcd binary's path
    python3 tests/etcd/build.py 3.6.16 --tool etcdctl  # prints the etcdctl binary's path
    python3 tests/etcd/build.py 3.7.3 --tool all       # both, one path a line
    python3 tests/etcd/build.py 3.6.17 --pin           # pin a version not pinned yet

Each binary is etcd's own ``main`` (``tests/etcd/cmd/<tool>/main.go``, a few lines
around ``etcdmain.Main`` or ``ctlv3.MustStart``) compiled against the module versions
pinned in ``tests/etcd/v<version>/<tool>/go.mod`` and ``go.sum``. ``--pin`` writes those
two files for a version the Go module proxy serves (``go get`` + ``go mod tidy``);
commit them so every later build uses exactly the same modules.

The binaries are cached outside the repository, in
``$ETCD_RENDEZVOUS_CACHE_DIR`` or ``${XDG_CACHE_HOME:-~/.cache}/etcd-rendezvous``, as
``etcd-v<version>/<tool>``. A build whose inputs (go.mod, go.sum, main.go) have not
changed is not repeated: the second call prints the cached path at once, without Go.

Go is looked up as ``$GO``, then ``go`` on ``PATH``, then ``/usr/local/go/bin/go``; if
none is found the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = ("etcd", "etcdctl")
MODULES = {"etcd": "go.etcd.io/etcd/server/v3", "etcdctl": "go.etcd.io/etcd/etcdctl/v3"}
GO_FALLBACKS = ("/usr/local/go/bin/go",)
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")


class BuildError(Exception):
    """A build that cannot go ahead; the message says why and what to do."""


def cache_root() -> Path:
    """The directory holding every built version (outside the repository)."""
    explicit = os.environ.get("ETCD_RENDEZVOUS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "etcd-rendezvous"


def find_go() -> str:
    """The Go toolchain's path, or a BuildError saying where it was looked for."""
    candidates = [os.environ.get("GO", ""), shutil.which("go") or "", *GO_FALLBACKS]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BuildError(
        "no Go toolchain found (looked at $GO, `go` on PATH and "
        + ", ".join(GO_FALLBACKS)
        + "): install Go (https://go.dev/dl/) or set GO=/path/to/go"
    )


def pin_dir(version: str, tool: str) -> Path:
    return HERE / f"v{version}" / tool


def _inputs(version: str, tool: str) -> list[Path]:
    pins = pin_dir(version, tool)
    return [pins / "go.mod", pins / "go.sum", HERE / "cmd" / tool / "main.go"]


def _stamp(version: str, tool: str) -> str:
    digest = hashlib.sha256()
    for path in _inputs(version, tool):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _go(go: str, args: list[str], cwd: Path) -> None:
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": os.environ.get("GOFLAGS", "")}
    result = subprocess.run(
        [go, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise BuildError(
            f"`go {' '.join(args)}` failed in {cwd} (status {result.returncode}):\n"
            + result.stderr[-4000:]
        )


def pin(version: str, tool: str) -> Path:
    """Write go.mod/go.sum pinning ``tool`` at ``version`` (from the Go module proxy)."""
    go = find_go()
    target = pin_dir(version, tool)
    with tempfile.TemporaryDirectory(prefix=f"pin-{tool}-") as tmp:
        work = Path(tmp)
        (work / "go.mod").write_text(f"module {tool}build\n")
        shutil.copy(HERE / "cmd" / tool / "main.go", work / "main.go")
        _go(go, ["get", f"{MODULES[tool]}@v{version}"], work)
        _go(go, ["mod", "tidy"], work)
        target.mkdir(parents=True, exist_ok=True)
        for name in ("go.mod", "go.sum"):
            shutil.copy(work / name, target / name)
    return target


def build(version: str, tool: str = "etcd") -> Path:
    """The path of ``tool`` at ``version``, built (once) from its pinned modules."""
    if not VERSION_RE.match(version):
        raise BuildError(f"version {version!r} is not of the form 3.6.16")
    if tool not in TOOLS:
        raise BuildError(f"tool {tool!r} is not one of {', '.join(TOOLS)}")
    missing = [path for path in _inputs(version, tool) if not path.is_file()]
    if missing:
        raise BuildError(
            f"{tool} v{version} is not pinned ({missing[0]} is missing): "
            f"run `{Path(__file__).name} {version} --tool {tool} --pin` and commit "
            f"{pin_dir(version, tool).relative_to(HERE.parent.parent)}"
        )
    out_dir = cache_root() / f"etcd-v{version}"
    binary = out_dir / tool
    stamp_file = out_dir / f"{tool}.inputs-sha256"
    stamp = _stamp(version, tool)
    if binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return binary
    out_dir.mkdir(parents=True, exist_ok=True)
    # Parallel test processes or CI steps may ask for the same binary at once: one builds,
    # the others wait and then find it cached.
    with open(out_dir / f".{tool}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
            return binary
        go = find_go()
        with tempfile.TemporaryDirectory(prefix=f"build-{tool}-", dir=out_dir) as tmp:
            work = Path(tmp)
            for path in _inputs(version, tool):
                shutil.copy(path, work / path.name)
            _go(go, ["build", "-mod=readonly", "-trimpath", "-o", str(work / tool), "."], work)
            os.replace(work / tool, binary)
        stamp_file.write_text(stamp)
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="etcd release without the v, e.g. 3.6.16")
    parser.add_argument(
        "--tool", choices=[*TOOLS, "all"], default="etcd", help="what to build (default etcd)"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="first write tests/etcd/v<version>/<tool>/go.mod and go.sum from the Go proxy",
    )
    args = parser.parse_args(argv)
    tools = TOOLS if args.tool == "all" else (args.tool,)
    try:
        for tool in tools:
            if args.pin:
                print(
                    f"pinned {tool} v{args.version} in {pin(args.version, tool)}", file=sys.stderr
                )
            print(build(args.version, tool))
    except BuildError as error:
        print(f"{Path(__file__).name}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
