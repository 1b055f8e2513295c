"""One etcd member process: what :class:`EtcdServer` runs once and :class:`EtcdCluster` N times.

A :class:`Member` builds its command line, starts etcd with its output appended to a
log, waits until it is ready (telling a port taken by another process from any other
failure), and stops, kills, suspends and resumes it. Its errors are the public
:class:`~etcd_rendezvous.etcd_server.EtcdServerError` and
:class:`~etcd_rendezvous.etcd_server.EtcdServerTimeoutError`, defined here (below both
owners) and exported by :mod:`etcd_rendezvous.etcd_server`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import urllib3

from .etcd import (
    ADDRESS_IN_USE,
    HOST,
    ProbeTimeoutError,
    ProcessExitedError,
    continue_process,
    has_v2_api,
    last_lines,
    member_status,
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
    "DATA_NAME",
    "LOG_NAME",
    "LOG_TAIL_LINES",
    "EtcdServerError",
    "EtcdServerTimeoutError",
    "Leftovers",
    "Member",
    "Program",
    "Stderr",
    "Tls",
    "clean_up",
    "discard",
]

logger = logging.getLogger(__name__)

#: Names of etcd's data dir and of the file capturing its output, in a member's directory.
DATA_NAME = "data"
LOG_NAME = "etcd.log"
#: How many lines of etcd's log an error message shows.
LOG_TAIL_LINES = 40
# What ``read_log`` keeps in memory once the log file has been removed.
_LOG_SNAPSHOT_BYTES = 1 << 20

#: Where etcd's stderr goes: ``None`` for its log, else as ``subprocess.Popen`` takes it.
Stderr = int | IO[Any] | None


@dataclass(frozen=True)
class Program:
    """The etcd binary to run, whether it serves the v2 API, and the caller's extra flags."""

    binary: str
    enable_v2: bool
    extra_args: tuple[str, ...]

    @classmethod
    def of(cls, binary: str, enable_v2: bool | None, extra_args: Sequence[str]) -> Program:
        """``enable_v2=None`` means: serve v2 if the binary has it (etcd before 3.6)."""
        v2 = has_v2_api(binary) if enable_v2 is None else enable_v2
        return cls(binary, v2, tuple(extra_args))

    def removed_flag_problem(self) -> str | None:
        """Why the binary would refuse a flag it no longer has; ``None`` if it would not."""
        return removed_flag_problem(self.binary, [*v2_flags(self.enable_v2), *self.extra_args])


class EtcdServerError(RuntimeError):
    """The local etcd server could not be found, started or controlled."""


class EtcdServerTimeoutError(EtcdServerError, TimeoutError):
    """etcd did not answer within the start timeout."""


# Public through etcd_server, and named after it (pickles, reprs, the API docs).
EtcdServerError.__module__ = EtcdServerTimeoutError.__module__ = "etcd_rendezvous.etcd_server"


