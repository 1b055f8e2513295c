"""Parsing of the ``etcd_api`` option (no etcd needed)."""

from __future__ import annotations

import pytest

from etcd_rendezvous._transport.connect import check_etcd_api


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "auto"), ("", "auto"), ("  ", "auto"), ("AUTO", "auto"), (" v2 ", "v2"), ("V3", "v3")],
)
def test_etcd_api_values(value: object, expected: str) -> None:
    assert check_etcd_api(value) == expected


def test_a_bad_value_names_the_option_it_came_from() -> None:
    with pytest.raises(ValueError, match=r"--etcd-api: .*'v4'"):
        check_etcd_api("v4", option="--etcd-api")
