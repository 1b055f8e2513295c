"""Deadlines come from the caller: with ``timeout=T``, no handler call outlives T + 2 s.

Against real servers and sockets: a refused port, a port that accepts connections and
never answers, and an etcd killed or SIGSTOPped in the middle of a rendezvous. Each case
runs for both backends (``etcd`` with ``timeout``, ``etcd-v2`` with ``join_timeout``),
with the default ``read_timeout`` of 60 s, which must not matter: every call fails with
a :class:`~etcd_rendezvous.api.RendezvousError` subclass within ``T + 2`` seconds (the
documented bound), measured here with :data:`SLACK` more for slow machines.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import KeyNotFoundError
from etcd_rendezvous.api import (
    Deadline,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.registry import get_rendezvous_handler
from support.rdzv import Worker, state_key
from support.wait import wait_for_value, wait_until

logger = logging.getLogger(__name__)

#: The rendezvous timeout of these tests, in seconds.
T = 4.0
#: The documented bound past the timeout, in seconds.
BOUND = 2.0
#: Extra allowance for a slow or loaded test machine, in seconds.
SLACK = 2.0
#: The heartbeat lifetime of an etcd-v2 node with the defaults (keep_alive_interval 5 s,
#: keep_alive_max_attempt 3).
_LIFETIME = 15.0
BACKENDS = ("etcd", "etcd-v2")


def _params(backend: str, endpoint: str, run_id: str, nodes: int, **config: Any) -> Any:
    """Parameters with every timeout of the backend set to ``T`` (the node's address
    127.0.0.1 unless ``config`` gives ``local_addr``)."""
    if backend == "etcd":
        timeouts: dict[str, Any] = {"timeout": T, "last_call_timeout": 0}
    else:
        timeouts = {"join_timeout": int(T), "close_timeout": int(T), "last_call_timeout": 1}
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        **{"local_addr": "127.0.0.1", **timeouts, **config},
    )


def _timed(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``call``; return what it raised (``None`` if nothing) and how long it took."""
    started = time.monotonic()
    try:
        call()
    except BaseException as exc:  # the caller asserts on it
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def _assert_bounded(
    what: str, error: BaseException | None, elapsed: float, timeout: float = T
) -> None:
    logger.info("%s: %s after %.2f s", what, type(error).__name__, elapsed)
    assert isinstance(error, RendezvousError), (what, error)
    assert elapsed < timeout + BOUND + SLACK, f"{what} took {elapsed:.1f} s: {error}"


# -- creation ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_port_at_creation_is_reported_within_seconds(
    backend: str, refused_port: int, run_id: str
) -> None:
    endpoint = f"127.0.0.1:{refused_port}"
    long = {"timeout": 600} if backend == "etcd" else {"join_timeout": 600}
    params = _params(backend, endpoint, run_id, 1, **long)
    error, elapsed = _timed(lambda: get_rendezvous_handler(params))
    logger.info("refused port, %s: %.2f s", backend, elapsed)
    assert isinstance(error, RendezvousConnectionError), error
    assert endpoint in str(error)
    # Within connect_timeout (5 s by default), whatever the rendezvous timeout.
    assert elapsed < 5.0 + BOUND + SLACK


