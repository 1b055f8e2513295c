"""The ``etcd-v2`` backend against a real etcd: the backend contract, parameters, watches.

The contract cases are those of PyTorch's ``rendezvous_backend_test.py`` mixin and run
over whichever etcd API the session tests (v2, or v3 on an etcd without v2). The
interoperability cases run PyTorch 2.13's backend on the same key (skipped without
PyTorch, and on v3: PyTorch's backend speaks only v2).
"""

from __future__ import annotations

import json
import time
from base64 import b64encode
from typing import Any

import pytest

from etcd_rendezvous._dynamic.keys import AnnouncedNode
from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import KeyNotFoundError, Transport
from etcd_rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    _get_free_port,
)
from etcd_rendezvous.dynamic_rendezvous import NodeDesc
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend, create_backend
from etcd_rendezvous.etcd_store import EtcdStore
from support.faultproxy import FaultProxy
from support.threads import InThread
from support.wait import wait_until


@pytest.fixture
def backend(conn: Transport, etcd_prefix: str) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(conn, "dummy_run_id", etcd_prefix)


def _params(endpoint: str, run_id: str, **config: Any) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd-v2", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1, **config
    )


def _set(backend: EtcdRendezvousBackend, state: bytes, token: Any = None) -> tuple[Any, ...]:
    result = backend.set_state(state, token)
    assert result is not None
    return result


# -- the backend contract (PyTorch's RendezvousBackendTestMixin) ----------------------------


def test_get_state_returns_backend_state(backend):
    backend.set_state(b"x")
    result = backend.get_state()
    assert result is not None
    state, token = result
    assert state == b"x"
    assert token is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(backend):
    assert backend.get_state() is None


def test_get_state_raises_error_if_backend_state_is_corrupt(backend, conn):
    conn.set(backend.key, "non_base64!")
    with pytest.raises(RendezvousStateError, match=backend.key):
        backend.get_state()
    # A write with no token or a stale token reports the corruption as well, and never
    # overwrites the key: an operator may want to look at it.
    with pytest.raises(RendezvousStateError, match=backend.key):
        backend.set_state(b"y")
    assert conn.get(backend.key).value == "non_base64!"


@pytest.mark.v2_only(
    reason="v3 has no directories: keys written below the state key leave it a plain key"
)
def test_state_key_that_is_a_directory_is_corrupt(backend, conn):
    conn.set(backend.key + "/below", "x")
    with pytest.raises(RendezvousStateError, match=backend.key):
        backend.get_state()


def test_set_state_sets_backend_state_if_it_does_not_exist(backend):
    state, token, has_set = _set(backend, b"x")
    assert state == b"x"
    assert token is not None
    assert has_set is True


def test_set_state_sets_backend_state_if_token_is_current(backend):
    _, token1, has_set1 = _set(backend, b"x")
    state2, token2, has_set2 = _set(backend, b"y", token1)
    assert state2 == b"y"
    assert token1 != token2
    assert has_set1 is True
    assert has_set2 is True
    assert backend.get_state() == (b"y", token2)


def test_set_state_returns_current_backend_state_if_token_is_old(backend):
    _, token1, _ = _set(backend, b"x")
    state2, token2, _ = _set(backend, b"y", token1)
    state3, token3, has_set = _set(backend, b"z", token1)
    assert (state3, token3) == (state2, token2)
    assert has_set is False


def test_set_state_returns_current_backend_state_if_token_is_none(backend):
    state1, token1, _ = _set(backend, b"x")
    state2, token2, has_set = _set(backend, b"y")
    assert (state2, token2) == (state1, token1)
    assert has_set is False


@pytest.mark.parametrize("token", ["invalid", object(), 1.5j])
def test_set_state_returns_current_backend_state_if_token_is_invalid(backend, token):
    state1, token1, _ = _set(backend, b"x")
    state2, token2, has_set = _set(backend, b"y", token=token)
    assert (state2, token2) == (state1, token1)
    assert has_set is False


