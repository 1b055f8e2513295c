"""Reads from a member cut off from the others, on a real 3-member cluster (v2 API).

A v2 read is answered by the member it reaches, from its own copy, with or without the
others: a member that fell behind, or is cut off from the others while they go on,
answers values older than the cluster's. The operators' commands decide from what they
read (whether a run is finished, what to delete), so they read through the cluster's
consensus (``quorum=true``): such a member answers them nothing.

The member is cut off here by stopping the two others (``SIGSTOP``): it keeps its copy
and answers plain reads from it, as a partitioned member does, while a read through
the consensus cannot be served.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous.api import RendezvousConnectionError
from etcd_rendezvous.etcd_cluster import EtcdCluster, EtcdClusterMember
from etcd_rendezvous.layout import ETCD_V2_STATE_PREFIX, etcd_v2_state_key
from support.cli import run_main
from support.processes import process_state
from support.wait import wait_until

pytestmark = pytest.mark.v2_only(reason="v3 reads are linearizable already")


def _connection(member: EtcdClusterMember, **options: bool) -> EtcdConnection:
    return EtcdConnection([(member.host, member.port)], read_timeout=2.0, **options)


@contextmanager
def _cut_off(cluster: EtcdCluster, key: str) -> Iterator[EtcdClusterMember]:
    """Member ``c``, once it holds ``key``, alone: the other two stopped."""
    a, b, c = cluster.members
    with _connection(c) as to_c:
        wait_until(lambda: to_c.try_get(key) is not None, what="member c to hold the key")
    for member in (a, b):
        member.suspend()
    try:
        for member in (a, b):
            wait_until(lambda m=member: process_state(m.pid) == "T", what=f"{member.name} to stop")
        yield c
    finally:
        a.resume()
        b.resume()


def test_a_quorum_read_from_a_member_cut_off_from_the_others_answers_nothing(
    etcd_cluster: EtcdCluster,
) -> None:
    key = f"/test/quorum-{uuid.uuid4().hex[:8]}"
    with _connection(etcd_cluster.members[0]) as to_a:
        to_a.set(key, "its copy")
    with _cut_off(etcd_cluster, key) as c:
        with _connection(c) as plain:
            assert plain.get(key).value == "its copy"  # answered without the others
        with (
            _connection(c, quorum_reads=True) as quorum,
            pytest.raises(RendezvousConnectionError),
        ):
            quorum.get(key)


def test_status_through_a_member_cut_off_from_the_others_reports_nothing(
    etcd_cluster: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """``status`` through a member alone fails, naming it, rather than report the run
    from that member's copy (which the others may have moved past)."""
    run_id = f"quorum-{uuid.uuid4().hex[:8]}"
    a = etcd_cluster.members[0]
    select = ["--backend", "etcd-v2", "--run-id", run_id, "--read-timeout", "2"]
    code, _, err = run_main(capsys, "close", "--endpoint", a.endpoint, *select, "--create")
    assert code == 0, err
    with _cut_off(etcd_cluster, etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX)) as c:
        code, out, err = run_main(capsys, "status", "--endpoint", c.endpoint, *select)
        assert code != 0, out
        assert "closed" not in out.lower(), out
        assert c.endpoint in err, err
