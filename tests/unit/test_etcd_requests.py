"""Unit tests for tests/support/etcd_requests.py: how etcd's counters become reads, writes and
keep-alives (the request-count test and the benchmarks rest on it)."""

from __future__ import annotations

from support.etcd_requests import changes, count_bytes, count_requests, samples


def test_v2_watches_are_reads_and_ttl_refreshes_are_keepalives_not_writes() -> None:
    delta = {
        'etcd_http_received_total{method="GET"}': 5.0,
        'etcd_http_received_total{method="PUT"}': 7.0,
        'etcd_http_received_total{method="DELETE"}': 1.0,
        "etcd_debugging_store_watch_requests_total": 4.0,
        'etcd_debugging_store_writes_total{action="update"}': 3.0,
        'etcd_debugging_store_writes_total{action="compareAndSwap"}': 2.0,
    }

    requests = count_requests(delta)

    assert (requests.reads, requests.writes, requests.keepalives) == (9.0, 5.0, 3.0)
    assert requests.by_method == {
        "v2 DELETE": 1.0,
        "v2 GET": 5.0,
        "v2 GET wait": 4.0,
        "v2 PUT": 4.0,
        "v2 PUT refresh": 3.0,
    }
    assert requests.other == {}


def test_v3_methods_by_class_and_unknown_ones_apart() -> None:
    def started(method: str) -> str:
        return f'grpc_server_started_total{{grpc_method="{method}",grpc_type="unary"}}'

    delta = {
        started("Range"): 6.0,
        started("Watch"): 2.0,
        started("LeaseTimeToLive"): 1.0,
        started("Txn"): 4.0,
        started("Put"): 1.0,
        started("LeaseGrant"): 2.0,
        started("LeaseKeepAlive"): 5.0,
        started("Compact"): 1.0,
    }

    requests = count_requests(delta)

    assert (requests.reads, requests.writes, requests.keepalives) == (9.0, 7.0, 5.0)
    assert requests.other == {"v3 Compact": 1.0}
    assert requests.describe(nodes=2).startswith("v3 Compact 0.5, v3 LeaseGrant 1.0")


def test_changes_keep_only_the_counters_that_moved() -> None:
    before = {'a{x="1"}': 1.0, "b": 2.0}
    after = {'a{x="1"}': 4.0, "b": 2.0, 'c{y="z"}': 1.0}

    delta = changes(before, after)

    assert delta == {'a{x="1"}': 3.0, 'c{y="z"}': 1.0}
    assert list(samples(delta, "c")) == [({"y": "z"}, 1.0)]
    assert list(samples(delta, "b")) == []


def test_grpc_bytes_are_read_from_etcds_two_counters() -> None:
    delta = {
        "etcd_network_client_grpc_sent_bytes_total": 5000.0,
        "etcd_network_client_grpc_received_bytes_total": 700.0,
        'etcd_http_received_total{method="GET"}': 5.0,
    }

    counted = count_bytes(delta)

    assert (counted.sent, counted.received) == (5000.0, 700.0)
    assert count_bytes({}) == type(counted)(0.0, 0.0)
