"""The ``etcd-rendezvous dashboard`` command as a process, and the size of a PNG."""

from __future__ import annotations

import re
import select
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.cli import cli_process

__all__ = ["dashboard", "png_size"]

_URL = re.compile(r"dashboard: (http://\S+/)")


@contextmanager
def dashboard(endpoint: str, *options: str, timeout: float = 30.0) -> Iterator[str]:
    """``etcd-rendezvous dashboard`` against ``endpoint`` on a free loopback port,
    running; yields its URL (``http://127.0.0.1:PORT/``). Killed on leaving the block."""
    with cli_process(
        "dashboard", "--endpoint", endpoint, "--listen", "127.0.0.1:0", *options
    ) as process:
        assert process.stdout is not None
        deadline = time.monotonic() + timeout
        seen = ""
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([process.stdout], [], [], max(0.0, left))
            line = process.stdout.readline() if ready else ""
            seen += line
            found = _URL.search(line)
            if found:
                break
            if not line and (left <= 0 or process.poll() is not None):
                err = process.stderr.read() if process.poll() is not None and process.stderr else ""
                raise AssertionError(f"the dashboard did not start: {seen}{err}")
        yield found.group(1)


def _chunks(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    position = 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        yield kind, data[position + 8 : position + 8 + length]
        position += 12 + length


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of the PNG at ``path`` (checking its signature)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height
