"""``open_transport``: which etcd API it picks, and how it refuses one the server lacks.

Run against the session's etcd (v2 served unless ``ETCD_RENDEZVOUS_ETCD_API=v3``) and
a v2-less etcd (the session's own in the v3 pass, else one of this module's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.api import RendezvousConnectionError
from etcd_rendezvous.etcd_server import EtcdServer
from support.net import closed_port, endpoint_of


@pytest.fixture(scope="module")
def v2less_server(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """An etcd without the v2 API, as etcd 3.6 is: the session's, if it is one."""
    if not etcd_server.enable_v2:
        yield etcd_server
        return
    with EtcdServer(etcd_binary=etcd_server.binary, enable_v2=False) as server:
        yield server


def _auto_picks(
    api: str, server: EtcdServer, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``etcd_api=auto`` against ``server`` opens a working connection of ``api`` and
    logs its choice."""
    caplog.set_level(logging.INFO, logger="etcd_rendezvous._transport.connect")
    with open_transport([endpoint_of(server)]) as conn:
        assert isinstance(conn, {"v2": EtcdConnection, "v3": EtcdV3Connection}[api])
        assert conn.api == api
        assert conn.set(f"{etcd_prefix}/k", "v").value == "v"
        assert conn.get(f"{etcd_prefix}/k").value == "v"
    assert f"using the {api} API (etcd_api=auto)" in caplog.text


@pytest.mark.v2_only(reason="auto picks v2 only where the server serves it")
def test_auto_picks_v2_where_the_server_serves_it(
    etcd_server: EtcdServer, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    _auto_picks("v2", etcd_server, etcd_prefix, caplog)
    assert etcd_server.version is not None
    assert etcd_server.version in caplog.text


def test_auto_picks_v3_where_the_server_has_no_v2(
    v2less_server: EtcdServer, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    _auto_picks("v3", v2less_server, etcd_prefix, caplog)


def test_v2_insisted_on_against_a_server_without_it_fails_fast_naming_option_and_version(
    v2less_server: EtcdServer,
) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        open_transport([endpoint_of(v2less_server)], etcd_api="v2", read_timeout=30)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert "etcd_api" in message
    assert v2less_server.version is not None
    assert v2less_server.version in message
    assert v2less_server.client_url in message


@pytest.mark.parametrize("which", ["session", "v2less"])
def test_v3_insisted_on_works_on_every_server(
    which: str,
    etcd_server: EtcdServer,
    v2less_server: EtcdServer,
    etcd_prefix: str,
) -> None:
    server = etcd_server if which == "session" else v2less_server
    with open_transport([endpoint_of(server)], etcd_api="v3") as conn:
        assert isinstance(conn, EtcdV3Connection)
        written = conn.set(f"{etcd_prefix}/k", "v")
        assert conn.get(f"{etcd_prefix}/k").modified_index == written.modified_index
        assert conn.server_version() == server.version


# An empty value means "absent" (auto), as for the other options: see tests/unit/.
@pytest.mark.parametrize("value", ["v4", "2", 3, "v2v3"])
def test_a_bad_etcd_api_is_a_value_error_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match="etcd_api"):
        open_transport([("127.0.0.1", closed_port())], etcd_api=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("etcd_api", ["auto", "v2", "v3"])
def test_a_refused_port_fails_within_seconds_naming_the_endpoint(etcd_api: str) -> None:
    port = closed_port()
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        open_transport([("127.0.0.1", port)], etcd_api=etcd_api)
    assert time.monotonic() - started < 7
    assert f"127.0.0.1:{port}" in str(info.value)