def test_set_state_accepts_a_token_given_as_a_string(backend):
    # Tokens are etcd indexes; PyTorch's backend converts them with int() too.
    _, token1, _ = _set(backend, b"x")
    assert _set(backend, b"y", str(token1))[2] is True


def test_set_state_returns_none_if_the_state_vanished(backend, conn):
    _, token, _ = _set(backend, b"x")
    conn.delete(backend.key)
    # PyTorch's backend raises a connection error here; there is simply no state.
    assert backend.set_state(b"y", token) is None
    assert backend.get_state() is None


def test_set_state_rejects_what_is_not_bytes(backend):
    with pytest.raises(TypeError, match="state"):
        backend.set_state("x")  # type: ignore[arg-type]


def test_wire_format_and_ttl(backend, conn):
    payload = bytes(range(256))
    _, token, _ = _set(backend, payload)
    node = conn.get(backend.key)
    assert node.value == b64encode(payload).decode()
    assert token == node.modified_index
    ttl = conn.time_to_live(node)
    assert ttl is not None
    assert 7000 < ttl <= 7200
    assert backend.name == "etcd-v2"


def test_custom_ttl_and_key_without_prefix(conn, etcd_prefix):
    backend = EtcdRendezvousBackend(conn, f"{etcd_prefix}/run", ttl=30)
    assert backend.key == f"{etcd_prefix}/run"
    assert backend.ttl == 30
    _set(backend, b"x")
    assert 0 < (conn.time_to_live(conn.get(backend.key)) or 0) <= 30
    assert EtcdRendezvousBackend(conn, "r", "/p", ttl=0).ttl == 7200
    with pytest.raises(ValueError, match="run id"):
        EtcdRendezvousBackend(conn, "", "/p")
    with pytest.raises(TypeError, match="client"):
        EtcdRendezvousBackend(object(), "r", "/p")


@pytest.mark.v2_only(reason="python-etcd's etcd.Client speaks only v2")
def test_accepts_a_python_etcd_client(etcd_client, etcd_prefix):
    backend = EtcdRendezvousBackend(etcd_client, "r", etcd_prefix)
    _, token, _ = _set(backend, b"x")
    assert backend.get_state() == (b"x", token)


def test_compare_and_swap_whose_answer_was_lost_is_recognised(
    etcd_proxy: FaultProxy, conn, etcd_prefix
):
    proxied = open_transport([etcd_proxy.endpoint], read_timeout=5)
    backend = EtcdRendezvousBackend(proxied, "r", etcd_prefix)
    _, token, _ = _set(backend, b"x")
    # The server applies the swap; the client loses the answer and sends it again,
    # which is refused ("compare failed"): the key's history shows the swap was ours.
    etcd_proxy.drop_responses(count=1, close_client=True)
    state, new_token, has_set = _set(backend, b"y", token)
    assert etcd_proxy.dropped_responses == 1
    assert (state, has_set) == (b"y", True)
    assert conn.get(backend.key).modified_index == new_token
    proxied.close()


# -- wait_for_change ---------------------------------------------------------------------------


def test_wait_for_change_returns_promptly_on_a_change(backend, conn):
    _, token, _ = _set(backend, b"x")
    waiter = InThread(lambda: backend.wait_for_change(token, 30))
    started = time.monotonic()
    _, new_token, _ = _set(backend, b"y", token)
    # The change brought the new state: the caller needs no read.
    assert waiter.result(10) == (b"y", new_token)
    assert time.monotonic() - started < 5


def test_wait_for_change_returns_at_once_if_already_changed(backend):
    _, token, _ = _set(backend, b"x")
    _, new_token, _ = _set(backend, b"y", token)
    started = time.monotonic()
    assert backend.wait_for_change(token, 30) == (b"y", new_token)
    assert time.monotonic() - started < 2


