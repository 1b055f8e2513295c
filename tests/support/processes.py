"""The state of a process, as tests that kill or suspend one check it."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "process_state"]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def process_state(pid: int) -> str:
    """The one-letter state from /proc (``T`` = stopped)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]