@dataclass(frozen=True)
class Tls:
    """TLS of a member: the server's certificate and CA, and what its own probes present.

    Raises:
        ValueError: if ``cert_file`` and ``key_file`` are not given together, or
            ``client_cert_auth`` lacks one of them or ``trusted_ca_file``.
    """

    cert_file: str | None = None
    key_file: str | None = None
    trusted_ca_file: str | None = None
    client_cert_auth: bool = False
    client_cert_file: str | None = None
    client_key_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if self.client_cert_auth and (self.cert_file is None or self.trusted_ca_file is None):
            raise ValueError("client_cert_auth needs cert_file, key_file and trusted_ca_file")

    @property
    def protocol(self) -> str:
        """``"https"`` with a certificate, else ``"http"``."""
        return "https" if self.cert_file else "http"

    def server_flags(self) -> list[str]:
        """etcd's TLS flags."""
        flags = []
        if self.cert_file and self.key_file:
            flags += [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.trusted_ca_file:
            flags.append(f"--trusted-ca-file={self.trusted_ca_file}")
        if self.client_cert_auth:
            flags.append("--client-cert-auth=true")
        return flags

    def pool(self) -> urllib3.PoolManager:
        """A connection pool that verifies the server and presents the client certificate."""
        if self.protocol == "http":
            return urllib3.PoolManager(retries=False)
        kwargs: dict[str, Any] = {"retries": False}
        if self.trusted_ca_file:
            kwargs.update(cert_reqs="CERT_REQUIRED", ca_certs=self.trusted_ca_file)
        else:
            kwargs.update(cert_reqs="CERT_NONE", assert_hostname=False)
        if self.client_cert_file and self.client_key_file:
            kwargs.update(cert_file=self.client_cert_file, key_file=self.client_key_file)
        return urllib3.PoolManager(**kwargs)


class Leftovers:
    """What the interpreter-exit safety net cleans up; refers to no server or cluster."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.base_dir: str | None = None
        self.owns_base_dir = True


def clean_up(leftovers: Leftovers) -> None:
    """Safety net run by ``weakref.finalize`` for a server or cluster never stopped."""
    for proc in leftovers.procs.values():
        terminate(proc, grace=2.0)
    leftovers.procs.clear()
    if leftovers.base_dir is not None and leftovers.owns_base_dir:
        shutil.rmtree(leftovers.base_dir, ignore_errors=True)
    leftovers.base_dir = None


def discard(leftovers: Leftovers, members: Iterable[Member]) -> None:
    """Stop the ``members``, keep their logs' text, and remove the directory if owned."""
    for member in members:
        member.stop(grace=2.0)
        member.retire()
    clean_up(leftovers)


class Member:
    """One etcd process on a loopback client port, with its data and log in ``directory``.

    ``flags`` follow the ones every member has (name, data dir, client URLs, v2, TLS),
    and the program's ``extra_args`` come last; ``label`` starts the member's error
    messages (``"etcd"``, ``"etcd member m0"``).
    """

    def __init__(
        self,
        *,
        program: Program,
        name: str,
        label: str,
        directory: str,
        port: int,
        flags: Sequence[str],
        leftovers: Leftovers,
        tls: Tls | None = None,
        listen: str = HOST,
    ) -> None:
        self.program = program
        self.name = name
        self.label = label
        self.directory = directory
        #: The client port; the owner may move a member that is not running.
        self.port = port
        self._flags = list(flags)
        self._leftovers = leftovers
        self._tls = tls or Tls()
        #: The address clients may reach it on besides loopback (``HOST``: loopback only).
        self._listen = listen
        self._lock = threading.RLock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._command: list[str] = []
        self._log_offset = 0
        self._stderr_redirected = False
        self._suspended = False
        self._log_snapshot: str | None = None
        #: etcd's version from ``GET /version``, once it has answered.
        self.version: str | None = None

    @property
    def client_url(self) -> str:
        """The client URL, e.g. ``"http://127.0.0.1:PORT"``."""
        return f"{self._tls.protocol}://{HOST}:{self.port}"

    @property
    def data_dir(self) -> str:
        """etcd's ``--data-dir``."""
        return os.path.join(self.directory, DATA_NAME)

    @property
    def log_path(self) -> str:
        """The file capturing etcd's output."""
        return os.path.join(self.directory, LOG_NAME)

    @property
    def started(self) -> bool:
        """Whether a process was launched and not retired since (it may have exited)."""
        return self._proc is not None

    @property
    def pid(self) -> int:
        """Process id of the current (or last) process."""
        return self._require_proc().pid

    @property
    def returncode(self) -> int | None:
        """The exit code of the last process, or ``None`` while it runs or before any."""
        return None if self._proc is None else self._proc.poll()

    @property
    def running(self) -> bool:
        """Whether the process is alive (a suspended process counts as alive)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def suspended(self) -> bool:
        """Whether :meth:`suspend` was called without a matching :meth:`resume`."""
        return self._suspended

    def command(self) -> list[str]:
        """etcd's command line for the current port."""
        url = self.client_url
        listen, advertise = url, url
        if self._listen != HOST:
            # Loopback too (this object probes it there), and every address for 0.0.0.0.
            other = f"{self._tls.protocol}://{self._listen}:{self.port}"
            listen = other if self._listen == "0.0.0.0" else f"{url},{other}"
            advertise = url if self._listen == "0.0.0.0" else f"{url},{other}"
        return [
            self.program.binary,
            *v2_flags(self.program.enable_v2),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={listen}",
            f"--advertise-client-urls={advertise}",
            *self._tls.server_flags(),
            *self._flags,
            *self.program.extra_args,
        ]

    def read_log(self, tail: int | None = None) -> str:
        """etcd's output so far (its last ``tail`` lines if given), kept after :meth:`retire`."""
        text = read_log_from(self.log_path) or self._log_snapshot or ""
        return text if tail is None else last_lines(text, tail)

    # -- lifecycle -------------------------------------------------------------------

    def launch(self, attempt: int, stderr: Stderr = None) -> None:
        """Start etcd, appending its output to the log; does not wait for it."""
        with self._lock:
            os.makedirs(self.directory, exist_ok=True)
            self._command = self.command()
            logger.debug("starting %s (attempt %d): %s", self.label, attempt, self._command)
            with open(self.log_path, "ab") as log:
                log.write(
                    f"=== etcd-rendezvous: attempt {attempt}: {' '.join(self._command)}\n".encode()
                )
                log.flush()
                self._log_offset = log.tell()
                self._proc = subprocess.Popen(
                    self._command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT if stderr is None else stderr,
                    close_fds=True,
                )
            self._leftovers.procs[self.name] = self._proc
            self._stderr_redirected = stderr is not None
            self._suspended = False

    def await_ready(self, deadline: float) -> bool:
        """Wait until etcd serves requests with a leader (see :func:`.etcd.probe_member`).

        Returns ``False`` if it exited because a port was taken (the caller may try
        again), ``True`` once it serves. A process that is not ready by the monotonic
        ``deadline`` is left running.

        Raises:
            EtcdServerError: if etcd exited for another reason (the message has the
                flag it refused, or its log's tail).
            EtcdServerTimeoutError: if ``deadline`` passes first.
        """
        proc = self._require_proc()
        pool = self._tls.pool()
        try:
            self.version = wait_ready(
                proc,
                deadline,
                lambda timeout: probe_member(
                    pool, self.client_url, self.name, timeout, self.program.enable_v2
                ),
            )
        except ProcessExitedError:
            output = read_log_from(self.log_path, self._log_offset)
            # Without etcd's stderr a port race cannot be told from other failures.
            if self._stderr_redirected or ADDRESS_IN_USE.search(output):
                logger.info("%s could not bind its ports; trying again", self.label)
                return False
            refused = unknown_flag_problem(self.program.binary, output)
            if refused:
                raise EtcdServerError(f"{refused}; command: {self._command}") from None
            raise EtcdServerError(
                f"{self.label} exited with code {proc.returncode} during start-up "
                f"(command: {self._command}). Last lines of {self.log_path}:\n"
                f"{last_lines(output, LOG_TAIL_LINES)}"
            ) from None
        except ProbeTimeoutError as exc:
            output = read_log_from(self.log_path, self._log_offset)
            raise EtcdServerTimeoutError(
                f"{self.label} at {self.client_url} was not ready in time ({exc}; command: "
                f"{self._command}). Last lines of {self.log_path}:\n"
                f"{last_lines(output, LOG_TAIL_LINES)}"
            ) from None
        finally:
            pool.clear()
        return True

    def restart(self, timeout: float, num_retries: int, wait: bool = True) -> None:
        """Stop etcd if it runs and start it again on the same ports with the same data.

        Tries ``num_retries`` times while another process holds a port; ``wait=False``
        returns once the process is started.

        Raises:
            EtcdServerError: if the ports stay taken, or etcd fails otherwise.
            EtcdServerTimeoutError: if etcd is not ready within ``timeout``.
        """
        with self._lock:
            self.stop()
            if not wait:
                self.launch(attempt=1)
                return
            deadline = time.monotonic() + timeout
            attempts = max(1, num_retries)
            for attempt in range(1, attempts + 1):
                self.launch(attempt)
                if self.await_ready(deadline):
                    return
                # Whoever holds our port may let go: wait a little, on a deadline.
                time.sleep(min(0.05 * attempt, max(0.0, deadline - time.monotonic())))
            raise EtcdServerError(
                f"{self.label} could not bind port {self.port} (or another of its ports) "
                f"again in {attempts} attempts"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM etcd, SIGKILL it after ``grace`` seconds; a no-op if it is not running."""
        with self._lock:
            if self._proc is not None:
                terminate(self._proc, grace)
            self._suspended = False

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data, to simulate a crash."""
        with self._lock:
            proc = self._require_proc()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self._suspended = False

    def suspend(self) -> None:
        """SIGSTOP etcd and return once the kernel has stopped it."""
        with self._lock:
            stop_process(self._require_alive().pid)
            self._suspended = True

    def resume(self) -> None:
        """SIGCONT etcd after :meth:`suspend`."""
        with self._lock:
            continue_process(self._require_alive().pid)
            self._suspended = False

    def retire(self) -> None:
        """Forget the (stopped) process, keeping the log's text: its files are to go."""
        with self._lock:
            log = read_log_from(self.log_path)
            if log:
                self._log_snapshot = log[-_LOG_SNAPSHOT_BYTES:]
            self._leftovers.procs.pop(self.name, None)
            self._proc = None
            self._suspended = False

    def status(self, pool: urllib3.PoolManager, timeout: float) -> tuple[str, str | None, int]:
        """``(member id, leader id or None, raft term)``; see :func:`.etcd.member_status`."""
        return member_status(pool, self.client_url, urllib3.Timeout(timeout))

    def _require_proc(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None:
            raise EtcdServerError(f"{self.label} has not been started")
        return proc

    def _require_alive(self) -> subprocess.Popen[bytes]:
        proc = self._require_proc()
        if proc.poll() is not None:
            raise EtcdServerError(
                f"{self.label} (pid {proc.pid}) has exited with code {proc.returncode}"
            )
        return proc
