"""A 3-member etcd cluster loses its leader while a rendezvous is in use."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from etcd_cluster import EtcdCluster
from etcd_rendezvous._client import EtcdConnection
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_rendezvous import create_rdzv_handler
from rdzv_helpers import wait_until

pytestmark = pytest.mark.slow


def _params(endpoint: str, run_id: str, nodes: int) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        local_addr="127.0.0.1",
        read_timeout=5,
        timeout=60,
    )


def test_rendezvous_and_store_survive_losing_the_leader():
    run_id = f"cluster-{uuid.uuid4().hex[:8]}"
    with EtcdCluster(3) as cluster:
        leader = cluster.leader()
        # The leader is listed first, so it is the member the handler talks to.
        order = [leader] + [i for i in range(3) if i != leader]
        endpoint = ",".join(f"127.0.0.1:{cluster.endpoints[i][1]}" for i in order)
        survivors = [cluster.endpoints[i] for i in order[1:]]

        with create_rdzv_handler(_params(endpoint, run_id, 1)) as handler:
            info = handler.next_rendezvous()
            rank_key = handler._rdzv_impl.get_path("/rdzv/v_1/rank_0")
            keeper = handler._rdzv_impl._lease_this_rank
            assert keeper is not None

            cluster.kill_member(leader)
            killed_at = time.monotonic()

            # Writes wait out the election, then go through a surviving member.
            info.store.set("after", "leader-loss")
            assert info.store.get("after") == b"leader-loss"
            assert info.store.add("counter", 3) == 3

            # The keep-alive thread kept going: the key (TTL 10 s) shows a TTL of 9 s or
            # more later than 2 s after the kill, so it was refreshed after the kill.
            check = EtcdConnection(survivors, read_timeout=5)
            wait_until(
                lambda: time.monotonic() - killed_at > 2 and (check.get(rank_key).ttl or 0) >= 9,
                what="a keep-alive refresh after the leader was killed",
            )
            assert keeper.alive

        # A new two-worker rendezvous completes on the remaining quorum.
        results: list[tuple[int, int]] = []
        errors: list[BaseException] = []
        second_run = f"{run_id}-b"

        def worker() -> None:
            try:
                with create_rdzv_handler(_params(endpoint, second_run, 2)) as h:
                    got = h.next_rendezvous()
                    results.append((got.rank, got.world_size))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        assert sorted(results) == [(0, 2), (1, 2)]
