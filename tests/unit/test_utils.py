"""Unit tests for etcd_rendezvous.utils: endpoint and configuration parsing."""

from __future__ import annotations

import re

import pytest

from etcd_rendezvous import utils
from etcd_rendezvous.utils import parse_rendezvous_endpoint, parse_rendezvous_endpoints

# parse_rendezvous_endpoint


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("example.com:1234", ("example.com", 1234)),
        ("example.com", ("example.com", 2379)),
        ("  example.com:1234  ", ("example.com", 1234)),
        ("10.0.0.1:0", ("10.0.0.1", 0)),
        ("10.0.0.1:65535", ("10.0.0.1", 65535)),
        ("my-host_1", ("my-host_1", 2379)),
        ("[::1]:1234", ("::1", 1234)),
        ("[::1]", ("::1", 2379)),
        ("[fe80::1]", ("fe80::1", 2379)),
        ("::1", (":", 1)),  # unbracketed IPv6: the last colon splits off the port, as in torch
        ("", ("localhost", 2379)),
        ("   ", ("localhost", 2379)),
        (None, ("localhost", 2379)),
    ],
)
def test_parse_endpoint(endpoint: str | None, expected: tuple[str, int]) -> None:
    assert parse_rendezvous_endpoint(endpoint, default_port=2379) == expected


@pytest.mark.parametrize(
    "endpoint", ["host:abc", "host:", "host:65536", "host:123456", "host:-1", "[::1]:x"]
)
def test_parse_endpoint_bad_port_names_endpoint(endpoint: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The port number of the rendezvous endpoint '{re.escape(endpoint)}' must be an "
        r"integer between 0 and 65536\.$",
    ):
        parse_rendezvous_endpoint(endpoint, 2379)


@pytest.mark.parametrize("endpoint", ["bad host", "host/path:1", "[]", ":1234", "a@b"])
def test_parse_endpoint_bad_host_names_endpoint(endpoint: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The hostname of the rendezvous endpoint '{re.escape(endpoint)}' must be a "
        "dot-separated list of labels",
    ):
        parse_rendezvous_endpoint(endpoint, 2379)


# parse_rendezvous_endpoints


def test_parse_endpoints_list() -> None:
    assert parse_rendezvous_endpoints("host1:2379,host2:2380", 1) == [
        ("host1", 2379),
        ("host2", 2380),
    ]


def test_parse_endpoints_tolerates_whitespace_and_mixes_forms() -> None:
    assert parse_rendezvous_endpoints(" host1 , [::1]:12 ,10.0.0.3:4 ", 2379) == [
        ("host1", 2379),
        ("::1", 12),
        ("10.0.0.3", 4),
    ]


def test_parse_endpoints_single() -> None:
    assert parse_rendezvous_endpoints("host", 2379) == [("host", 2379)]


@pytest.mark.parametrize("endpoints", ["", "  ", None])
def test_parse_endpoints_empty_means_localhost(endpoints: str | None) -> None:
    assert parse_rendezvous_endpoints(endpoints, 2379) == [("localhost", 2379)]


@pytest.mark.parametrize(
    ("endpoints", "position"), [("a,,b", 2), ("a, ,b", 2), ("a,", 2), (",a", 1)]
)
def test_parse_endpoints_rejects_empty_entry(endpoints: str, position: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^The rendezvous endpoint list '{re.escape(endpoints)}' has an empty entry at "
        rf"position {position}\.$",
    ):
        parse_rendezvous_endpoints(endpoints, 2379)


def test_parse_endpoints_bad_entry_names_entry() -> None:
    with pytest.raises(ValueError, match=r"rendezvous endpoint 'host2:abc' must be an integer"):
        parse_rendezvous_endpoints("host1:2379, host2:abc", 2379)


def test_all() -> None:
    assert utils.__all__ == ["parse_rendezvous_endpoint", "parse_rendezvous_endpoints"]


# _parse_rendezvous_config


def test_parse_config() -> None:
    assert utils._parse_rendezvous_config(" timeout = 30 ,last_call_timeout=5") == {
        "timeout": "30",
        "last_call_timeout": "5",
    }
    assert utils._parse_rendezvous_config("a=b=c") == {"a": "b=c"}
    assert utils._parse_rendezvous_config("  ") == {}


@pytest.mark.parametrize("config", ["=1", "a=1,,b=2", " =x"])
def test_parse_config_rejects_missing_key(config: str) -> None:
    with pytest.raises(ValueError, match=r"must be in format <key1>=<value1>"):
        utils._parse_rendezvous_config(config)


@pytest.mark.parametrize("config", ["timeout", "timeout=", "timeout= "])
def test_parse_config_rejects_missing_value_naming_key(config: str) -> None:
    with pytest.raises(
        ValueError, match=r"^The rendezvous configuration option 'timeout' must have a value"
    ):
        utils._parse_rendezvous_config(config)


@pytest.mark.torch
@pytest.mark.parametrize(
    "endpoint",
    ["host:1", "host", "[::1]:2", "[::1]", "", "host:abc", "host:70000", "bad host", "[]", "::1"],
)
def test_parse_endpoint_matches_torch(endpoint: str) -> None:
    torch_utils = pytest.importorskip("torch.distributed.elastic.rendezvous.utils")

    def outcome(parse: object) -> object:
        try:
            return parse(endpoint, 2379)  # type: ignore[operator]
        except ValueError as exc:
            return str(exc)

    assert outcome(parse_rendezvous_endpoint) == outcome(torch_utils.parse_rendezvous_endpoint)
