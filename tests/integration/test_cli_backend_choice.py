"""The operator commands' rough edges: ``status``, ``close`` and ``delete`` find a run
under either backend when ``--backend`` is absent (and refuse to guess when both hold
one), ``server --port`` and ``--listen``, and ``list --help`` saying what its columns mean."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousConnectionError
from etcd_rendezvous.etcd_server import EtcdServer
from support.cli import run_cli, run_main
from support.net import closed_port


def _run(server: EtcdServer, prefix: str, run_id: str, *extra: str) -> list[str]:
    return ["--endpoint", server.get_endpoint(), "--prefix", prefix, "--run-id", run_id, *extra]


def test_status_close_and_delete_find_an_etcd_v2_run_without_backend(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"v2only-{uuid.uuid4().hex[:8]}"
    args = _run(etcd_server, etcd_prefix, run_id)
    code, out, err = run_main(capsys, "close", *args, "--create", "--backend", "etcd-v2")
    assert code == 0, err
    key = f"{etcd_prefix}/{run_id}"
    assert conn.try_get(key) is not None

    code, out, err = run_main(capsys, "status", *args, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["backend"], report["status"], report["key"]) == ("etcd-v2", "closed", key)
    code, out, err = run_main(capsys, "close", *args)
    assert code == 0, err
    assert f"already closed (etcd-v2 key {key})" in out, out
    code, out, err = run_main(capsys, "delete", *args, "--yes")
    assert code == 0, err
    assert conn.try_get(key) is None


def test_a_run_under_both_backends_is_not_guessed(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"both-{uuid.uuid4().hex[:8]}"
    args = _run(etcd_server, etcd_prefix, run_id)
    for backend in ("etcd", "etcd-v2"):
        code, _, err = run_main(capsys, "close", *args, "--create", "--backend", backend)
        assert code == 0, err
    legacy, v2 = f"{etcd_prefix}/run_{run_id}", f"{etcd_prefix}/{run_id}"
    for command in (["status"], ["close"], ["delete", "--yes"]):
        code, out, err = run_main(capsys, *command, *args)
        assert (code, out) == (1, ""), (command, out, err)
        assert "both backends" in err, err
        assert legacy in err, err
        assert v2 in err, err
        assert "--backend" in err, err
    assert conn.try_get(legacy) is not None
    assert conn.try_get(v2) is not None
    # --backend chooses.
    code, out, err = run_main(capsys, "status", *args, "--backend", "etcd-v2", "--json")
    assert (code, json.loads(out)["backend"]) == (0, "etcd-v2"), err


def test_an_unknown_run_names_both_backends_keys(
    etcd_server: EtcdServer, etcd_prefix: str, conn: Transport, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"nobody-{uuid.uuid4().hex[:8]}"
    args = _run(etcd_server, etcd_prefix, run_id)
    for command in ("status", "close", "delete"):
        code, out, err = run_main(capsys, command, *args)
        assert (code, out) == (1, ""), (command, err)
        assert f"{etcd_prefix}/run_{run_id}" in err, err
        assert f"{etcd_prefix}/{run_id}" in err, err
        assert len(err.strip().splitlines()) == 1, err
    # Closing in advance needs to know which backend's keys to write.
    code, out, err = run_main(capsys, "close", *args, "--create")
    assert code == 2, err
    assert "--create needs --backend" in err, err
    assert conn.try_get(f"{etcd_prefix}/run_{run_id}") is None
    assert conn.try_get(f"{etcd_prefix}/{run_id}") is None


@contextlib.contextmanager
def _server(env: dict[str, str], *args: str) -> Iterator[list[str]]:
    """``etcd-rendezvous server ARGS`` running; yields the lines it printed up to its
    'Press Ctrl-C' line; stopped with SIGTERM after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "etcd_rendezvous", "server", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or not lines[-1].startswith("Press Ctrl-C"):
            line = proc.stdout.readline()
            assert line, (lines, proc.stderr.read() if proc.stderr else "")
            lines.append(line)
        yield lines
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _serves(host: str, port: int) -> bool:
    with open_transport([(host, port)], etcd_api="auto") as served:
        served.set(f"/port-test/{host}", "here")
        return served.get(f"/port-test/{host}").value == "here"


@pytest.mark.slow
def test_server_serves_on_the_port_asked_for(etcd_server: EtcdServer, tmp_path: Path) -> None:
    port = closed_port()
    env = dict(os.environ, ETCD_BINARY_PATH=etcd_server.binary, TMPDIR=str(tmp_path))
    with _server(env, "--port", str(port)) as printed:
        assert f"serving 127.0.0.1:{port} " in printed[0], printed
        assert _serves("127.0.0.1", port)
        # The port is taken now: a second server says so, naming it.
        taken = run_cli("server", "--port", str(port), env=env, timeout=120)
        assert taken.returncode == 1, taken
        assert f"port {port}" in taken.stderr, taken.stderr
        assert "Traceback" not in taken.stderr, taken.stderr


@pytest.mark.slow
def test_server_listens_on_the_address_asked_for_too(
    etcd_server: EtcdServer, tmp_path: Path
) -> None:
    # 127.0.0.2 is another address of this machine (all of 127/8 is loopback), on which
    # a server of loopback only is not reachable.
    port = closed_port()
    env = dict(os.environ, ETCD_BINARY_PATH=etcd_server.binary, TMPDIR=str(tmp_path))
    with _server(env, "--port", str(port)), pytest.raises(RendezvousConnectionError):
        _serves("127.0.0.2", port)
    port = closed_port()
    with _server(env, "--port", str(port), "--listen", "127.0.0.2") as printed:
        assert any(
            line.startswith("also listening on 127.0.0.2") and "no TLS nor auth" in line
            for line in printed
        ), printed
        assert _serves("127.0.0.2", port)
        assert _serves("127.0.0.1", port)


def test_server_port_is_checked_before_etcd_starts() -> None:
    for bad in ("0", "70000"):
        result = run_cli("server", "--port", bad)
        assert result.returncode == 2, result
        assert "--port" in result.stderr, result.stderr
    result = run_cli("server", "--port", "2379", "--members", "3")
    assert result.returncode == 2, result
    assert "--port is for a single member" in result.stderr, result.stderr
    for bad in ("localhost", "::1", "300.1.1.1"):
        result = run_cli("server", "--listen", bad)
        assert result.returncode == 2, result
        assert f"--listen: expected an IPv4 address such as 0.0.0.0, got {bad!r}" in (
            result.stderr
        ), result.stderr


def test_list_help_says_what_its_columns_mean() -> None:
    result = run_cli("list", "--help")
    assert result.returncode == 0, result.stderr
    for column in ("STATUS", "WORLD", "VERSION", "LIVE", "IDLE", "DONE"):
        assert f"\n  {column} " in result.stdout, (column, result.stdout)
    assert "etcd-v2 state keeps only the nodes still" in result.stdout
