"""EtcdCluster itself, and a 3-member cluster losing its leader while a rendezvous is in use."""

from __future__ import annotations

import gc
import os
import re
import socket
import time
import uuid

import pytest
import urllib3

from etcd_rendezvous import etcd_cluster as etcd_cluster_module
from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_cluster import EtcdCluster, EtcdClusterMember
from etcd_rendezvous.etcd_rendezvous import create_rdzv_handler
from etcd_rendezvous.etcd_server import EtcdServerError
from etcd_rendezvous.pytest_plugin import etcd_api_under_test
from support import v3_gateway
from support.processes import pid_alive, process_state
from support.threads import in_threads
from support.wait import wait_until

pytestmark = pytest.mark.slow


def reads(member: EtcdClusterMember, key: str, expected: str) -> bool:
    """Whether ``member`` answers a linearizable read of ``key`` with ``expected``."""
    try:
        return v3_gateway.get(member.client_url, key, timeout=1) == expected
    except Exception:  # not answering yet: the caller waits
        return False


# -- EtcdCluster -------------------------------------------------------------------------


def test_start_serves_and_stop_cleans_up() -> None:
    enable_v2 = etcd_api_under_test() == "v2"
    cluster = EtcdCluster(enable_v2=enable_v2)
    assert cluster.members == ()
    assert cluster.endpoints == ""
    cluster.start()
    try:
        assert cluster.start() is cluster  # a no-op on a started cluster
        members = cluster.members
        assert len(members) == 3
        assert [m.index for m in members] == [0, 1, 2]
        assert len({m.port for m in members} | {m.peer_port for m in members}) == 6
        assert cluster.endpoints == ",".join(f"127.0.0.1:{m.port}" for m in members)
        assert cluster.get_endpoints() == cluster.endpoints
        assert all(m.host == "127.0.0.1" and m.endpoint == f"127.0.0.1:{m.port}" for m in members)
        assert all(m.running and pid_alive(m.pid) for m in members)
        assert cluster.version is not None
        assert cluster.enable_v2 is enable_v2

        # A write through one member is read through every other.
        v3_gateway.put(members[0].client_url, "/cluster/k", "v")
        assert [v3_gateway.get(m.client_url, "/cluster/k") for m in members] == ["v"] * 3
        expected_v2 = 200 if enable_v2 else 404
        assert {v3_gateway.status_of(m.client_url, "/v2/keys/") for m in members} == {expected_v2}

        leader = cluster.leader()
        assert leader is not None
        assert leader in members
        assert cluster.wait_for_leader(timeout=5) is leader
        pids, base = [m.pid for m in members], cluster.base_dir
        assert base is not None
        assert os.path.isdir(members[1].data_dir)
        assert "=== etcd-rendezvous: attempt 1:" in members[1].read_log()
    finally:
        cluster.stop()

    assert not os.path.exists(base)
    assert cluster.base_dir is None
    assert not any(pid_alive(pid) for pid in pids)
    assert not any(m.running for m in members)
    # The logs are still readable after the directory is gone.
    assert all(m.name in cluster.read_logs() for m in members)
    assert members[0].read_log(2)
    cluster.stop()  # idempotent
    with pytest.raises(EtcdServerError, match="stopped cluster"):
        members[0].restart()


def test_kill_leader_elects_a_new_one_among_the_survivors(etcd_cluster: EtcdCluster) -> None:
    old = etcd_cluster.kill_leader()
    assert not old.running
    new = etcd_cluster.wait_for_leader(timeout=30)
    assert new is not old
    assert new.running
    v3_gateway.put(new.client_url, "/failover/k", "after")

    old.restart()
    assert old.running
    # The restarted member caught up with the write made while it was dead.
    assert v3_gateway.get(old.client_url, "/failover/k") == "after"
    assert etcd_cluster.wait_for_leader(timeout=30).running


def test_suspended_leader_is_replaced_and_rejoins_on_resume(etcd_cluster: EtcdCluster) -> None:
    old = etcd_cluster.wait_for_leader(timeout=30)
    old.suspend()
    try:
        assert old.suspended
        # SIGSTOP takes effect asynchronously: wait until every thread is stopped.
        wait_until(lambda: process_state(old.pid) == "T", what="the leader to be stopped")
        with pytest.raises(urllib3.exceptions.TimeoutError):
            v3_gateway.get(old.client_url, "/suspend/k", timeout=0.5)
        new = etcd_cluster.wait_for_leader(timeout=30)
        assert new is not old
        v3_gateway.put(new.client_url, "/suspend/k", "while-suspended")
    finally:
        old.resume()
    assert not old.suspended
    wait_until(lambda: reads(old, "/suspend/k", "while-suspended"), what="the old leader to rejoin")
    assert etcd_cluster.wait_for_leader(timeout=30).running


