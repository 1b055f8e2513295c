"""The ``etcd_api`` option of both backends, given as a string (as torchrun's
``--rdzv-conf`` and ``etcd://`` URLs give it) against a real etcd.

``auto`` picks v2 where the server serves it and v3 otherwise; ``v2`` and ``v3`` insist,
and insisting on an API the server does not serve fails at once, naming the option.
etcd 3.4/3.5 serve v3 next to v2, and keep the two key spaces apart: reading a key back
through the API the option named shows the handler really wrote through it.
"""

from __future__ import annotations

from base64 import b64encode
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous.api import RendezvousConnectionError, RendezvousParameters
from etcd_rendezvous.etcd_rendezvous import create_rdzv_handler
from etcd_rendezvous.etcd_rendezvous_backend import create_backend
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.registry import get_rendezvous_handler

# Each value as the option is given, and the API it asks for ("auto": the server's pick).
VALUES = [
    pytest.param("v3", "v3", id="v3"),
    pytest.param(" V3 ", "v3", id="V3-padded"),
    pytest.param("auto", "auto", id="auto"),
    pytest.param(
        "v2",
        "v2",
        id="v2",
        marks=pytest.mark.v2_only(reason="insists on the v2 API"),
    ),
]


@pytest.fixture(scope="module")
def etcd_without_v2(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """An etcd that serves only the v3 API (as etcd 3.6 does), in either test mode."""
    with EtcdServer(etcd_binary=etcd_server.binary, enable_v2=False) as server:
        yield server


def _expected(etcd_server: EtcdServer, wanted: str) -> str:
    if wanted != "auto":
        return wanted
    return "v2" if etcd_server.enable_v2 else "v3"


def _config(etcd_prefix: str, **extra: Any) -> dict[str, Any]:
    """Options of a one-node rendezvous (it completes at once, at max_nodes), as strings."""
    return {
        "etcd_prefix": etcd_prefix,
        "last_call_timeout": "1",
        "read_timeout": "10",
        "torch_store": "false",
        **extra,
    }


def _params(backend: str, endpoint: str, run_id: str, **config: Any) -> RendezvousParameters:
    """A one-node rendezvous of ``backend`` (``config`` as torchrun passes it: strings)."""
    config.setdefault("read_timeout", "10")
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        **config,
    )


def _legacy_url(endpoint: str, run_id: str, **config: Any) -> str:
    query = urlencode({"min_workers": "1", "max_workers": "1", **config})
    return f"etcd://{endpoint}/{run_id}?{query}"


@pytest.mark.parametrize(("value", "wanted"), VALUES)
def test_etcd_v2_backend_uses_the_api_named(
    etcd_server: EtcdServer, run_id: str, value: str, wanted: str
) -> None:
    params = _params("etcd-v2", etcd_server.get_endpoint(), run_id, etcd_api=value)
    api = _expected(etcd_server, wanted)
    backend, store = create_backend(params)
    with backend:
        assert backend.connection.api == api
        assert store.connection is backend.connection
        written = backend.set_state(b"state")
        assert written is not None
        _, token, has_set = written
        assert has_set is True
        store.set("k", b"v")
        assert store.get("k") == b"v"
    endpoint = [(etcd_server.get_host(), etcd_server.get_port())]
    with open_transport(endpoint, etcd_api=api) as reader:
        node = reader.get(backend.key)
        assert (node.value, node.modified_index) == (b64encode(b"state").decode(), token)


@pytest.mark.parametrize("given_as", ["params", "url"])
@pytest.mark.parametrize(("value", "wanted"), VALUES)
def test_etcd_backend_uses_the_api_named(
    etcd_server: EtcdServer, etcd_prefix: str, run_id: str, value: str, wanted: str, given_as: str
) -> None:
    config = _config(etcd_prefix, etcd_api=value)
    endpoint = etcd_server.get_endpoint()
    spec: RendezvousParameters | str = (
        _params("etcd", endpoint, run_id, **config)
        if given_as == "params"
        else _legacy_url(endpoint, run_id, **config)
    )
    api = _expected(etcd_server, wanted)
    with create_rdzv_handler(spec) as handler:
        assert handler.rendezvous.connection.api == api
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        state_key = handler.rendezvous.layout.state_key
    with open_transport([(etcd_server.get_host(), etcd_server.get_port())], etcd_api=api) as reader:
        assert '"status": "final"' in (reader.get(state_key).value or "")


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_insisting_on_v2_without_v2_fails_naming_the_option(
    etcd_without_v2: EtcdServer,
    etcd_prefix: str,
    run_id: str,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rank 0 of etcd-v2 would start PyTorch's TCPStore server: not what this is about.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    endpoint = etcd_without_v2.get_endpoint()
    params = _params(backend, endpoint, run_id, **_config(etcd_prefix, etcd_api="v2"))
    with pytest.raises(RendezvousConnectionError, match="etcd_api=v2") as caught:
        get_rendezvous_handler(params)
    assert endpoint in str(caught.value)
    # auto settles for v3 on the same server.
    params = _params(backend, endpoint, run_id, **_config(etcd_prefix, etcd_api="auto"))
    with get_rendezvous_handler(params) as handler:
        assert handler.next_rendezvous().world_size == 1


# Each creates a handler from (endpoint, config): through the registry, or from a URL.
CREATORS = {
    "etcd-v2": lambda endpoint, config: get_rendezvous_handler(
        _params("etcd-v2", endpoint, "run", **config)
    ),
    "etcd": lambda endpoint, config: get_rendezvous_handler(
        _params("etcd", endpoint, "run", **config)
    ),
    "etcd-url": lambda endpoint, config: create_rdzv_handler(
        _legacy_url(endpoint, "run", **config)
    ),
}


@pytest.mark.parametrize("value", ["v4", "3", "yes", "v2,v3"])
@pytest.mark.parametrize("creator", sorted(CREATORS))
def test_a_bad_etcd_api_is_named_before_etcd_is_contacted(
    etcd_prefix: str, value: str, creator: str
) -> None:
    # Nothing listens on port 1: the option is checked before any connection attempt.
    with pytest.raises(ValueError, match="etcd_api") as caught:
        CREATORS[creator]("127.0.0.1:1", _config(etcd_prefix, etcd_api=value))
    assert repr(value) in str(caught.value)
