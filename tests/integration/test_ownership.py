"""Who closes an etcd connection: whoever opened it, or whoever it was handed over to.

Every object that talks to etcd closes the connection it owns on ``close()`` (once,
however often it is called, and on leaving a ``with`` block) and leaves a connection it
was merely given open. The handlers the factories build own what the factories opened.
Connections are spied on, not replaced: the real ``close()`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import etcd_rendezvous._dynamic.etcd_backend as v2
import etcd_rendezvous.etcd_rendezvous as legacy
from etcd_rendezvous import torchrun
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousParameters, RendezvousStateError
from etcd_rendezvous.dynamic_rendezvous import create_handler
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvous
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend, create_backend
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.registry import get_rendezvous_handler
from support.transports import Connect


class CloseSpy:
    """Counts the calls of ``conn.close()``, passing each on to the real method."""

    def __init__(self, conn: Transport) -> None:
        self.conn = conn
        self.calls = 0
        real_close = conn.close

        def close() -> None:
            self.calls += 1
            real_close()

        conn.close = close  # type: ignore[method-assign]


def _params(
    etcd_server: EtcdServer, run_id: str, backend: str, **config: Any
) -> RendezvousParameters:
    config.setdefault("read_timeout", 10)
    return RendezvousParameters(
        backend=backend,
        endpoint=etcd_server.get_endpoint(),
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        **config,
    )


# Each makes one kind of object over ``client`` (a connection or an etcd.Client).
Maker = Callable[..., Any]
MAKERS: dict[str, Maker] = {
    "store": lambda client, prefix, run_id, **kw: EtcdStore(client, prefix, **kw),
    "backend": lambda client, prefix, run_id, **kw: EtcdRendezvousBackend(
        client, run_id, prefix, **kw
    ),
    "rendezvous": lambda client, prefix, run_id, **kw: EtcdRendezvous(
        client, prefix, run_id, 1, 1, 30, 0, **kw
    ),
}


@pytest.fixture(params=sorted(MAKERS))
def make(request: pytest.FixtureRequest, etcd_prefix: str, run_id: str) -> Callable[..., Any]:
    """``make(client, **kwargs)``: a store, a backend or a legacy rendezvous."""
    maker = MAKERS[request.param]
    return lambda client, **kw: maker(client, etcd_prefix, run_id, **kw)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[CloseSpy]:
    """Spies on every connection the ``etcd`` and ``etcd-v2`` factories open."""
    spies: list[CloseSpy] = []

    def spying(open_connection: Callable[..., Transport]) -> Callable[..., Transport]:
        def open_and_spy(*args: Any, **kwargs: Any) -> Transport:
            conn = open_connection(*args, **kwargs)
            spies.append(CloseSpy(conn))
            return conn

        return open_and_spy

    monkeypatch.setattr(v2, "create_etcd_connection", spying(v2.create_etcd_connection))
    monkeypatch.setattr(legacy, "_create_etcd_connection", spying(legacy._create_etcd_connection))
    return spies


# -- store, backend and legacy rendezvous --------------------------------------------------


def test_a_given_connection_stays_open(make: Maker, conn: Transport, etcd_prefix: str) -> None:
    spy = CloseSpy(conn)
    with make(conn) as obj:
        obj.close()
    obj.close()
    assert spy.calls == 0
    conn.set(f"{etcd_prefix}/still-used", "yes")  # The owner goes on using it.


def test_a_handed_over_connection_is_closed_once(make: Maker, connect: Connect) -> None:
    spy = CloseSpy(connect())
    with make(spy.conn, owns_connection=True) as obj:
        assert spy.calls == 0
    assert spy.calls == 1
    obj.close()
    obj.close()
    assert spy.calls == 1


@pytest.mark.v2_only(reason="python-etcd's etcd.Client speaks only v2")
def test_a_connection_made_from_an_etcd_client_is_closed_once(
    make: Maker, etcd_client: Any
) -> None:
    obj = make(etcd_client)
    spy = CloseSpy(obj.connection)
    assert spy.conn is not etcd_client
    obj.close()
    obj.close()
    assert spy.calls == 1


def test_a_constructor_that_fails_closes_the_connection_handed_over(
    connect: Connect, etcd_prefix: str
) -> None:
    spy = CloseSpy(connect())
    with pytest.raises(ValueError, match="run_id"):
        EtcdRendezvous(spy.conn, etcd_prefix, "a/b", 1, 1, 30, 0, owns_connection=True)
    assert spy.calls == 1

    spy = CloseSpy(connect())
    with pytest.raises(ValueError, match="run id"):
        EtcdRendezvousBackend(spy.conn, "", etcd_prefix, owns_connection=True)
    assert spy.calls == 1


def test_create_backend_gives_the_connection_to_the_backend(
    etcd_server: EtcdServer, run_id: str, opened: list[CloseSpy]
) -> None:
    backend, store = create_backend(_params(etcd_server, run_id, "etcd-v2"))
    [spy] = opened
    store.close()  # The store borrows the backend's connection.
    assert spy.calls == 0
    backend.close()
    backend.close()
    assert spy.calls == 1


# -- the dynamic handler ----------------------------------------------------------------------


@pytest.fixture
def no_shared_tcp_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 does not start PyTorch's TCPStore server (not what these tests are about)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


@pytest.mark.usefixtures("no_shared_tcp_store")
def test_dynamic_handler_close_stops_heartbeats_and_releases_the_owned_backend(
    etcd_server: EtcdServer, run_id: str
) -> None:
    params = _params(etcd_server, run_id, "etcd-v2", keep_alive_interval=1)
    backend, store = create_backend(params)
    spy = CloseSpy(backend.connection)
    with create_handler(store, backend, params, owns_backend=True) as handler:
        handler.next_rendezvous()
        timer = handler._keep_alive_timer
        assert timer is not None
        assert timer.thread is not None
        assert timer.thread.is_alive()
        assert spy.calls == 0
    assert not timer.thread.is_alive()
    assert spy.calls == 1
    handler.close()
    assert spy.calls == 1
    # close() is not shutdown(): the rendezvous stays open for the other nodes.
    with get_rendezvous_handler(params) as observer:
        assert not observer.is_closed()


@pytest.mark.usefixtures("no_shared_tcp_store")
def test_dynamic_handler_leaves_a_backend_it_does_not_own_open(
    etcd_server: EtcdServer, run_id: str
) -> None:
    params = _params(etcd_server, run_id, "etcd-v2")
    backend, store = create_backend(params)
    spy = CloseSpy(backend.connection)
    with create_handler(store, backend, params) as handler:
        handler.next_rendezvous()
    assert spy.calls == 0
    assert backend.get_state() is not None  # Its owner goes on using it.
    backend.close()
    assert spy.calls == 1


def test_shutdown_keeps_the_backend_open(etcd_server: EtcdServer, run_id: str) -> None:
    params = _params(etcd_server, run_id, "etcd-v2")
    backend, store = create_backend(params)
    spy = CloseSpy(backend.connection)
    handler = create_handler(store, backend, params, owns_backend=True)
    assert handler.shutdown() is True
    assert spy.calls == 0  # As in PyTorch: shutdown() closes the rendezvous, not the backend.
    assert handler.is_closed()
    handler.close()
    assert spy.calls == 1


def test_create_handler_closes_an_owned_backend_when_it_fails(
    etcd_server: EtcdServer, run_id: str
) -> None:
    params = _params(etcd_server, run_id, "etcd-v2", keep_alive_interval="often")
    backend, store = create_backend(params)
    spy = CloseSpy(backend.connection)
    with pytest.raises(ValueError, match="keep_alive_interval"):
        create_handler(store, backend, params, owns_backend=True)
    assert spy.calls == 1


# -- handlers from the registry and torchrun --------------------------------------------------

CREATORS = {
    "registry": get_rendezvous_handler,
    "torchrun-etcd": torchrun.create_etcd_rendezvous_handler,
    "torchrun-etcd-v2": torchrun.create_etcd_rendezvous_v2_handler,
}


@pytest.mark.usefixtures("no_shared_tcp_store")
@pytest.mark.parametrize(
    ("creator", "backend"),
    [
        ("registry", "etcd"),
        ("registry", "etcd-v2"),
        ("registry", "etcd-rendezvous"),
        ("registry", "etcd-rendezvous-v2"),
        ("torchrun-etcd", "etcd-rendezvous"),
        ("torchrun-etcd-v2", "etcd-rendezvous-v2"),
    ],
)
def test_a_factory_made_handler_releases_its_connection_on_close(
    etcd_server: EtcdServer, run_id: str, opened: list[CloseSpy], creator: str, backend: str
) -> None:
    params = _params(etcd_server, run_id, backend)
    with CREATORS[creator](params) as handler:
        assert handler.get_backend() == backend
        handler.next_rendezvous()
        [spy] = opened
        assert spy.calls == 0
    assert spy.calls == 1
    handler.close()
    assert spy.calls == 1


def test_the_etcd_v2_factory_closes_its_connection_when_it_fails(
    etcd_server: EtcdServer, run_id: str, opened: list[CloseSpy]
) -> None:
    # An invalid option the handler reads after the backend opened its connection
    # (create_backend itself validates join_timeout before connecting).
    with pytest.raises(ValueError, match="last_call_timeout"):
        get_rendezvous_handler(_params(etcd_server, run_id, "etcd-v2", last_call_timeout="soon"))
    [spy] = opened
    assert spy.calls == 1


def test_the_etcd_v2_factory_checks_join_timeout_before_connecting(
    etcd_server: EtcdServer, run_id: str, opened: list[CloseSpy]
) -> None:
    # join_timeout bounds the connection's creation, so it is read first.
    with pytest.raises(ValueError, match="join_timeout"):
        get_rendezvous_handler(_params(etcd_server, run_id, "etcd-v2", join_timeout="soon"))
    assert opened == []


def test_the_etcd_factory_closes_its_connection_when_it_fails(
    etcd_server: EtcdServer, opened: list[CloseSpy], etcd_prefix: str
) -> None:
    # A run id the rendezvous refuses once the connection is open.
    params = _params(etcd_server, "a/b", "etcd", etcd_prefix=etcd_prefix)
    with pytest.raises(ValueError, match="run_id"):
        get_rendezvous_handler(params)
    [spy] = opened
    assert spy.calls == 1


@pytest.mark.v2_only(
    reason="on v3 a key prefix is no directory: a value at the prefix does not stop keys below it"
)
def test_the_etcd_factory_closes_its_connection_when_etcd_holds_a_bad_state(
    etcd_server: EtcdServer,
    run_id: str,
    opened: list[CloseSpy],
    conn: Transport,
    etcd_prefix: str,
) -> None:
    conn.set(etcd_prefix, "a value where the key prefix should be a directory")
    with pytest.raises(RendezvousStateError, match=etcd_prefix):
        get_rendezvous_handler(_params(etcd_server, run_id, "etcd", etcd_prefix=etcd_prefix))
    [spy] = opened
    assert spy.calls == 1
