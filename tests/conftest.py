"""Fixtures shared by the unit and integration tests (helpers are in ``tests/support/``).

The session-wide ``etcd_server``, ``etcd_prefix`` and ``etcd_client`` fixtures come from
the package's pytest plugin (:mod:`etcd_rendezvous.pytest_plugin`). This file adds:

* ``etcd_proxy``: a :class:`~faultproxy.FaultProxy` in front of ``etcd_server``.
* ``fault_proxy_factory``: ``make(host, port, **kwargs)`` returns a started proxy in
  front of any server; all of them are stopped after the test.
* ``private_etcd_server``: an etcd of the test's own (same binary and API as
  ``etcd_server``), for tests that stop, kill or suspend it; always resumed and stopped
  afterwards, and its log is added to the report of a failed test.
* ``tls_certs``: a CA and a server/client certificate for ``127.0.0.1`` (needs the
  ``openssl`` command); ``tls_etcd_server``: an etcd requiring those client certificates
  (same binary and API as ``etcd_server``).

Both private servers serve the v2 API unless ``ETCD_RENDEZVOUS_ETCD_API=v3`` (see
:func:`etcd_rendezvous.pytest_plugin.etcd_api_under_test`), like ``etcd_server``.
* ``run_id``: a fresh run id; ``conn``: a connection to ``etcd_server`` (v2 or v3,
  as ``etcd_api=auto`` picks); ``workers``: the worker processes a test started, stopped after
  it; ``agents``: the same for torchrun agents.
* ``api``: the etcd API of the transport under test (``"v2"``, ``"v3"``: each test runs
  once per API; a module testing one transport overrides it); ``connect``: connections of
  that transport, closed after the test (defaults: the ``connect_defaults`` mark);
  ``cleared_history``: etcd's history forgotten up to now, for that API; ``key``: a key
  in the test's namespace.
* ``handlers``: our ``etcd-v2`` rendezvous handlers of the test's run, closed after it
  (options: the module's ``handler_options`` fixture); ``pool``: threads to run them in.
* ``refused_port``: a loopback port nothing listens on; ``silent_port``: one that accepts
  connections and never answers.
* ``received``: the rendezvous events recorded in the test's process while it runs.

A test under ``tests/unit/`` that uses one of the etcd fixtures is a collection error:
those belong in ``tests/integration/``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import uuid
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous import events
from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from support.closing import closing_factory
from support.faultproxy import FaultProxy
from support.handlers import make_handler
from support.history import EVENT_HISTORY, forget_history
from support.net import closed_port, endpoint_of
from support.rdzv import Worker
from support.tls_certs import make_certs
from support.torchrun import Agent
from support.transports import APIS, TRANSPORTS

_LOG_TAIL_LINES = 60
_private_servers_key = pytest.StashKey[list[EtcdServer]]()


@pytest.fixture
def fault_proxy_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., FaultProxy]]:
    """``make(host, port, **kwargs)``: a started :class:`FaultProxy`, stopped after the test."""
    proxies: list[FaultProxy] = []

    def make(host: str, port: int, **kwargs: Any) -> FaultProxy:
        kwargs.setdefault("name", f"faultproxy{len(proxies) + 1}")
        proxy = FaultProxy(host, port, **kwargs)
        proxies.append(proxy)
        return proxy.start()

    try:
        yield make
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.fixture
def etcd_proxy(
    etcd_server: EtcdServer, fault_proxy_factory: Callable[..., FaultProxy]
) -> FaultProxy:
    """A :class:`FaultProxy` forwarding to the session's ``etcd_server``."""
    proxy: FaultProxy = fault_proxy_factory(etcd_server.get_host(), etcd_server.get_port())
    return proxy


