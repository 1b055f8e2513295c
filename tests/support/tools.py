"""Test tools the suite runs but does not install (Chromium, Prometheus, libfaketime):
a test that needs a missing one is skipped, except where the run requires every tool.

CI sets ``ETCD_RENDEZVOUS_REQUIRE_ETCD=1``, which makes a missing etcd binary an error; it
makes a missing tool an error too, so that a CI machine lacking one fails instead of
skipping the tests that need it.
"""

from __future__ import annotations

import os
import shutil

import pytest

from etcd_rendezvous.pytest_plugin import REQUIRE_ETCD_ENV

__all__ = ["missing_tool", "require_command", "tools_required"]


def tools_required() -> bool:
    """Whether the run requires etcd and every tool (``ETCD_RENDEZVOUS_REQUIRE_ETCD``)."""
    return os.environ.get(REQUIRE_ETCD_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def missing_tool(what: str) -> None:
    """Skip the test for lack of ``what`` (a phrase naming the tool and how to install
    it), or fail it where every tool is required."""
    if tools_required():
        pytest.fail(f"{what} (required: the environment sets ETCD_RENDEZVOUS_REQUIRE_ETCD)")
    pytest.skip(what)


def require_command(name: str, install: str) -> str:
    """The path of the command ``name`` on ``PATH``; :func:`missing_tool` if there is
    none (``install``: how to install it)."""
    found = shutil.which(name)
    if found is None:
        missing_tool(f"no {name} on PATH ({install})")
        raise AssertionError("unreachable")  # pytest.skip/fail raise
    return found