def test_member_stop_and_restart_without_waiting(etcd_cluster: EtcdCluster) -> None:
    # Two members down: the last one has no quorum and no leader.
    first, second, last = etcd_cluster.members
    first.stop()
    second.kill()
    assert not first.running
    assert not second.running
    # A lone leader steps down once it misses the quorum for an election timeout.
    wait_until(lambda: etcd_cluster.leader() is None, what="the lone member to have no leader")
    with pytest.raises(EtcdServerError, match="no leader"):
        etcd_cluster.wait_for_leader(timeout=1)
    # Bringing one back restores the quorum.
    first.restart(wait=False)
    assert etcd_cluster.wait_for_leader(timeout=30) in (first, last)
    second.restart()
    v3_gateway.put(second.client_url, "/restart/k", "v")
    wait_until(lambda: reads(last, "/restart/k", "v"), what="the write to reach the last member")


def test_forgotten_cluster_is_killed_and_cleaned_up() -> None:
    cluster = EtcdCluster(size=1, enable_v2=False).start()
    pid, base = cluster.members[0].pid, cluster.base_dir
    assert base is not None
    del cluster
    gc.collect()
    assert not pid_alive(pid)
    assert not os.path.exists(base)


def test_port_race_starts_over_on_new_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hold a port so that a member's bind fails, as if another process had taken it
    # between our probe and etcd's bind: the cluster starts again on new ports.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        thief.bind(("127.0.0.1", 0))
        busy = thief.getsockname()[1]
        real_free_ports = etcd_cluster_module.free_ports
        calls: list[int] = []

        def free_ports(count: int) -> list[int]:
            calls.append(count)
            ports = real_free_ports(count)
            return [busy, *ports[1:]] if len(calls) == 1 else ports

        monkeypatch.setattr(etcd_cluster_module, "free_ports", free_ports)
        with EtcdCluster(size=1, enable_v2=False) as cluster:
            assert calls == [2, 2]
            assert cluster.members[0].port != busy
            log = cluster.read_logs()
            assert "attempt 2" in log
            assert re.search("address already in use", log, re.IGNORECASE)


def test_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="size"):
        EtcdCluster(size=0)


# -- a rendezvous losing the leader ------------------------------------------------------


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


def test_rendezvous_and_store_survive_losing_the_leader(etcd_cluster: EtcdCluster) -> None:
    run_id = f"cluster-{uuid.uuid4().hex[:8]}"
    leader = etcd_cluster.wait_for_leader()
    # The leader is listed first, so it is the member the handler talks to.
    order = [leader] + [m for m in etcd_cluster.members if m is not leader]
    endpoint = ",".join(m.endpoint for m in order)
    survivors = [(m.host, m.port) for m in order[1:]]

    with create_rdzv_handler(_params(endpoint, run_id, 1)) as handler:
        info = handler.next_rendezvous()
        keeper = handler._rdzv_impl._lease_this_rank
        assert keeper is not None
        rank_key = keeper.key  # the member key: the worker's keep-alive key

        leader.kill()

        # Writes wait out the election, then go through a surviving member.
        info.store.set("after", "leader-loss")
        assert info.store.get("after") == b"leader-loss"
        assert info.store.add("counter", 3) == 3

        # The keep-alive thread kept going: the key (TTL 10 s) shows a TTL of 9 s or
        # more later than 2 s after the kill and the election (a new leader extends
        # v3 leases by an election timeout), so it was refreshed after both.
        etcd_cluster.wait_for_leader()
        elected_at = time.monotonic()
        with open_transport(survivors, read_timeout=5) as check:
            wait_until(
                lambda: (
                    time.monotonic() - elected_at > 2
                    and (check.time_to_live(check.get(rank_key)) or 0) >= 9
                ),
                what="a keep-alive refresh after the leader was killed",
            )
        assert keeper.alive

    # A new two-worker rendezvous completes on the remaining quorum.
    second_run = f"{run_id}-b"

    def join(_: int) -> tuple[int, int]:
        with create_rdzv_handler(_params(endpoint, second_run, 2)) as h:
            got = h.next_rendezvous()
            return (got.rank, got.world_size)

    assert sorted(in_threads(join, 2)) == [(0, 2), (1, 2)]