@pytest.fixture
def private_etcd_server(
    etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> Iterator[EtcdServer]:
    """An etcd server for this test alone, free to be stopped, killed or suspended."""
    server = EtcdServer(etcd_binary=etcd_server.binary, enable_v2=etcd_server.enable_v2)
    server.start()
    request.node.stash.setdefault(_private_servers_key, []).append(server)
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            if server.suspended:
                server.resume()
        server.stop()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id no other test uses, named after the test module."""
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return f"{module}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def conn(etcd_server: EtcdServer) -> Iterator[Transport]:
    """A connection to the session's etcd (read timeout 10 s) over the API the library
    picks for it (``etcd_api=auto``): v2 where the server serves it, else v3."""
    connection = open_transport([(etcd_server.get_host(), etcd_server.get_port())], read_timeout=10)
    yield connection
    connection.close()


@pytest.fixture(params=APIS)
def api(request: pytest.FixtureRequest) -> str:
    """The etcd API of the transport under test: ``"v2"`` (where the server serves it)
    or ``"v3"``."""
    value: str = request.param
    return value


@pytest.fixture
def connect(
    api: str, etcd_server: EtcdServer, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Transport]]:
    """``connect(*endpoints, **kwargs)``: a connection of the ``api`` transport to
    ``endpoints`` (default: ``etcd_server``), closed after the test.

    Timeouts default to read 5 s, connect 1 s; a module or test changes those defaults
    with ``@pytest.mark.connect_defaults(read_timeout=2.0)``.
    """
    marker = request.node.get_closest_marker("connect_defaults")
    defaults = {"read_timeout": 5.0, "connect_timeout": 1.0, **(marker.kwargs if marker else {})}

    def make(*endpoints: tuple[str, int], **kwargs: Any) -> Transport:
        return TRANSPORTS[api](list(endpoints) or [endpoint_of(etcd_server)], **defaults | kwargs)

    with closing_factory(make, Transport.close) as connect:
        yield connect


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for the test's in-process nodes (up to 32 at once)."""
    with ThreadPoolExecutor(32) as executor:
        yield executor


@pytest.fixture
def handler_options() -> dict[str, Any]:
    """Options of the ``handlers`` fixture's handlers; a module overrides this fixture to
    give its own (a test passes more to ``handlers``)."""
    return {}


@pytest.fixture
def handlers(
    etcd_server: EtcdServer,
    run_id: str,
    handler_options: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., list[Any]]]:
    """``handlers(count, min_nodes, max_nodes, server=etcd_server, **options)``: ``count``
    of our ``etcd-v2`` handlers of the run ``run_id`` (join timeout 60 s, no TCP store,
    then ``handler_options``, then ``options``), closed after the test (deleting their
    keys). Rank 0 publishes its address through etcd and starts no agent TCPStore (nor
    does a PyTorch handler the test makes)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    def make(
        count: int, min_nodes: int, max_nodes: int, server: EtcdServer | None = None, **options: Any
    ) -> list[Any]:
        params = RendezvousParameters(
            "etcd-v2",
            (server or etcd_server).get_endpoint(),
            run_id,
            min_nodes,
            max_nodes,
            local_addr="127.0.0.1",
            **{"join_timeout": 60, "torch_store": "false", **handler_options, **options},
        )
        return [make_handler(params) for _ in range(count)]

    def close(group: list[Any]) -> None:
        for handler in group:
            handler.close()

    with closing_factory(make, close) as handlers:
        yield handlers


@pytest.fixture
def key(etcd_prefix: str) -> str:
    """A key in the test's own namespace."""
    return f"{etcd_prefix}/key"


@pytest.fixture
def refused_port() -> int:
    """A loopback port nothing listens on: connections are refused."""
    return closed_port()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (into the listen backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.fixture
def received() -> Iterator[list[events.RdzvEvent]]:
    """The rendezvous events recorded in this process while the test runs (through a
    callback registered with :func:`etcd_rendezvous.events.add_event_handler`)."""
    seen: list[events.RdzvEvent] = []
    events.add_event_handler(seen.append)
    yield seen
    events.remove_event_handler(seen.append)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Worker processes a test started (append to it); all stopped afterwards."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """torchrun agents a test started (append to it); all stopped afterwards."""
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.stop()


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Files ``ca.crt``, ``node.crt`` and ``node.key`` (see :func:`tls_certs.make_certs`):
    a CA and a certificate it signed for ``127.0.0.1``/``localhost``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_etcd_server(etcd_server: EtcdServer, tls_certs: dict[str, str]) -> Iterator[EtcdServer]:
    """An etcd of the test's own (same binary as ``etcd_server``) serving https only and
    requiring client certificates signed by the ``tls_certs`` CA."""
    with EtcdServer(
        etcd_binary=etcd_server.binary,
        cert_file=tls_certs["node.crt"],
        key_file=tls_certs["node.key"],
        trusted_ca_file=tls_certs["ca.crt"],
        client_cert_auth=True,
        enable_v2=etcd_server.enable_v2,
    ) as server:
        yield server


#: The fixtures that start or reach an etcd server: only tests/integration/ may use them.
_ETCD_FIXTURES = frozenset(
    {"etcd_server", "etcd_cluster", "etcd_client", "private_etcd_server", "tls_etcd_server"}
)
_UNIT_TESTS = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep tests/unit/ free of etcd: a unit test using an etcd fixture is an error."""
    for item in items:
        if _UNIT_TESTS not in item.path.parents:
            continue
        used = _ETCD_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if used:
            raise pytest.UsageError(
                f"{item.nodeid} uses {', '.join(sorted(used))}: tests that need etcd "
                "belong in tests/integration/"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """Append the log tail of each private etcd server to the report of a failed test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    for server in item.stash.get(_private_servers_key, []):
        log = server.read_log(_LOG_TAIL_LINES)
        if log:
            title = f"private etcd server log ({server.client_url}, last {_LOG_TAIL_LINES} lines)"
            report.sections.append((title, log))


# -- etcd history --------------------------------------------------------------------

#: The key the history fixtures write.
_HISTORY_FILLER = "/test/history-filler"


@pytest.fixture(scope="module")
def v2_history_cleared(etcd_server: EtcdServer) -> None:
    """Make the session's etcd v2 store forget its first events (index 1 is out of its
    history of the last 1000)."""
    if not etcd_server.enable_v2:
        return
    conn = EtcdConnection([endpoint_of(etcd_server)], read_timeout=10)
    try:
        if conn.set(_HISTORY_FILLER, "0").etcd_index <= EVENT_HISTORY + 100:
            forget_history(conn, etcd_server.client_url, _HISTORY_FILLER)
    finally:
        conn.close()


@pytest.fixture
def cleared_history(api: str, etcd_server: EtcdServer, request: pytest.FixtureRequest) -> None:
    """Make etcd forget its history up to now for the API under test: on v2 by pushing
    index 1 out of the event history, on v3 by compacting at the current revision."""
    if api == "v2":
        request.getfixturevalue("v2_history_cleared")
        return
    with EtcdV3Connection([endpoint_of(etcd_server)], read_timeout=10) as conn:
        forget_history(conn, etcd_server.client_url, _HISTORY_FILLER)
