"""Running this package's command line in tests: as a process, or in the test's own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from etcd_rendezvous.cli import main

__all__ = ["cli_process", "run_cli", "run_main"]

#: ``python -m etcd_rendezvous``, with this interpreter.
COMMAND = [sys.executable, "-m", "etcd_rendezvous"]


def run_cli(
    *args: str, timeout: float = 180.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m etcd_rendezvous *args`` to its end (no stdin); its output as text."""
    return subprocess.run(
        [*COMMAND, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


@contextmanager
def cli_process(*args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -m etcd_rendezvous *args`` running (stdout and stderr piped, no stdin);
    killed on leaving the block if it is still running."""
    process = subprocess.Popen(
        [*COMMAND, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the command in this process; return exit status, stdout and stderr."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