def test_waits_share_one_watch_stream(backend, monkeypatch):
    opened: list[int] = []
    watch_stream = backend.connection.watch_stream

    def counting(key: str, start: int, **kwargs: Any) -> Any:
        opened.append(start)
        return watch_stream(key, start, **kwargs)

    monkeypatch.setattr(backend.connection, "watch_stream", counting)
    _, token, _ = _set(backend, b"0")
    for i in range(1, 6):
        waiter = InThread(lambda token=token: backend.wait_for_change(token, 30))
        _, token, _ = _set(backend, str(i).encode(), token)
        assert waiter.result(10) == (str(i).encode(), token)
    assert len(opened) == 1


def test_wait_for_change_times_out_without_a_change(backend, conn):
    _, token, _ = _set(backend, b"x")
    conn.set(backend.key + "-other", "unrelated")
    started = time.monotonic()
    backend.wait_for_change(token, 0.5)
    assert 0.45 <= time.monotonic() - started < 3
    backend.wait_for_change(token, 0)


def test_wait_for_change_from_no_state_sees_the_creation(backend, conn):
    assert backend.get_state() is None
    waiter = InThread(lambda: backend.wait_for_change(None, 30))
    started = time.monotonic()
    _, token, _ = _set(backend, b"x")
    assert waiter.result(10) == (b"x", token)
    assert time.monotonic() - started < 5


def test_wait_for_change_sees_expiry_and_deletion(backend, conn):
    _, token, _ = _set(backend, b"x")
    waiter = InThread(lambda: backend.wait_for_change(token, 30))
    conn.delete(backend.key)
    assert waiter.result(10) is None


def test_wait_for_change_past_etcd_history(backend, conn, etcd_prefix):
    """A token older than etcd's event history (1000 events) still works."""
    _, token, _ = _set(backend, b"x")
    for i in range(1010):
        conn.set(f"{etcd_prefix}/filler", str(i))
    # Unchanged since the token: waits for the whole timeout, no spurious return.
    started = time.monotonic()
    backend.wait_for_change(token, 0.5)
    assert time.monotonic() - started >= 0.45
    # Changed, but the change is no longer in the history: returns at once.
    _set(backend, b"y", token)
    for i in range(1010):
        conn.set(f"{etcd_prefix}/filler", str(i))
    started = time.monotonic()
    backend.wait_for_change(token, 30)
    assert time.monotonic() - started < 2


def test_wait_for_change_with_an_unusable_token_returns(backend):
    started = time.monotonic()
    backend.wait_for_change("invalid", 30)
    assert time.monotonic() - started < 1


# -- node keys ---------------------------------------------------------------------------------


@pytest.fixture
def keyed(conn: Transport, etcd_prefix: str) -> EtcdRendezvousBackend:
    """A backend whose node keys land inside the test's prefix."""
    return EtcdRendezvousBackend(conn, "run/1", f"{etcd_prefix}/rdzv")


def test_node_keys_live_next_to_the_state_keys(keyed, etcd_prefix):
    layout = keyed.nodes_layout
    assert keyed.key == f"{etcd_prefix}/rdzv/run/1"
    assert layout.nodes_dir == f"{etcd_prefix}/rdzv_nodes/run~2f1"
    assert layout.node_key("h_1", 7, 0) == f"{etcd_prefix}/rdzv_nodes/run~2f1/h~5f1_7_0"
    assert layout.aggregator_key == f"{etcd_prefix}/rdzv_nodes/run~2f1/aggregator"


def test_announced_nodes_are_listed_oldest_first(keyed, conn):
    assert keyed.list_nodes() == []
    nodes = [NodeDesc("host-b", 2, 0), NodeDesc("host-a", 1, 5), NodeDesc("h:x/y_z", 3, 1)]
    created = [keyed.announce_node(node, 30) for node in nodes]
    assert created == sorted(created)
    assert keyed.list_nodes() == [AnnouncedNode(n, i) for n, i in zip(nodes, created)]
    key = keyed.nodes_layout.node_key("host-b", 2, 0)
    assert json.loads(conn.get(key).value) == {"addr": "host-b", "pid": 2, "local_id": 0}
    assert 0 < (conn.time_to_live(conn.get(key)) or 0) <= 30
    # Announcing again (a retry) keeps the key and its place.
    assert keyed.announce_node(nodes[0], 30) == created[0]


