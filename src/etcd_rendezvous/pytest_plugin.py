"""pytest fixtures for testing against a real etcd (loaded through the ``pytest11`` entry point).

``etcd_server`` (session), ``etcd_cluster`` (a 3-member cluster per test),
``etcd_prefix`` (a key prefix of the test's own) and ``etcd_client`` (a python-etcd
client). Without an etcd binary the tests using them are skipped, or fail when
``ETCD_RENDEZVOUS_REQUIRE_ETCD=1``; ``ETCD_RENDEZVOUS_ETCD_API`` chooses the etcd API
under test. A failed test's report ends with the tail of etcd's log. See
:doc:`testing`.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import pytest

from ._process.etcd import binary_version
from .etcd_cluster import EtcdCluster
from .etcd_server import EtcdBinaryNotFoundError, EtcdServer, find_etcd_binary

__all__ = [
    "ETCD_API_ENV",
    "REQUIRE_ETCD_ENV",
    "etcd_api_under_test",
    "etcd_client",
    "etcd_cluster",
    "etcd_prefix",
    "etcd_server",
    "pytest_configure",
    "pytest_runtest_makereport",
    "pytest_runtest_setup",
]

#: Set to ``1`` to make a missing etcd binary an error instead of a skip.
REQUIRE_ETCD_ENV = "ETCD_RENDEZVOUS_REQUIRE_ETCD"
#: The etcd API the session tests: ``v2`` (default) or ``v3`` (etcd without v2).
ETCD_API_ENV = "ETCD_RENDEZVOUS_ETCD_API"

_ETCD_APIS = ("v2", "v3")
_LOG_TAIL_LINES = 60
_server_key = pytest.StashKey[EtcdServer]()
_cluster_key = pytest.StashKey[EtcdCluster]()
_T = TypeVar("_T")


def etcd_api_under_test() -> str:
    """Return the etcd API this test session exercises: ``"v2"`` or ``"v3"``.

    Read from ``$ETCD_RENDEZVOUS_ETCD_API`` (case-insensitive; unset or empty means
    ``"v2"``). With ``"v3"`` the fixtures' etcd runs without its v2 API, as etcd 3.6
    does, and tests marked ``v2_only`` are skipped.

    Raises:
        ValueError: if the variable holds anything else; the message names it.
    """
    value = os.environ.get(ETCD_API_ENV, "").strip().lower() or "v2"
    if value not in _ETCD_APIS:
        raise ValueError(
            f"${ETCD_API_ENV} must be one of {', '.join(_ETCD_APIS)}, "
            f"got {os.environ.get(ETCD_API_ENV)!r}"
        )
    return value


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``v2_only`` marker and check ``$ETCD_RENDEZVOUS_ETCD_API``."""
    config.addinivalue_line(
        "markers",
        "v2_only(reason=None): needs etcd's v2 API; skipped when "
        f"{ETCD_API_ENV}=v3 runs etcd without it",
    )
    try:
        etcd_api_under_test()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    """Name the etcd binary under test, its release (``etcd --version``) and the API."""
    try:
        binary = find_etcd_binary()
    except EtcdBinaryNotFoundError:
        return f"etcd: none found; API under test: {etcd_api_under_test()}"
    version = binary_version(binary)
    release = "unknown release" if version is None else ".".join(map(str, version))
    return f"etcd: {binary} ({release}); API under test: {etcd_api_under_test()}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``v2_only`` when the etcd under test has no v2 API.

    Runs before the test's fixtures are set up, so a skipped test starts no etcd.
    """
    marker = item.get_closest_marker("v2_only")
    if marker is None or etcd_api_under_test() == "v2":
        return
    reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else None)
    why = f": {reason}" if reason else ""
    pytest.skip(f"needs etcd's v2 API{why}; {ETCD_API_ENV}=v3 runs etcd without it")


def _etcd_required() -> bool:
    return os.environ.get(REQUIRE_ETCD_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _or_skip(make: Callable[[], _T]) -> _T:
    """``make()``; without an etcd binary skip the test, or fail if etcd is required."""
    try:
        return make()
    except EtcdBinaryNotFoundError as exc:
        if _etcd_required():
            raise EtcdBinaryNotFoundError(f"{exc} ({REQUIRE_ETCD_ENV} is set)") from exc
        pytest.skip(f"no etcd binary: {exc}")


@pytest.fixture(scope="session")
def etcd_server(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """A local etcd server shared by the whole test session.

    It serves the v2 API unless ``$ETCD_RENDEZVOUS_ETCD_API`` is ``v3``.
    """
    server = _or_skip(lambda: EtcdServer(enable_v2=etcd_api_under_test() == "v2"))
    server.start()
    request.config.stash[_server_key] = server
    try:
        yield server
    finally:
        del request.config.stash[_server_key]
        server.stop()


@pytest.fixture
def etcd_cluster(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster for this test alone, started, and stopped after it.

    Free to lose members (kill, suspend, stop); it serves the v2 API unless
    ``$ETCD_RENDEZVOUS_ETCD_API`` is ``v3``.
    """
    cluster = _or_skip(lambda: EtcdCluster(enable_v2=etcd_api_under_test() == "v2"))
    request.node.stash[_cluster_key] = cluster
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to this test, like ``/test/<test name>-<8 hex digits>``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name).strip("_")[:80]
    return f"/test/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def etcd_client(etcd_server: EtcdServer) -> Iterator[Any]:
    """A python-etcd ``etcd.Client`` connected to :func:`etcd_server`.

    python-etcd speaks only the v2 API: with ``$ETCD_RENDEZVOUS_ETCD_API=v3`` this
    fixture fails; mark such tests ``v2_only``.
    """
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
    if not report.failed:
        return
    server = item.config.stash.get(_server_key, None)
    if server is not None and "etcd_server" in getattr(item, "fixturenames", ()):
        log = server.read_log(_LOG_TAIL_LINES)
        if log:
            report.sections.append(
                (f"etcd server log ({server.log_path}, last {_LOG_TAIL_LINES} lines)", log)
            )
    cluster = item.stash.get(_cluster_key, None)
    if cluster is not None:
        logs = cluster.read_logs(_LOG_TAIL_LINES)
        if logs:
            report.sections.append(
                (f"etcd cluster logs ({cluster.name}, last {_LOG_TAIL_LINES} lines each)", logs)
            )
