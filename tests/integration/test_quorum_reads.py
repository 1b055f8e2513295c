"""Reads from a member cut off from the others, on a real 3-member cluster (v2 API).

A v2 read is answered by the member it reaches, from its own copy: a member that fell
behind, or is cut off from the others, answers old values. The operators' commands
decide from what they read (whether a run is finished, what to delete), so they read
through the cluster's consensus (``quorum=true``): such a member answers them nothing.
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


def _suspend(*members: EtcdClusterMember) -> None:
    for member in members:
        member.suspend()
    for member in members:
        wait_until(lambda m=member: process_state(m.pid) == "T", what=f"{member.name} to stop")


@contextmanager
def _cut_off_with_an_old_copy(
    cluster: EtcdCluster, key: str, old: str
) -> Iterator[EtcdClusterMember]:
    """Member ``c`` holds ``key`` as ``old`` while the others changed it, then is left
    alone (the others stopped): it cannot learn of the change, nor reach a quorum."""
    a, b, c = cluster.members
    with _connection(a) as to_a, _connection(c) as to_c:
        to_a.set(key, old)
        wait_until(lambda: to_c.try_get(key) is not None, what="member c to hold the key")
        _suspend(c)
        try:
            cluster.wait_for_leader(timeout=30)
            with _connection(a) as again:  # a and b hold a quorum
                again.set(key, "new")
            _suspend(a, b)
        finally:
            c.resume()
    try:
        yield c
    finally:
        a.resume()
        b.resume()


def test_a_quorum_read_from_a_member_cut_off_from_the_others_answers_no_old_value(
    etcd_cluster: EtcdCluster,
) -> None:
    key = f"/test/quorum-{uuid.uuid4().hex[:8]}"
    with _cut_off_with_an_old_copy(etcd_cluster, key, "old") as c:
        with _connection(c) as plain:
            node = plain.get(key)
            assert node.value == "old"  # the old copy, as a plain read finds it
        with _connection(c, quorum_reads=True) as quorum, pytest.raises(RendezvousConnectionError):
            quorum.get(key)


def test_status_through_a_member_cut_off_from_the_others_reports_no_old_state(
    etcd_cluster: EtcdCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """The member's copy of a run's state is a closed one; the run was started again
    since. ``status`` through that member fails, naming it, rather than report the
    closed state."""
    run_id = f"quorum-{uuid.uuid4().hex[:8]}"
    a = etcd_cluster.members[0]
    select = ["--backend", "etcd-v2", "--run-id", run_id, "--read-timeout", "2"]
    code, _, err = run_main(capsys, "close", "--endpoint", a.endpoint, *select, "--create")
    assert code == 0, err
    with _connection(a) as to_a:
        closed = to_a.get(etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX)).value
    assert closed is not None
    with _cut_off_with_an_old_copy(
        etcd_cluster, etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX), closed
    ) as c:
        code, out, err = run_main(capsys, "status", "--endpoint", c.endpoint, *select)
        assert code != 0, out
        assert "closed" not in out.lower(), out
        assert c.endpoint in err, err