def test_listing_skips_what_is_not_a_node_key(keyed, conn):
    node = NodeDesc("h", 1, 0)
    keyed.announce_node(node, 30)
    nodes_dir = keyed.nodes_layout.nodes_dir
    conn.set(f"{nodes_dir}/stray", json.dumps({"addr": "x", "pid": 1, "local_id": 1}))
    conn.set(f"{nodes_dir}/h~41_2_0", "not the canonical spelling of A_2_0")
    conn.set(f"{nodes_dir}/sub/h_3_0", json.dumps({"addr": "h", "pid": 3, "local_id": 0}))
    assert keyed.claim_aggregator(node, 30)
    assert [entry.node for entry in keyed.list_nodes()] == [node]


def test_a_node_key_says_which_round_the_node_leaves(keyed, conn):
    a, b = NodeDesc("a", 1, 0), NodeDesc("b", 1, 0)
    created = [keyed.announce_node(node, 30) for node in (a, b)]
    keyed.mark_leaving(b, 7, 30)
    # The key keeps its place (created index), its TTL and its node; the mark is listed.
    assert keyed.list_nodes() == [AnnouncedNode(a, created[0]), AnnouncedNode(b, created[1], 7)]
    key = keyed.nodes_layout.node_key("b", 1, 0)
    assert json.loads(conn.get(key).value) == {"addr": "b", "pid": 1, "local_id": 0, "leaving": 7}
    assert 0 < (conn.time_to_live(conn.get(key)) or 0) <= 30
    assert keyed.refresh_node(b, 30)
    assert keyed.list_nodes()[1].leaving == 7  # A refresh keeps the value.
    # A key that is gone is created by the mark; a value that is no JSON says nothing.
    keyed.withdraw_node(a)
    keyed.mark_leaving(a, 8, 30)
    assert [(e.node, e.leaving) for e in keyed.list_nodes()] == [(b, 7), (a, 8)]
    conn.set(key, '{"leaving": 3')  # (On v2, a plain write makes it the youngest key.)
    assert {e.node: e.leaving for e in keyed.list_nodes()} == {b: None, a: 8}


def test_refresh_and_withdraw_a_node(keyed, conn):
    node = NodeDesc("h", 1, 0)
    assert not keyed.refresh_node(node, 30)
    keyed.announce_node(node, 30)
    assert keyed.refresh_node(node, 30)
    keyed.withdraw_node(node)
    assert keyed.list_nodes() == []
    assert not keyed.refresh_node(node, 30)
    keyed.withdraw_node(node)  # Gone already: nothing to do.


def test_the_aggregator_lock(keyed, conn):
    a, b = NodeDesc("a", 1, 0), NodeDesc("b", 1, 0)
    assert keyed.aggregator() is None
    assert not keyed.renew_aggregator(a, 30)
    assert keyed.claim_aggregator(a, 30)
    assert not keyed.claim_aggregator(b, 30)
    assert keyed.aggregator() == a
    assert keyed.renew_aggregator(a, 30)
    lock = conn.get(keyed.nodes_layout.aggregator_key)
    assert 0 < (conn.time_to_live(lock) or 0) <= 30
    keyed.release_aggregator(b)  # Not b's: stays.
    assert keyed.aggregator() == a
    keyed.release_aggregator(a)
    assert keyed.aggregator() is None
    assert keyed.claim_aggregator(b, 30)


def test_a_lapsed_aggregator_cannot_renew_the_lock_another_node_took(keyed):
    a, b = NodeDesc("a", 1, 0), NodeDesc("b", 1, 0)
    assert keyed.claim_aggregator(a, 1)
    wait_until(lambda: keyed.aggregator() is None, what="the aggregator lock to lapse")
    assert keyed.claim_aggregator(b, 30)
    assert not keyed.renew_aggregator(a, 30)  # b's lock: a renews only its own.
    assert keyed.aggregator() == b
    assert keyed.renew_aggregator(b, 30)


