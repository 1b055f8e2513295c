"""pytest fixtures for testing against a real etcd (loaded through the ``pytest11`` entry point).

Fixtures:

* ``etcd_server`` (session): an :class:`~etcd_rendezvous.etcd_server.EtcdServer`,
  started once. Without an etcd binary the tests that use it are skipped, unless
  ``ETCD_RENDEZVOUS_REQUIRE_ETCD=1`` is set (as CI does), which makes it an error.
* ``etcd_prefix`` (function): a key prefix no other test uses, e.g.
  ``/test/test_join-1a2b3c4d``.
* ``etcd_client`` (function): a python-etcd ``etcd.Client`` for ``etcd_server``.

When a test that used the server fails, the tail of etcd's log is added to its report.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from .etcd_server import EtcdBinaryNotFoundError, EtcdServer

__all__ = [
    "REQUIRE_ETCD_ENV",
    "etcd_client",
    "etcd_prefix",
    "etcd_server",
    "pytest_runtest_makereport",
]

#: Set to ``1`` to make a missing etcd binary an error instead of a skip.
REQUIRE_ETCD_ENV = "ETCD_RENDEZVOUS_REQUIRE_ETCD"

_LOG_TAIL_LINES = 60
_server_key = pytest.StashKey[EtcdServer]()


def _etcd_required() -> bool:
    return os.environ.get(REQUIRE_ETCD_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@pytest.fixture(scope="session")
def etcd_server(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A local etcd server (v2 API) shared by the whole test session."""
    try:
        server = EtcdServer()
    except EtcdBinaryNotFoundError as exc:
        if _etcd_required():
            raise EtcdBinaryNotFoundError(f"{exc} ({REQUIRE_ETCD_ENV} is set)") from exc
        pytest.skip(f"no etcd binary: {exc}")
    server.start()
    request.config.stash[_server_key] = server
    try:
        yield server
    finally:
        del request.config.stash[_server_key]
        server.stop()


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to this test, like ``/test/<test name>-<8 hex digits>``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")[:80]
    return f"/test/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_client(etcd_server: EtcdServer) -> Iterator[Any]:
    """A python-etcd ``etcd.Client`` connected to :func:`etcd_server`."""
    client = etcd_server.get_client()
    try:
        yield client
    finally:
        client.http.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """Append the tail of etcd's log to the report of a failed test that used it."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed or "etcd_server" not in getattr(item, "fixturenames", ()):
        return
    server = item.config.stash.get(_server_key, None)
    if server is None:
        return
    log = server.read_log(_LOG_TAIL_LINES)
    if log:
        report.sections.append(
            (f"etcd server log ({server.log_path}, last {_LOG_TAIL_LINES} lines)", log)
        )
