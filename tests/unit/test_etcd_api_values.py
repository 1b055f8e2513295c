"""Parsing of the ``etcd_api`` option, and turning a client into a transport (no etcd
needed: nothing here is contacted)."""

from __future__ import annotations

import etcd
import pytest

from etcd_rendezvous._transport.connect import as_transport, check_etcd_api
from etcd_rendezvous._transport.v3 import EtcdV3Connection


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "auto"), ("", "auto"), ("  ", "auto"), ("AUTO", "auto"), (" v2 ", "v2"), ("V3", "v3")],
)
def test_etcd_api_values(value: object, expected: str) -> None:
    assert check_etcd_api(value) == expected


def test_a_bad_value_names_the_option_it_came_from() -> None:
    with pytest.raises(ValueError, match=r"--etcd-api: .*'v4'"):
        check_etcd_api("v4", option="--etcd-api")


def test_as_transport_keeps_a_transport_and_names_the_parameter_of_anything_else() -> None:
    with EtcdV3Connection([("127.0.0.1", 9)]) as conn:
        assert as_transport(conn, param="etcd_client") is conn
    with pytest.raises(TypeError, match=r"^etcd_client: expected an etcd.Client .* got str"):
        as_transport("http://127.0.0.1:9", param="etcd_client")


def test_as_transport_makes_a_v2_connection_like_a_python_etcd_client() -> None:
    client = etcd.Client(host="127.0.0.1", port=9, read_timeout=7)
    with as_transport(client) as conn:
        assert (conn.api, conn.endpoints, conn.read_timeout) == ("v2", ["http://127.0.0.1:9"], 7)
