"""The operator commands against a real etcd (on the API under test): ``list``,
``status`` (summary, ``-v``, ``--watch``), ``delete``, ``gc``, ``close`` of an unknown
run, and the connection taken from the ``ETCDCTL_*`` variables."""

from __future__ import annotations

import argparse
import io
import json
import re
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import pytest

from etcd_rendezvous._dynamic.keys import Progress
from etcd_rendezvous._transport.interface import KeyNotFoundError, Transport
from etcd_rendezvous.api import RendezvousClosedError, RendezvousParameters
from etcd_rendezvous.cli._common import (
    UsageError,
    add_endpoint_option,
    connection_options,
    open_connection,
    resolve_connection,
    with_ttl,
)
from etcd_rendezvous.cli._runs import read_run
from etcd_rendezvous.cli.delete import delete_runs
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler, create_rdzv_handler
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import ETCD_V2_STATE_PREFIX, ETCD_V2_STORE_PREFIX, EtcdV2NodesLayout
from support.cli import cli_process, run_cli, run_main
from support.threads import in_threads
from support.wait import wait_until

_T = TypeVar("_T")


def _legacy_run(endpoint: str, prefix: str, run_id: str) -> list[EtcdRendezvousHandler]:
    params = RendezvousParameters(
        backend="etcd",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        etcd_prefix=prefix,
        timeout=60,
        last_call_timeout=1,
        read_timeout=10,
    )
    handlers = [create_rdzv_handler(params) for _ in range(2)]
    infos = in_threads(lambda i: handlers[i].next_rendezvous(), 2)
    assert sorted(info.rank for info in infos) == [0, 1]
    return handlers


def _v2_handler(conn: Transport, prefix: str, run_id: str) -> DynamicRendezvousHandler:
    backend = EtcdRendezvousBackend(conn, run_id, key_prefix=prefix)
    return DynamicRendezvousHandler.from_backend(
        run_id=run_id,
        store=EtcdStore(conn, ETCD_V2_STORE_PREFIX),
        backend=backend,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        timeout=RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=1)),
    )


def _endpoint(server: EtcdServer) -> list[str]:
    return ["--endpoint", server.get_endpoint()]


