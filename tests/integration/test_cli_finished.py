"""What ``delete``, ``gc`` and ``list`` take for a finished run, against real worker
processes: only a run that is closed and quiet, judged by etcd's clock and keys with
lifetimes. A run whose workers etcd does not show (a re-rendezvous between two
versions, PyTorch's legacy workers below ``min_workers``, PyTorch's nodes between two
heartbeats of a long keep-alive interval) is never deleted without ``--force``; a
closed, quiet run still is, on etcd's v2 and v3 APIs."""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
from typing import Any

import pytest

from etcd_rendezvous._transport.interface import Node, Transport
from etcd_rendezvous.cli._runs import RunSummary, find_runs, read_run
from etcd_rendezvous.cli.delete import delete_runs
from etcd_rendezvous.dynamic_rendezvous import NodeDesc
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    dynamic_store_prefix,
)
from support.cli import run_cli, run_main
from support.net import endpoint_of
from support.rdzv import Worker, join_all, started
from support.transports import Connect
from support.wait import wait_until

_TORCH_LEGACY = "torch.distributed.elastic.rendezvous.etcd_rendezvous"
#: libfaketime, to run a command with a clock ahead of the workers' (Debian's path).
_FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def _spawn(
    workers: list[Worker], server: EtcdServer, impls: list[str], run_id: str, n: int, **kw: Any
) -> list[Worker]:
    group = [Worker(server.get_endpoint(), run_id, n, n, impl=impl, **kw) for impl in impls]
    return started(workers, group)


def _listed(capsys: pytest.CaptureFixture[str], *options: str) -> dict[str, dict[str, Any]]:
    code, out, err = run_main(capsys, "list", *options, "--json")
    assert code == 0, err
    return {run["run_id"]: run for run in json.loads(out)}