# -- create_backend ----------------------------------------------------------------------------


def test_create_backend_returns_backend_and_store(etcd_server, run_id, conn):
    params = _params(etcd_server.get_endpoint(), run_id, protocol="hTTp", read_timeout="10")
    backend, store = create_backend(params)
    assert backend.name == "etcd-v2"
    assert backend.key == f"/torch/elastic/rendezvous/{run_id}"
    assert isinstance(store, EtcdStore)
    assert store.prefix == "/torch/elastic/store/"
    assert store.connection is backend.connection
    assert store.connection.read_timeout == 10

    backend.set_state(b"dummy_state")
    node = conn.get(f"/torch/elastic/rendezvous/{run_id}")
    assert node.value == b64encode(b"dummy_state").decode()
    ttl = conn.time_to_live(node)
    assert ttl is not None
    assert ttl <= 7200

    store.set(f"{run_id}/key", "value")
    stored = conn.get("/torch/elastic/store/" + b64encode(f"{run_id}/key".encode()).decode())
    assert stored.value == b64encode(b"value").decode()
    conn.delete(stored.key)


def test_create_backend_defaults(etcd_server, run_id):
    backend, store = create_backend(_params(etcd_server.get_endpoint(), run_id))
    assert store.connection.read_timeout == 60
    assert store.connection.endpoints == [f"http://{etcd_server.get_endpoint()}"]
    assert backend.ttl == 7200


def test_get_waits_for_store_key_on_a_fresh_etcd(private_etcd_server, run_id):
    """PyTorch issue 132950: on a fresh etcd ``/torch/elastic/store`` does not exist."""
    _, store = create_backend(_params(private_etcd_server.get_endpoint(), run_id))
    key = RendezvousStoreInfo.MASTER_ADDR_KEY
    assert not store.check([key])
    assert store.num_keys() == 0
    getter = InThread(lambda: store.get(key))
    store.set(key, b"foo")
    assert getter.result(30) == b"foo"


@pytest.mark.parametrize(
    ("overrides", "culprit"),
    [
        ({"protocol": "dummy"}, "protocol"),
        ({"read_timeout": "0"}, "read_timeout"),
        ({"read_timeout": "-10"}, "read_timeout"),
        ({"read_timeout": "soon"}, "read_timeout"),
        ({"connect_timeout": "0"}, "connect_timeout"),
        ({"ssl_cert": "/nonexistent/cert.pem"}, "ssl_cert"),
        ({"ca_cert": "/nonexistent/ca.pem"}, "ca_cert"),
        ({"ssl_cert_key": "/nonexistent/key.pem"}, "ssl_cert_key"),
        ({"username": "root"}, "password"),
        ({"password": "secret"}, "username"),
        ({"etcd_api": "v4"}, "etcd_api"),
    ],
)
def test_create_backend_names_the_bad_parameter(etcd_server, run_id, overrides, culprit):
    with pytest.raises(ValueError, match=culprit):
        create_backend(_params(etcd_server.get_endpoint(), run_id, **overrides))


def test_client_key_without_certificate_is_refused(etcd_server, run_id, tls_certs):
    params = _params(etcd_server.get_endpoint(), run_id, ssl_cert_key=tls_certs["node.key"])
    with pytest.raises(ValueError, match="ssl_cert_key"):
        create_backend(params)


@pytest.mark.parametrize(
    ("endpoint", "culprit"),
    [("localhost:notaport", "notaport"), ("localhost:99999", "99999"), ("a,,b", "a,,b")],
)
def test_create_backend_names_the_bad_endpoint(run_id, endpoint, culprit):
    with pytest.raises(ValueError, match=culprit):
        create_backend(_params(endpoint, run_id))


def test_create_backend_raises_if_etcd_is_unreachable(run_id):
    endpoint = f"127.0.0.1:{_get_free_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        create_backend(_params(endpoint, run_id, read_timeout=1))
    assert time.monotonic() - started < 10