def test_list_status_and_delete_of_a_legacy_run(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"ops-{uuid.uuid4().hex[:8]}"
    select = [*_endpoint(etcd_server), "--backend", "etcd", "--prefix", etcd_prefix]
    handlers = _legacy_run(etcd_server.get_endpoint(), etcd_prefix, run_id)
    try:
        code, out, err = run_main(capsys, "list", *select, "--json")
        assert code == 0, err
        (summary,) = json.loads(out)
        assert (summary["run_id"], summary["backend"], summary["status"]) == (
            run_id,
            "etcd",
            "final",
        )
        assert (summary["world_size"], summary["live"], summary["finished"]) == (2, 2, False)
        assert summary["api"] == conn.api
        code, out, err = run_main(capsys, "list", *select)
        assert code == 0, err
        assert re.search(rf"^etcd\s+{run_id}\s+{conn.api}\s+final\s+2\s+\S+\s+2\s", out, re.M), out

        run = [*_endpoint(etcd_server), "--prefix", etcd_prefix, "--run-id", run_id]
        # The summary: counts, and no line per member.
        code, out, err = run_main(capsys, "status", *run)
        assert code == 0, err
        assert re.search(r"^keep-alives:\s+2 live, 0 LAPSED$", out, re.M), out
        assert re.search(r"^member keys:\s+2 announced, 2 admitted$", out, re.M), out
        assert "rank 0:" not in out
        # -v: every member, with the host and pid its key names.
        code, out, err = run_main(capsys, "status", *run, "-v")
        assert code == 0, err
        assert re.search(r"^\s+rank 0: live \(expires in \d+ s\)", out, re.M), out
        host = re.escape(socket.gethostname())
        assert len(re.findall(rf"^\s+rank [01]: {host} pid \d+", out, re.M)) == 2, out

        # A live run is not deleted.
        code, out, err = run_main(capsys, "delete", *run, "--yes")
        assert code == 1
        assert "not finished" in err, err
        assert conn.try_get(f"{etcd_prefix}/run_{run_id}") is not None

        # Closed while its workers still run (the first one done closes it while the
        # others are in their exit barrier): still not finished, still not deleted.
        code, _, err = run_main(capsys, "close", *run)
        assert code == 0, err
        code, out, err = run_main(capsys, "list", *select, "--json")
        (summary,) = json.loads(out)
        assert (summary["status"], summary["live"], summary["finished"]) == ("closed", 2, False)
        code, out, err = run_main(capsys, "delete", *run, "--yes")
        assert code == 1
        assert "not finished" in err, err
        code, out, err = run_main(
            capsys, "gc", *select, "--older-than", "0", "--undated", "--yes", "--json"
        )
        assert (code, json.loads(out)["runs"]) == (0, []), err
        assert conn.try_get(f"{etcd_prefix}/run_{run_id}/rdzv/active_version") is not None
    finally:
        for handler in handlers:
            handler.close()

    def finished() -> bool:
        _, out, _ = run_main(capsys, "list", *select, "--json")
        return bool(json.loads(out)[0]["finished"])

    wait_until(finished, what="the workers' keep-alive keys to expire")
    code, out, err = run_main(capsys, "delete", *run, "--dry-run")
    assert code == 0, err
    assert f"{etcd_prefix}/run_{run_id}/ (and all below)" in out
    assert "nothing deleted" in out
    assert conn.try_get(f"{etcd_prefix}/run_{run_id}/rdzv/active_version") is not None
    # No terminal to ask on, and no --yes: refused, nothing deleted.
    code, _, err = run_main(capsys, "delete", *run)
    assert code == 2
    assert "--yes" in err
    assert conn.try_get(f"{etcd_prefix}/run_{run_id}/rdzv/active_version") is not None

    code, out, err = run_main(capsys, "delete", *run, "--yes", "--json")
    assert code == 0, err
    assert json.loads(out)["deleted"] == [f"{etcd_prefix}/run_{run_id}"]
    assert json.loads(out)["skipped"] == []
    assert conn.try_get(f"{etcd_prefix}/run_{run_id}/rdzv/active_version") is None
    assert conn.try_get(f"{etcd_prefix}/run_{run_id}") is None
    code, out, err = run_main(capsys, "list", *select, "--json")
    assert (code, json.loads(out)) == (0, []), err


def test_gc_of_etcd_v2_runs(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    live_id, planned_id = f"gc-live-{uuid.uuid4().hex[:8]}", f"gc-new-{uuid.uuid4().hex[:8]}"
    select = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", etcd_prefix]
    handlers = [_v2_handler(conn, etcd_prefix, live_id) for _ in range(2)]
    try:
        infos = in_threads(lambda i: handlers[i].next_rendezvous(), 2)
        for i, info in enumerate(infos):
            info.store.set(f"from-{i}", b"x")  # keys of the run in the shared store
        # A run closed before any worker came: no heartbeat, so no age.
        code, out, err = run_main(capsys, "close", *select, "--run-id", planned_id, "--create")
        assert (code, "created a closed state" in out) == (0, True), err

        code, out, err = run_main(capsys, "list", *select, "--json")
        assert code == 0, err
        runs = {run["run_id"]: run for run in json.loads(out)}
        assert set(runs) == {live_id, planned_id}
        live = runs[live_id]
        assert (live["status"], live["world_size"], live["version"]) == ("complete", 2, "0")
        assert (live["live"], live["finished"]) == (2, False)
        assert 0 <= live["idle_seconds"] < 30
        assert (runs[planned_id]["status"], runs[planned_id]["finished"]) == ("closed", True)
        assert runs[planned_id]["idle_seconds"] is None

        # Status: a summary, the node keys counted; -v lists them and every rank.
        run = [*select, "--run-id", live_id]
        code, out, err = run_main(capsys, "status", *run)
        assert code == 0, err
        nodes_dir = EtcdV2NodesLayout(live_id, etcd_prefix).nodes_dir
        assert re.search(rf"^node keys:\s+2 in {re.escape(nodes_dir)}$", out, re.M), out
        assert re.search(r"^heartbeats:\s+2, newest", out, re.M), out
        assert "rank 0:" not in out
        code, out, err = run_main(capsys, "status", *run, "-v")
        assert code == 0, err
        assert re.search(r"^\s+rank 1: 127\.0\.0\.1_\d+_\d+$", out, re.M), out
        assert len(re.findall(r"^  127\.0\.0\.1_\d+_\d+$", out, re.M)) == 2, out

        # The live run is never collected; the one closed before it started (undated)
        # only with --undated and --force.
        code, out, err = run_main(capsys, "gc", *select, "--older-than", "0", "--dry-run")
        assert (code, out.strip()) == (0, "nothing to delete"), err
        code, out, err = run_main(
            capsys, "gc", *select, "--older-than", "0", "--undated", "--dry-run", "--json"
        )
        assert (code, json.loads(out)["runs"]) == (0, []), err
        code, out, err = run_main(
            capsys, "gc", *select, "--older-than", "0", "--undated", "--force", "--dry-run"
        )
        assert code == 0, err
        assert f"etcd-v2 run {planned_id!r} (closed, 0 live)" in out, out
        assert live_id not in out, out
    finally:
        for handler in handlers:
            handler._stop_heartbeats()

    code, _, err = run_main(capsys, "close", *select, "--run-id", live_id)
    assert code == 0, err
    code, out, err = run_main(capsys, "list", *select, "--json")
    keys = {r["run_id"]: r["keys"] for r in json.loads(out)}[live_id]
    # Under a prefix other than the default, the shared store's keys are not the run's
    # to delete: another job may use the same run id under the default prefix.
    assert not [k for k in keys if k.startswith(ETCD_V2_STORE_PREFIX)], keys
    assert nodes_dir in keys  # the node keys outlive the heartbeats by their TTL
    store = EtcdStore(conn, ETCD_V2_STORE_PREFIX)

    # Closed, but its heartbeats are recent: its workers may still be leaving.
    code, out, err = run_main(
        capsys, "gc", *select, "--older-than", "0s", "--undated", "--force", "--yes", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert [r["run_id"] for r in report["runs"]] == [planned_id]
    assert report["deleted"] == [f"{etcd_prefix}/{planned_id}"]
    assert conn.try_get(f"{etcd_prefix}/{planned_id}") is None
    assert conn.try_get(f"{etcd_prefix}/{live_id}") is not None

    run = [*select, "--run-id", live_id]
    code, out, err = run_main(capsys, "delete", *run, "--yes")
    assert (code, "not finished" in err) == (1, True), err
    code, out, err = run_main(capsys, "delete", *run, "--yes", "--force")
    assert code == 0, err
    assert "store keys in /torch/elastic/store are left alone" in out, out
    assert conn.try_get(f"{etcd_prefix}/{live_id}") is None
    with pytest.raises(KeyNotFoundError):
        conn.list_dir(nodes_dir)
    assert infos[0].store.get("from-1") == b"x"  # the store keys are left
    del store
    code, out, err = run_main(capsys, "list", *select, "--json")
    assert (code, json.loads(out)) == (0, []), err


def test_an_etcd_v2_run_with_only_its_progress_key_left_is_listed_and_collected(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first node of a run creates the progress key and dies before its state is
    written: the run has no state key and no node key, but the CLI still finds it, and
    deletes (or collects) what is left."""
    select = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", etcd_prefix]
    run_ids = [f"progress-only-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for run_id in run_ids:
        backend = EtcdRendezvousBackend(conn, run_id, key_prefix=etcd_prefix)
        assert backend.create_progress(Progress(0, 0, False, False, 0, 0, 0)) is not None
        assert conn.time_to_live(conn.get(backend.nodes_layout.progress_key)) is not None
    code, out, err = run_main(capsys, "list", *select, "--json")
    assert code == 0, err
    runs = {run["run_id"]: run for run in json.loads(out)}
    assert set(runs) == set(run_ids), runs
    assert all(run["finished"] for run in runs.values()), runs
    first, second = (EtcdV2NodesLayout(run_id, etcd_prefix).nodes_dir for run_id in run_ids)
    assert first in runs[run_ids[0]]["keys"]

    code, out, err = run_main(capsys, "delete", *select, "--run-id", run_ids[0], "--yes")
    assert code == 0, err
    with pytest.raises(KeyNotFoundError):
        conn.list_dir(first)
    code, out, err = run_main(
        capsys, "gc", *select, "--older-than", "0", "--undated", "--yes", "--json"
    )
    assert code == 0, err
    assert [r["run_id"] for r in json.loads(out)["runs"]] == [run_ids[1]], out
    with pytest.raises(KeyNotFoundError):
        conn.list_dir(second)
    code, out, err = run_main(capsys, "list", *select, "--json")
    assert (code, json.loads(out)) == (0, []), err


def test_delete_of_an_etcd_v2_run_under_the_default_prefix_takes_its_store_keys(
    etcd_server: EtcdServer, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"default-{uuid.uuid4().hex[:8]}"
    handlers = [_v2_handler(conn, ETCD_V2_STATE_PREFIX, run_id) for _ in range(2)]
    try:
        infos = in_threads(lambda i: handlers[i].next_rendezvous(), 2)
        for i, info in enumerate(infos):
            info.store.set(f"from-{i}", b"x")
    finally:
        for handler in handlers:
            handler._stop_heartbeats()
    run = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--run-id", run_id]
    code, out, err = run_main(capsys, "delete", *run, "--yes", "--force", "--json")
    assert code == 0, err
    deleted = json.loads(out)["deleted"]
    assert f"{ETCD_V2_STATE_PREFIX}/{run_id}" in deleted
    assert len([k for k in deleted if k.startswith(ETCD_V2_STORE_PREFIX)]) >= 2, deleted
    for key in deleted:
        assert conn.try_get(key) is None, key


@pytest.mark.parametrize("change", ["rewritten", "joining"])
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_run_that_changes_between_judging_and_deleting_is_kept(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    conn: Transport,
    backend: str,
    change: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = f"race-{uuid.uuid4().hex[:8]}"
    args = [*_endpoint(etcd_server), "--backend", backend, "--prefix", etcd_prefix]
    code, _, err = run_main(capsys, "close", *args, "--run-id", run_id, "--create")
    assert code == 0, err
    judged = read_run(conn, backend, etcd_prefix, run_id)
    assert judged is not None
    assert judged.finished
    assert judged.state is not None
    # While the operator reads the prompt, a job takes the run id again.
    current = conn.get(judged.state_key)
    if change == "rewritten":
        conn.compare_and_swap(judged.state_key, current.value or "", current)
    else:  # a joining state, with the TTL workers give it
        conn.compare_and_swap(judged.state_key, current.value or "", current, ttl=600)
    options = argparse.Namespace(dry_run=False, yes=True, json=True, prefix=etcd_prefix)
    out = io.StringIO()
    assert delete_runs(options, conn, [judged], out) == 0
    report = json.loads(out.getvalue())
    assert report["deleted"] == []
    (skipped,) = report["skipped"]
    assert skipped["run_id"] == run_id
    if change == "joining" and backend == "etcd":
        assert "no longer finished" in skipped["reason"]
    else:
        assert "changed" in skipped["reason"]
    assert conn.try_get(judged.state_key) is not None


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_close_refuses_an_unknown_run_unless_told_to_create_it(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    conn: Transport,
    backend: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = f"typo-{uuid.uuid4().hex[:8]}"
    args = [*_endpoint(etcd_server), "--backend", backend, "--prefix", etcd_prefix]
    args += ["--run-id", run_id]
    code, out, err = run_main(capsys, "close", *args)
    assert (code, out) == (1, "")
    assert run_id in err, err
    assert "--create" in err, err
    run_key = f"{etcd_prefix}/run_{run_id}" if backend == "etcd" else f"{etcd_prefix}/{run_id}"
    assert conn.try_get(run_key) is None
    code, out, err = run_main(capsys, "close", *args, "--create")
    assert code == 0, err
    assert "without a TTL" in out, out
    code, out, err = run_main(capsys, "status", *args, "--json")
    assert (code, json.loads(out)["status"]) == (0, "closed"), err
    # Closed in advance for good: no key of it expires (a worker's TTL is 2 hours).
    state_key = f"{run_key}/rdzv/active_version" if backend == "etcd" else run_key
    for key in {run_key, state_key}:
        assert with_ttl(conn, conn.get(key)).ttl is None, key  # type: ignore[union-attr]
    # gc keeps it: it is there to stop the workers that come later.
    select = [*_endpoint(etcd_server), "--backend", backend, "--prefix", etcd_prefix]
    code, out, err = run_main(
        capsys, "gc", *select, "--older-than", "0", "--undated", "--dry-run", "--json"
    )
    assert (code, json.loads(out)["runs"]) == (0, []), err
    # A worker started now stops at once.
    if backend == "etcd":
        params = RendezvousParameters(
            backend="etcd",
            endpoint=etcd_server.get_endpoint(),
            run_id=run_id,
            min_nodes=1,
            max_nodes=1,
            etcd_prefix=etcd_prefix,
            timeout=30,
            read_timeout=10,
        )
        handler: EtcdRendezvousHandler | DynamicRendezvousHandler = create_rdzv_handler(params)
    else:
        handler = _v2_handler(conn, etcd_prefix, run_id)
    try:
        with pytest.raises(RendezvousClosedError):
            handler.next_rendezvous()
    finally:
        if isinstance(handler, EtcdRendezvousHandler):
            handler.close()
    assert json.loads(run_main(capsys, "status", *args, "--json")[1])["status"] == "closed"


def test_status_watch_follows_a_run(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"watch-{uuid.uuid4().hex[:8]}"
    run = [*_endpoint(etcd_server), "--prefix", etcd_prefix, "--run-id", run_id]
    handlers = _legacy_run(etcd_server.get_endpoint(), etcd_prefix, run_id)
    for handler in handlers:
        handler.close()
    # A long interval: the second report must come from the change, not from the clock.
    follow = ["--watch", "--json", "--interval", "60", "--count", "3"]
    with cli_process("status", *run, *follow) as watch:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())
        assert first["status"] == "final"
        code, _, err = run_main(capsys, "close", *run)
        assert code == 0, err
        second = json.loads(watch.stdout.readline())
        assert second["status"] == "closed"
        # --force: the workers' keep-alive keys have not expired yet.
        code, _, err = run_main(capsys, "delete", *run, "--yes", "--force")
        assert code == 0, err
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 1, err  # the run is gone: one line naming it
        assert run_id in err, err
        assert "Traceback" not in err, err


def test_connection_from_etcdctl_variables(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = f"env-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("ETCDCTL_ENDPOINTS", f"http://{etcd_server.get_endpoint()}")
    args = ["--prefix", etcd_prefix, "--run-id", run_id]
    code, out, err = run_main(capsys, "close", *args, "--create", "--backend", "etcd")
    assert code == 0, err
    code, out, err = run_main(capsys, "list", "--backend", "etcd", "--prefix", etcd_prefix)
    assert code == 0, err
    assert run_id in out
    monkeypatch.delenv("ETCDCTL_ENDPOINTS")
    code, out, err = run_main(capsys, "status", *args)
    assert code == 2
    assert "ETCDCTL_ENDPOINTS" in err


@pytest.mark.parametrize(
    ("options", "request_timeout"),
    [
        ([], 5.0),
        (["--read-timeout", "20"], 20.0),
        (["--read-timeout", "30", "--request-timeout", "12"], 12.0),
    ],
)
def test_one_request_may_take_the_read_timeout(
    etcd_server: EtcdServer, options: list[str], request_timeout: float
) -> None:
    # The commands read whole prefixes (and the etcd-v2 store) in one request.
    parser = argparse.ArgumentParser(parents=[connection_options()])
    add_endpoint_option(parser)
    args = parser.parse_args([*_endpoint(etcd_server), *options])
    connection = open_connection(args)
    try:
        assert connection.request_timeout == request_timeout
    finally:
        connection.close()


def _namespace(**given: Any) -> argparse.Namespace:
    options: dict[str, Any] = dict.fromkeys(
        ("endpoint", "protocol", "cacert", "cert", "key", "username", "password"), None
    )
    options["password_prompt"] = False
    return argparse.Namespace(**{**options, **given})


def test_etcdctl_variables_and_the_password_prompt() -> None:
    asked: list[str] = []

    def ask(prompt: str) -> str:
        asked.append(prompt)
        return "typed"

    env = {
        "ETCDCTL_ENDPOINTS": "https://a:2379,https://b:2379/",
        "ETCDCTL_CACERT": "/ca.pem",
        "ETCDCTL_USER": "root:secret",
    }
    args = _namespace(cert="/mine.pem")
    resolve_connection(args, env, ask)
    assert (args.endpoint, args.protocol, args.cacert, args.cert) == (
        "a:2379,b:2379",
        "https",
        "/ca.pem",
        "/mine.pem",
    )
    assert (args.username, args.password, asked) == ("root", "secret", [])

    # A flag wins over the variable; --password-prompt asks.
    args = _namespace(endpoint="c:1", username="alice", password_prompt=True)
    resolve_connection(args, {"ETCDCTL_ENDPOINTS": "d:2", "ETCDCTL_USER": "bob"}, ask)
    assert (args.endpoint, args.protocol, args.username, args.password) == (
        "c:1",
        None,
        "alice",
        "typed",
    )
    assert asked == ["Password for etcd user alice: "]

    with pytest.raises(UsageError, match="ETCDCTL_ENDPOINTS"):
        resolve_connection(_namespace(), {}, ask)
    with pytest.raises(UsageError, match="mixes"):
        resolve_connection(_namespace(endpoint="http://a:1,https://b:2"), {}, ask)
    with pytest.raises(UsageError, match="user name"):
        resolve_connection(_namespace(endpoint="a:1", password_prompt=True), {}, ask)


@pytest.mark.parametrize(
    "command",
    [["list"], ["gc", "--older-than", "1d", "--dry-run"], ["delete", "--run-id", "r1", "--yes"]],
)
def test_unreachable_etcd_is_one_clear_line(command: list[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    options = ["--endpoint", endpoint, "--read-timeout", "1"]
    result = run_cli(*command, *options, timeout=60)
    assert result.returncode == 1, result.stderr
    assert endpoint in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_status_watch_of_an_etcd_v2_run_wakes_on_its_change(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"watch-v2-{uuid.uuid4().hex[:8]}"
    run = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", etcd_prefix]
    run += ["--run-id", run_id]
    code, _, err = run_main(capsys, "close", *run, "--create")
    assert code == 0, err
    follow = ["--watch", "--json", "--interval", "60", "--count", "2"]
    with cli_process("status", *run, *follow) as watch:
        assert watch.stdout is not None
        assert json.loads(watch.stdout.readline())["status"] == "closed"
        code, _, err = run_main(capsys, "delete", *run, "--yes")
        assert code == 0, err
        # Well before the 60 s interval: the deletion woke the watch.
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 1, err
        assert f"{etcd_prefix}/{run_id}" in err, err


@pytest.mark.v2_only(reason="the v2 API carries a key in the URL's path")
@pytest.mark.parametrize(
    "alias",
    [
        pytest.param(lambda run_id: run_id + "?", id="query"),
        pytest.param(lambda run_id: run_id + "#x", id="fragment"),
        pytest.param(lambda run_id: run_id.replace("-", "%2D"), id="escape"),
    ],
)
def test_a_run_id_that_a_v2_url_spells_as_another_run_is_refused(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    conn: Transport,
    alias: Callable[[str], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Over the v2 API a key is the path of a URL: ``<run id>?`` names the state key of
    run ``<run id>`` (the rest is a query; ``%2D`` would be decoded to ``-``), so
    ``delete`` would judge that run by the node keys of another (none) and delete its
    state while a node of it is live. The run id is refused, naming ``--run-id``, and
    nothing is deleted."""
    victim = f"victim-{uuid.uuid4().hex[:8]}"
    args = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", etcd_prefix]
    code, _, err = run_main(capsys, "close", *args, "--run-id", victim, "--create")
    assert code == 0, err
    node_key = EtcdV2NodesLayout(victim, etcd_prefix).node_key("10.0.0.9", 1, 0)
    conn.set(node_key, json.dumps({"addr": "10.0.0.9", "pid": 1, "local_id": 0}), ttl=120)
    code, _, err = run_main(capsys, "delete", *args, "--run-id", victim, "--yes")
    assert code == 1, err  # the run itself: live, kept
    assert "1 node key(s)" in err, err
    for command in ("delete", "status", "close"):
        extra = ["--yes"] if command == "delete" else []
        code, out, err = run_main(capsys, command, *args, "--run-id", alias(victim), *extra)
        assert code == 2, (command, out, err)
        assert f"--run-id {alias(victim)!r}" in err, err
    assert conn.try_get(f"{etcd_prefix}/{victim}") is not None
    assert conn.try_get(node_key) is not None


@pytest.mark.v2_only(reason="the v2 API carries a key in the URL's path")
@pytest.mark.parametrize("run_id", [".", "..", "%2E%2E", "50%"])
def test_a_run_id_that_a_v2_url_resolves_to_a_directory_is_refused(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    run_id: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``.`` and ``..`` are path segments of a v2 URL (``%2E%2E`` too, once decoded):
    the state key of run ``..`` is the directory above the prefix, its nodes directory
    the one above that prefix's nodes directories; a ``%`` starts an escape. Refused,
    naming ``--run-id``, before anything is read."""
    args = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", etcd_prefix]
    code, out, err = run_main(capsys, "delete", *args, "--run-id", run_id, "--force", "--yes")
    assert code == 2, (out, err)
    assert f"--run-id {run_id!r}" in err, err


@pytest.mark.v2_only(reason="the v2 API carries a key in the URL's path")
@pytest.mark.parametrize("command", ["list", "status", "delete"])
@pytest.mark.parametrize("prefix", ["/a?b", "/a#b", "/a%2Fb", "/a/../b"])
def test_a_prefix_that_a_v2_url_spells_as_another_key_is_refused(
    etcd_server: EtcdServer, command: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``--prefix`` that a URL of the v2 API turns into another key is refused as a
    usage error naming ``--prefix``, as a ``--run-id`` is; it raised the transport's
    ``ValueError`` (a traceback, exit status 1)."""
    args = [*_endpoint(etcd_server), "--backend", "etcd-v2", "--prefix", prefix]
    extra = {"list": [], "status": ["--run-id", "r"], "delete": ["--run-id", "r", "--yes"]}
    code, out, err = run_main(capsys, command, *args, *extra[command])
    assert code == 2, (out, err)
    assert f"--prefix {prefix!r}" in err, err