@pytest.mark.parametrize(
    "impl",
    [
        "ours",
        pytest.param(
            "torch", marks=[pytest.mark.torch, pytest.mark.v2_only(reason="PyTorch speaks v2")]
        ),
    ],
)
def test_a_legacy_run_between_two_versions_is_not_deleted(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    workers: list[Worker],
    impl: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A member's keep-alive lapsed: a waiting worker compare-and-deletes the final state,
    and the workers start the next version a moment later. Meanwhile the run has no state
    (nor a version to look in): it is not closed, so it is not finished."""
    if impl == "torch":
        pytest.importorskip(_TORCH_LEGACY)
    group = _spawn(workers, etcd_server, [impl, impl], run_id, 2, last_call=1)
    assert {j["version"] for j in join_all(group)} == {"1"}
    layout = LegacyLayout(DEFAULT_PREFIX, run_id)
    final = conn.get(layout.state_key)
    assert conn.compare_and_delete(layout.state_key, final)  # as the waiting worker does

    select = ["--endpoint", etcd_server.get_endpoint(), "--backend", "etcd"]
    run = _listed(capsys, *select)[run_id]
    assert (run["status"], run["finished"]) == ("none", False), run
    code, out, err = run_main(capsys, "delete", *select, "--run-id", run_id, "--yes")
    assert code == 1, out
    assert "not closed" in err, err
    assert f"etcd-rendezvous close --run-id {run_id}" in err, err
    # A dry run: the server is shared, and other tests' finished runs are not ours to delete.
    code, out, err = run_main(
        capsys, "gc", *select, "--older-than", "0", "--undated", "--dry-run", "--json"
    )
    assert code == 0, err
    assert run_id not in [r["run_id"] for r in json.loads(out)["runs"]], out
    assert conn.try_get(layout.counter_key) is not None

    # The workers go on: the next version forms, with the run's version counter.
    assert {j["version"] for j in join_all(group)} == {"2"}


@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd backend speaks only v2")
def test_pytorch_workers_below_min_workers_are_not_a_finished_run(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    workers: list[Worker],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """PyTorch's legacy workers waiting for ``min_workers`` keep a joinable state without
    a TTL and no key of their own until the version freezes: etcd shows no worker."""
    pytest.importorskip(_TORCH_LEGACY)
    waiting = _spawn(workers, etcd_server, ["torch", "torch"], run_id, 3, last_call=1)
    for worker in waiting:
        worker.send("join")
    layout = LegacyLayout(DEFAULT_PREFIX, run_id)

    def joined_two() -> bool:
        node = conn.try_get(layout.state_key)
        return node is not None and len(json.loads(node.value or "{}").get("participants", [])) == 2

    wait_until(joined_two, what="two PyTorch workers in the joinable state")
    select = ["--endpoint", etcd_server.get_endpoint(), "--backend", "etcd"]
    run = _listed(capsys, *select)[run_id]
    assert (run["status"], run["live"], run["finished"]) == ("joinable", 0, False), run
    code, _, err = run_main(capsys, "delete", *select, "--run-id", run_id, "--yes")
    assert (code, "not closed" in err) == (1, True), err
    # A dry run: the server is shared, and other tests' finished runs are not ours to delete.
    code, out, err = run_main(
        capsys, "gc", *select, "--older-than", "0", "--undated", "--dry-run", "--json"
    )
    assert code == 0, err
    assert run_id not in [r["run_id"] for r in json.loads(out)["runs"]], out

    # The third worker comes: all three rendezvous.
    (last,) = _spawn(workers, etcd_server, ["torch"], run_id, 3, last_call=1)
    last.send("join")
    joined = [worker.next_event() for worker in [*waiting, last]]
    assert sorted(j.get("rank") for j in joined) == [0, 1, 2], joined


@pytest.mark.torch
@pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2")
def test_an_etcd_v2_fleet_between_two_heartbeats_is_not_finished(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    workers: list[Worker],
) -> None:
    """PyTorch's nodes heartbeat every 150 s and keep no key: between two heartbeats etcd
    shows nothing of them but the state they last wrote. The first node done (ours)
    closed the run; the others are in their exit barrier. Judged by the operator's clock
    150 s later, their heartbeats look stale; by etcd's clock the state was written
    seconds ago, less than the heartbeat lifetime our node published (450 s)."""
    pytest.importorskip("torch.distributed.elastic.rendezvous.etcd_rendezvous_backend")
    if not os.path.exists(_FAKETIME):
        pytest.skip(f"needs libfaketime ({_FAKETIME})")
    options = {"extra_args": ["--backend=etcd-v2", "--keep-alive-interval=150"]}
    group = _spawn(workers, etcd_server, ["ours", "torch", "torch"], run_id, 3, **options)
    assert {j["round"] for j in join_all(group)} == {0}
    reply = group[0].request("shutdown")  # closes the run, deletes its node key
    assert reply["result"] is True, reply

    later = dict(os.environ, LD_PRELOAD=_FAKETIME, FAKETIME="+150s")
    select = ["--endpoint", etcd_server.get_endpoint(), "--backend", "etcd-v2"]
    listed = run_cli("list", *select, "--json", env=later)
    assert listed.returncode == 0, listed.stderr
    (run,) = [r for r in json.loads(listed.stdout) if r["run_id"] == run_id]
    assert (run["status"], run["live"], run["finished"]) == ("closed", 0, False), run
    assert run["heartbeat_lifetime"] == {"seconds": 450.0, "source": "published by its nodes"}
    collected = run_cli(
        "gc", *select, "--older-than", "0", "--undated", "--dry-run", "--json", env=later
    )
    assert collected.returncode == 0, collected.stderr
    candidates = [r["run_id"] for r in json.loads(collected.stdout)["runs"]]
    assert run_id not in candidates, candidates
    deleted = run_cli("delete", *select, "--run-id", run_id, "--yes", env=later)
    assert deleted.returncode == 1, deleted.stdout
    assert "not finished" in deleted.stderr, deleted.stderr
    assert conn.try_get(f"{ETCD_V2_STATE_PREFIX}/{run_id}") is not None
    # The nodes still in the run carry on, and learn that it is closed (PyTorch's handler
    # reads the state again once its cached copy is a second old).
    for worker in group[1:]:
        wait_until(lambda w=worker: w.request("closed")["value"], what="is_closed()")


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_closed_quiet_run_is_deleted(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    workers: list[Worker],
    backend: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The normal path: the job ends (its workers shut down, the first one closing the
    run), etcd shows none of them any more, and ``delete`` without ``--force`` deletes
    the run."""
    # etcd-v2: a heartbeat lifetime of 2 s, so that the state is soon old enough.
    short = ["--backend=etcd-v2", "--keep-alive-interval=1", "--keep-alive-max-attempt=2"]
    options = {"extra_args": short} if backend == "etcd-v2" else {"last_call": 1}
    group = _spawn(workers, etcd_server, ["ours", "ours"], run_id, 2, **options)
    join_all(group)
    for worker in group:
        assert worker.request("shutdown")["result"] is True
    select = ["--endpoint", etcd_server.get_endpoint(), "--backend", backend]

    def finished() -> bool:
        return bool(_listed(capsys, *select)[run_id]["finished"])

    wait_until(finished, timeout=60, what="the run to be closed and quiet")
    assert _listed(capsys, *select)[run_id]["reason"].startswith("closed")
    code, out, err = run_main(capsys, "delete", *select, "--run-id", run_id, "--yes", "--json")
    assert code == 0, err
    assert json.loads(out)["skipped"] == [], out
    assert run_id not in _listed(capsys, *select)
    if backend == "etcd":
        assert conn.try_get(LegacyLayout(DEFAULT_PREFIX, run_id).run_dir) is None
    else:
        assert conn.try_get(f"{ETCD_V2_STATE_PREFIX}/{run_id}") is None


def _closed_in_advance(
    capsys: pytest.CaptureFixture[str],
    server: EtcdServer,
    conn: Transport,
    backend: str,
    run_id: str,
) -> RunSummary:
    """A run closed before it started (``close --create``), as ``delete`` judges it."""
    select = ["--endpoint", server.get_endpoint(), "--backend", backend]
    code, _, err = run_main(capsys, "close", *select, "--run-id", run_id, "--create")
    assert code == 0, err
    judged = read_run(conn, backend, None, run_id)
    assert judged is not None
    assert judged.finished
    return judged


def _deleted(conn: Transport, judged: RunSummary) -> dict[str, Any]:
    """What ``delete --yes --json`` reports for ``judged`` (confirmed at once)."""
    options = argparse.Namespace(dry_run=False, yes=True, json=True, prefix=None)
    out = io.StringIO()
    assert delete_runs(options, conn, [judged], out) == 0
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_job_taking_the_run_id_during_the_deletion_keeps_its_keys(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    backend: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run id is reused at the worst moment: just after ``delete`` removed the closed
    state that kept new workers out, a job starts under it (a state and a worker's key).
    The look for worker keys right before the rest is deleted finds them, and leaves
    them."""
    judged = _closed_in_advance(capsys, etcd_server, conn, backend, run_id)
    layout = LegacyLayout(DEFAULT_PREFIX, run_id)
    new_keys = (
        [layout.state_key, layout.member_key("2", "node_" + "0" * 16)]
        if backend == "etcd"
        else [EtcdV2NodesLayout(run_id).node_key("10.0.0.9", 1, 0)]
    )
    compare_and_delete = conn.compare_and_delete

    def then_a_job_starts(key: str, prev: Node) -> bool:
        deleted = compare_and_delete(key, prev)
        if deleted and key == judged.state_key:
            for new_key in new_keys:
                conn.set(new_key, json.dumps({"status": "setup"}), ttl=60)
        return deleted

    monkeypatch.setattr(conn, "compare_and_delete", then_a_job_starts)
    report = _deleted(conn, judged)
    assert report["deleted"] == [judged.state_key], report
    (skipped,) = report["skipped"]
    assert "took the run id" in skipped["reason"], skipped
    for new_key in new_keys:
        assert conn.try_get(new_key) is not None, new_key


def test_a_job_taking_the_run_id_during_the_deletion_keeps_its_store_keys(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run id is reused after ``delete``'s last look, while it deletes the old run's
    keys in the shared store one request each (a large job leaves thousands): the new
    job's first round writes keys of the same names as the old job's first round. The
    key the new job wrote is kept: a store key is deleted only if it is still the one
    listed."""
    store = EtcdStore(conn, ETCD_V2_STORE_PREFIX)
    name = f"{dynamic_store_prefix(run_id, 0)}/MASTER_ADDR"
    store.set(name, "old-job")
    judged = _closed_in_advance(capsys, etcd_server, conn, "etcd-v2", run_id)
    (listed,) = [key for key, _ in judged.keys if key.startswith(ETCD_V2_STORE_PREFIX)]
    delete, compare_and_delete = conn.delete, conn.compare_and_delete

    def new_job_writes(key: str) -> None:
        if key == listed:
            store.set(name, "new-job")

    def deleted(key: str, **kwargs: Any) -> bool:
        new_job_writes(key)
        return delete(key, **kwargs)

    def compared_and_deleted(key: str, prev: Node, **kwargs: Any) -> bool:
        new_job_writes(key)
        return compare_and_delete(key, prev, **kwargs)

    monkeypatch.setattr(conn, "delete", deleted)
    monkeypatch.setattr(conn, "compare_and_delete", compared_and_deleted)
    report = _deleted(conn, judged)
    assert listed not in report["deleted"], report
    assert store.get(name) == b"new-job"


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_deletion_whose_answer_is_lost_deletes_the_run(
    etcd_server: EtcdServer,
    conn: Transport,
    run_id: str,
    backend: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compare-and-delete of the state is applied but reported refused (its answer
    lost, and etcd's history too old to tell): the state is gone, nobody took the run id,
    so the rest of the run goes as well."""
    judged = _closed_in_advance(capsys, etcd_server, conn, backend, run_id)
    compare_and_delete = conn.compare_and_delete

    def answer_lost(key: str, prev: Node) -> bool:
        compare_and_delete(key, prev)
        return False

    monkeypatch.setattr(conn, "compare_and_delete", answer_lost)
    report = _deleted(conn, judged)
    assert report["skipped"] == [], report
    assert report["deleted"] == [key for key, _ in judged.keys], report
    assert read_run(conn, backend, None, run_id) is None


@pytest.mark.v2_only(reason="over v3 every node keeps a node key; no state age is needed")
def test_a_closed_run_whose_state_looks_old_by_a_member_clock_ahead_is_not_deleted_while_written(
    etcd_server: EtcdServer, conn: Transport, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyTorch's nodes of a closed run still write heartbeats (they keep no key), but
    the member that answers reads the state's TTL with a clock 100 s ahead of the one
    that took the write: the state always looks 100 s old, above the heartbeat
    lifetime. ``delete`` must see for itself that the state stays unchanged for a
    lifetime before it deletes; here it does not, so the run is kept."""
    select = ["--endpoint", etcd_server.get_endpoint(), "--backend", "etcd-v2"]
    code, _, err = run_main(capsys, "close", *select, "--run-id", run_id, "--create")
    assert code == 0, err
    state_key = f"{ETCD_V2_STATE_PREFIX}/{run_id}"
    closed = conn.get(state_key).value
    skewed_ttl = 7200 - 100  # what a member 100 s ahead reports of a fresh two hours
    stop = threading.Event()

    def heartbeats() -> None:  # as a PyTorch node's, every half second
        while not stop.is_set():
            conn.set(state_key, closed, ttl=skewed_ttl)
            stop.wait(0.5)

    conn.set(state_key, closed, ttl=skewed_ttl)
    writer = threading.Thread(target=heartbeats, daemon=True)
    writer.start()
    try:
        lifetime = ["--heartbeat-lifetime", "2"]
        code, out, err = run_main(
            capsys, "delete", *select, *lifetime, "--run-id", run_id, "--yes", "--json"
        )
    finally:
        stop.set()
        writer.join()
    assert code == 0, err
    skipped = json.loads(out)["skipped"]
    assert [s["run_id"] for s in skipped] == [run_id], out
    assert conn.try_get(state_key) is not None


def test_another_programs_key_at_the_root_is_no_finished_run(
    private_etcd_server: EtcdServer, connect: Connect
) -> None:
    """Under the root prefix an ``etcd-v2`` run's state key is its run id alone, as
    PyTorch spells it: etcd's v2 API stores it right below the root (``/<run_id>``), its
    v3 API as it is (``<run_id>``, no ``/``). A key right below the root may thus be a
    run's state over v2 (judged by its value: one that does not decode is no finished
    run), never over v3: there it is another program's, neither listed as a run nor
    taken for a finished one that ``gc`` would collect. A server of its own: the root
    holds every key."""
    conn = connect(endpoint_of(private_etcd_server))
    conn.set("/not-a-run", "another program's value")
    EtcdRendezvousBackend(conn, "root-run", key_prefix=None).announce_node(
        NodeDesc("host", 1, 0), 60
    )
    runs = {summary.run_id: summary for summary in find_runs(conn, ["etcd-v2"], "/")}
    assert "root-run" in runs
    assert not runs["root-run"].finished
    if conn.api == "v2":
        assert runs["not-a-run"].status == "invalid"
        assert not runs["not-a-run"].finished
    else:
        assert "not-a-run" not in runs