def test_several_endpoints_with_the_first_closed(etcd_server, run_id):
    dead = f"127.0.0.1:{_get_free_port()}"
    params = _params(f"{dead},{etcd_server.get_endpoint()}", run_id, read_timeout=5)
    backend, store = create_backend(params)
    assert store.connection.endpoints[0] == f"http://{dead}"
    _, token, has_set = _set(backend, b"x")
    assert has_set is True
    assert backend.get_state() == (b"x", token)


def test_create_backend_over_tls_with_client_certificates(run_id, tls_certs, tls_etcd_server):
    server = tls_etcd_server
    params = _params(
        server.get_endpoint(),
        run_id,
        protocol="https",
        ssl_cert=tls_certs["node.crt"],
        ssl_cert_key=tls_certs["node.key"],
        ca_cert=tls_certs["ca.crt"],
        read_timeout=5,
    )
    backend, store = create_backend(params)
    _, token, _ = _set(backend, b"\x00secret\xff")
    assert backend.get_state() == (b"\x00secret\xff", token)
    store.set("k", b"v")
    assert store.get("k") == b"v"

    # Without the CA bundle the server's certificate is rejected, naming the endpoint.
    params = _params(server.get_endpoint(), run_id, protocol="https", read_timeout=2)
    with pytest.raises(RendezvousConnectionError, match=server.get_endpoint()):
        create_backend(params)


# -- interoperability with PyTorch 2.13 ---------------------------------------------------------


@pytest.fixture
def torch_backend(etcd_client: Any, run_id: str) -> Any:
    module = pytest.importorskip(
        "torch.distributed.elastic.rendezvous.etcd_rendezvous_backend",
        reason="PyTorch is not installed: `pip install torch==2.13.0` to run interop tests",
    )
    return module.EtcdRendezvousBackend(etcd_client, run_id, "/torch/elastic/rendezvous")


_TORCH_SPEAKS_V2 = pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")


@pytest.mark.torch
@_TORCH_SPEAKS_V2
def test_torch_and_we_share_state_and_tokens(torch_backend, etcd_server, run_id):
    ours, _ = create_backend(_params(etcd_server.get_endpoint(), run_id, read_timeout=10))

    _, token, has_set = torch_backend.set_state(b"from torch")
    assert has_set
    assert ours.get_state() == (b"from torch", token)

    # Our write with torch's token succeeds; torch reads it with our token.
    _, our_token, has_set = _set(ours, b"from us", token)
    assert has_set is True
    assert torch_backend.get_state() == (b"from us", our_token)

    # Stale tokens are refused both ways, returning the current state.
    assert torch_backend.set_state(b"stale", token) == (b"from us", our_token, False)
    assert ours.set_state(b"stale", token) == (b"from us", our_token, False)
    # Neither creates over an existing state.
    assert ours.set_state(b"new") == (b"from us", our_token, False)

    # torch's write with our token succeeds, and we follow it with torch's token.
    _, torch_token, has_set = torch_backend.set_state(b"torch again", our_token)
    assert has_set
    assert ours.get_state() == (b"torch again", torch_token)


@pytest.mark.torch
@_TORCH_SPEAKS_V2
def test_our_watch_sees_a_torch_write(torch_backend, etcd_server, run_id):
    ours, _ = create_backend(_params(etcd_server.get_endpoint(), run_id, read_timeout=10))
    _, token, _ = _set(ours, b"x")
    waiter = InThread(lambda: ours.wait_for_change(token, 30))
    _, torch_token, _ = torch_backend.set_state(b"y", token)
    assert waiter.result(10) == (b"y", torch_token)
    ours.close()


def test_create_backend_does_not_leave_the_state_key(etcd_server, run_id, conn):
    create_backend(_params(etcd_server.get_endpoint(), run_id))
    with pytest.raises(KeyNotFoundError):
        conn.get(f"/torch/elastic/rendezvous/{run_id}")