@pytest.mark.parametrize("backend", BACKENDS)
def test_refused_port_at_creation_honours_a_shorter_timeout(
    backend: str, refused_port: int, run_id: str
) -> None:
    params = _params(backend, f"127.0.0.1:{refused_port}", run_id, 1, connect_timeout=30)
    error, elapsed = _timed(lambda: get_rendezvous_handler(params))
    _assert_bounded(f"creation against a refused port ({backend})", error, elapsed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_never_answering_port_at_creation(backend: str, silent_port: int, run_id: str) -> None:
    params = _params(backend, f"127.0.0.1:{silent_port}", run_id, 1, connect_timeout=30)
    error, elapsed = _timed(lambda: get_rendezvous_handler(params))
    _assert_bounded(f"creation against a silent port ({backend})", error, elapsed)
    assert f"127.0.0.1:{silent_port}" in str(error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_never_answering_endpoints_at_creation(
    backend: str, silent_port: int, refused_port: int, run_id: str
) -> None:
    with socket.socket() as second:
        second.bind(("127.0.0.1", 0))
        second.listen(8)
        endpoints = [silent_port, second.getsockname()[1], refused_port]
        endpoint = ",".join(f"127.0.0.1:{port}" for port in endpoints)
        params = _params(backend, endpoint, run_id, 1, connect_timeout=30)
        error, elapsed = _timed(lambda: get_rendezvous_handler(params))
    _assert_bounded(f"creation against three dead endpoints ({backend})", error, elapsed)


# -- a fault in the middle of a rendezvous ----------------------------------------------


def _fault_mid_rendezvous(
    backend: str, server: EtcdServer, run_id: str, fault: Callable[[], None]
) -> None:
    """One worker of two joins; ``fault`` strikes once it is waiting for the other."""
    handler = get_rendezvous_handler(_params(backend, server.get_endpoint(), run_id, 2))
    outcome: list[tuple[BaseException | None, float]] = []
    worker = threading.Thread(
        target=lambda: outcome.append(_timed(handler.next_rendezvous)), daemon=True
    )
    with handler:
        with open_transport([(server.get_host(), server.get_port())]) as conn:
            worker.start()
            wait_for_value(conn, state_key(backend, run_id), lambda value: value is not None)
        fault()
        worker.join(T + BOUND + SLACK + 30)
    assert outcome, "next_rendezvous() never returned"
    _assert_bounded(f"next_rendezvous ({backend})", *outcome[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_etcd_killed_mid_rendezvous(
    backend: str, private_etcd_server: EtcdServer, run_id: str
) -> None:
    _fault_mid_rendezvous(backend, private_etcd_server, run_id, private_etcd_server.kill)


@pytest.mark.parametrize("backend", BACKENDS)
def test_etcd_suspended_mid_rendezvous(
    backend: str, private_etcd_server: EtcdServer, run_id: str
) -> None:
    _fault_mid_rendezvous(backend, private_etcd_server, run_id, private_etcd_server.suspend)


# -- after a rendezvous -----------------------------------------------------------------


@dataclass
class LostEtcd:
    """A private etcd that the test loses (``fault``: ``kill`` or ``suspend``)."""

    server: EtcdServer
    fault: str

    def lose(self) -> None:
        getattr(self.server, self.fault)()


@pytest.fixture(params=["kill", "suspend"])
def lost_etcd(request: pytest.FixtureRequest, private_etcd_server: EtcdServer) -> LostEtcd:
    return LostEtcd(private_etcd_server, request.param)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handler_calls_after_losing_etcd(backend: str, lost_etcd: LostEtcd, run_id: str) -> None:
    server = lost_etcd.server
    handler: RendezvousHandler
    with get_rendezvous_handler(_params(backend, server.get_endpoint(), run_id, 1)) as handler:
        handler.next_rendezvous()
        lost_etcd.lose()
        # set_closed first: it takes long enough for the dynamic handler's one-second
        # cache of the state to expire, so that the others must ask etcd too.
        for name in ("set_closed", "num_nodes_waiting", "is_closed", "next_rendezvous"):
            error, elapsed = _timed(getattr(handler, name))
            _assert_bounded(f"{name} ({backend}, etcd {lost_etcd.fault})", error, elapsed)
        started = time.monotonic()
        assert handler.shutdown() is False
        elapsed = time.monotonic() - started
        logger.info("shutdown (%s): False after %.2f s", backend, elapsed)
        assert elapsed < T + BOUND + SLACK


def test_store_calls_after_losing_etcd(lost_etcd: LostEtcd) -> None:
    server = lost_etcd.server
    conn = open_transport([(server.get_host(), server.get_port())])
    with EtcdStore(conn, "/deadlines/store", owns_connection=True) as store:
        store.set_timeout(timedelta(seconds=T))
        store.set("present", "1")
        lost_etcd.lose()
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("missing"),
            "wait": lambda: store.wait(["missing", "other"]),
            "add": lambda: store.add("counter", 1),
            "set": lambda: store.set("present", "2"),
            "check": lambda: store.check(["present"]),
        }
        for name, call in calls.items():
            error, elapsed = _timed(call)
            _assert_bounded(f"store.{name} (etcd {lost_etcd.fault})", error, elapsed)


_IMPORTS_AT_CREATION = """
import sys
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.registry import get_rendezvous_handler

params = RendezvousParameters(
    backend=sys.argv[1], endpoint=sys.argv[2], run_id=sys.argv[3], min_nodes=1,
    max_nodes=1, local_addr="127.0.0.1", torch_store="true",
)
handler = get_rendezvous_handler(params)
created = "torch" in sys.modules
handler.next_rendezvous()
print(created, flush=True)
handler.close()
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handler_handing_out_a_torch_store_imports_pytorch_when_created(
    backend: str, etcd_server: EtcdServer, run_id: str
) -> None:
    """Importing PyTorch takes seconds of CPU, and tens of seconds in a process whose
    threads all compete for it: never inside ``next_rendezvous()``, whose deadline an
    import cannot honour, but when the handler is created."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_AT_CREATION, backend, etcd_server.get_endpoint(), run_id],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"], done.stderr[-2000:]


# -- the exchange of rank 0's address ---------------------------------------------------


@pytest.mark.parametrize("torch_store", ["false", "true"])
def test_a_frozen_rank_0_fails_the_address_exchange_within_the_join_timeout(
    torch_store: str, etcd_server: EtcdServer, run_id: str
) -> None:
    """``etcd-v2``: rank 0 of a round that completes is frozen (SIGSTOP) before it can
    publish its address; the other node fails with a named error within ``join_timeout``
    plus the documented bound, not the store's timeout (300 s)."""
    if torch_store == "true" and importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    endpoint = etcd_server.get_endpoint()
    # The worker's node (address 127.0.0.1) sorts before ours (127.0.0.2): it is rank 0.
    # Its key lives 15 s, longer than the test: it is admitted, and not dropped.
    rank_0 = Worker(
        endpoint, run_id, 2, 2, extra_args=["--backend=etcd-v2", "--keep-alive-interval=5"]
    )
    params = _params(
        "etcd-v2", endpoint, run_id, 2, torch_store=torch_store, local_addr="127.0.0.2"
    )
    try:
        rank_0.wait_ready()
        rank_0.send("join")
        nodes = f"/torch/elastic/rendezvous_nodes/{run_id}"
        with open_transport([(etcd_server.get_host(), etcd_server.get_port())]) as conn:
            wait_until(
                lambda: any(
                    f"_{rank_0.proc.pid}_" in child.key for child in _children(conn, nodes)
                ),
                what="the worker's node key",
            )
        rank_0.proc.send_signal(signal.SIGSTOP)
        handler = get_rendezvous_handler(params)
        with handler:
            outcome: list[tuple[BaseException | None, float]] = []
            joiner = threading.Thread(
                target=lambda: outcome.append(_timed(handler.next_rendezvous)), daemon=True
            )
            joiner.start()
            joiner.join(_LIFETIME + BOUND + SLACK + 30)
            assert outcome, "next_rendezvous() is still waiting for rank 0's address"
            error, elapsed = outcome[0]
            # The exchange gets what is left of join_timeout, and at least the heartbeat
            # lifetime (our node's defaults: 5 s x 3), after which rank 0 would be dead.
            exchange = max(T, _LIFETIME)
            _assert_bounded("the address exchange with a frozen rank 0", error, elapsed, exchange)
            assert isinstance(error, RendezvousTimeoutError), error
            message = str(error)
            assert f"round 0 of the rendezvous '{run_id}'" in message, message
            assert f"the node '127.0.0.1_{rank_0.proc.pid}_" in message, message
            assert f"'torch.rendezvous.{run_id}.0/MASTER_ADDR'" in message, message
    finally:
        rank_0.proc.send_signal(signal.SIGCONT)
        rank_0.kill()


def _children(conn: Any, path: str) -> list[Any]:
    """The keys under the etcd directory ``path`` (none if it does not exist yet)."""
    try:
        return list(conn.list_dir(path, deadline=Deadline(5)).children)
    except KeyNotFoundError:
        return []
