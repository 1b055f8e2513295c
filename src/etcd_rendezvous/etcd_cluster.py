"""A throw-away multi-member etcd cluster on loopback, for failover tests and demos.

:class:`EtcdCluster` runs ``size`` etcd processes (3 by default) that form one cluster
on 127.0.0.1, each on its own free client and peer port, in a temporary directory that
:meth:`EtcdCluster.stop` removes. Each member (:class:`EtcdClusterMember`) can be
killed, suspended, stopped and restarted on its own, which is how tests take the
leader away or lose the quorum::

    with EtcdCluster() as cluster:
        endpoints = cluster.endpoints        # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        old = cluster.kill_leader()
        new = cluster.wait_for_leader(timeout=30)

The members find each other through explicit loopback peer URLs on ports chosen
free, never etcd's default 2380, so clusters and
:class:`~etcd_rendezvous.etcd_server.EtcdServer` instances can run side by side. The
leader is found through ``POST /v3/maintenance/status``, which every etcd since 3.4
serves with or without the v2 API.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from types import TracebackType

import urllib3

from ._process.etcd import HOST, NotReadyError, free_ports
from ._process.member import (
    DATA_NAME,
    EtcdServerError,
    EtcdServerTimeoutError,
    Leftovers,
    Member,
    Program,
    clean_up,
    discard,
)
from .etcd_server import find_etcd_binary

__all__ = ["EtcdCluster", "EtcdClusterMember"]

logger = logging.getLogger(__name__)

# etcd's defaults are 100 ms and 1 s; shorter makes a lost leader replaced in about a
# second. Five heartbeats per election timeout is the ratio etcd recommends.
_TIMING_ARGS = ("--heartbeat-interval=50", "--election-timeout=500")


class EtcdClusterMember:
    """One member of an :class:`EtcdCluster`: an etcd process with its own data and log.

    Made by :class:`EtcdCluster`, not directly. Its client and peer ports stay the
    same for the life of the cluster, so :meth:`restart` brings it back where clients
    expect it.
    """

    def __init__(self, member: Member, index: int, peer_port: int) -> None:
        self._member = member
        self._index = index
        self._peer_port = peer_port

    # -- where it is -----------------------------------------------------------------

    @property
    def index(self) -> int:
        """Position of this member in :attr:`EtcdCluster.members`."""
        return self._index

    @property
    def name(self) -> str:
        """etcd's ``--name`` of this member (unique to this cluster)."""
        return self._member.name

    @property
    def host(self) -> str:
        """The host the member listens on (always ``127.0.0.1``)."""
        return HOST

    @property
    def port(self) -> int:
        """The member's client port."""
        return self._member.port

    @property
    def peer_port(self) -> int:
        """The port the member talks raft on with the other members."""
        return self._peer_port

    @property
    def endpoint(self) -> str:
        """The client endpoint as ``"127.0.0.1:PORT"``."""
        return f"{HOST}:{self.port}"

    @property
    def client_url(self) -> str:
        """The client URL, e.g. ``"http://127.0.0.1:PORT"``."""
        return self._member.client_url

    @property
    def version(self) -> str | None:
        """etcd's version from ``GET /version``, once the member has answered."""
        return self._member.version

    @property
    def data_dir(self) -> str:
        """The member's ``--data-dir`` (removed by :meth:`EtcdCluster.stop`)."""
        return self._member.data_dir

    @property
    def log_path(self) -> str:
        """The file capturing the member's output (removed by :meth:`EtcdCluster.stop`)."""
        return self._member.log_path

    def read_log(self, tail: int | None = None) -> str:
        """Return the member's output so far (its last ``tail`` lines if given).

        After :meth:`EtcdCluster.stop` this is what the log held when it was removed.
        """
        return self._member.read_log(tail)

    # -- process state ---------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Process id of the current (or last) etcd process of this member.

        Raises:
            EtcdServerError: if the member was never started.
        """
        return self._member.pid

    @property
    def running(self) -> bool:
        """Whether the member's process is alive (a suspended process counts as alive)."""
        return self._member.running

    @property
    def suspended(self) -> bool:
        """Whether :meth:`suspend` was called without a matching :meth:`resume`."""
        return self._member.suspended

    def kill(self) -> None:
        """SIGKILL the member, keeping its data, to simulate a crash.

        :meth:`restart` brings it back on the same ports with the same data.
        """
        self._member.kill()

    def suspend(self) -> None:
        """SIGSTOP the member: it keeps its ports but stops answering, like a hung host.

        Returns once the process is stopped (not merely signalled).
        """
        self._member.suspend()

    def resume(self) -> None:
        """SIGCONT the member after :meth:`suspend`."""
        self._member.resume()

    def stop(self, grace: float = 10.0) -> None:
        """Stop the member gracefully (SIGTERM, SIGKILL after ``grace`` s), keeping its data.

        A no-op if it is not running; :meth:`restart` brings it back.
        """
        self._member.stop(grace)

    def restart(self, timeout: float = 60, num_retries: int = 10, wait: bool = True) -> None:
        """Stop the member if it runs, start it again with the same data and ports.

        Works after :meth:`kill` and :meth:`stop`. Waits until the member knows a
        leader and serves requests, which needs a quorum of members running: to bring
        back a cluster that lost its quorum, restart members with ``wait=False`` and
        then call :meth:`EtcdCluster.wait_for_leader`.

        Args:
            timeout: seconds to wait for the member to be ready, in total.
            num_retries: attempts to bind its ports again if another process holds one.
            wait: wait for the member to be ready; ``False`` returns once the process
                is started (a taken port then shows only in the log).

        Raises:
            EtcdServerError: if the cluster is stopped, or the ports stay taken.
            EtcdServerTimeoutError: if the member is not ready within ``timeout``; the
                process is left running (:meth:`EtcdCluster.stop` stops it).
        """
        # The cluster retires its members when it stops or replaces them.
        if not self._member.started:
            raise EtcdServerError(
                f"etcd member {self.name} belongs to a stopped cluster; start the "
                "cluster again and use its new members"
            )
        self._member.restart(timeout, num_retries, wait)

    def __repr__(self) -> str:
        state = "suspended" if self.suspended else "running" if self.running else "not running"
        return f"<EtcdClusterMember {self.name} {self.client_url} {state}>"


class EtcdCluster:
    """``size`` etcd members forming one cluster on 127.0.0.1, by default with the v2 API.

    Usable as a context manager (``with EtcdCluster() as cluster: ...``). The cluster
    runs in a temporary directory (member ``i``'s data in ``m<i>/data``, its output
    in ``m<i>/etcd.log``) that :meth:`stop` removes. A cluster that is never stopped
    is killed when it is garbage-collected or at interpreter exit, but that safety
    net is no substitute for :meth:`stop`.

    Args:
        size: number of members; 3 tolerates the loss of one.
        etcd_binary: the etcd binary; see
            :func:`~etcd_rendezvous.etcd_server.find_etcd_binary` for the fallbacks.
        enable_v2: serve etcd's v2 API (``--enable-v2=true``) on every member.
            ``False`` leaves the flag out: the members serve the v3 API only, like
            etcd 3.6. ``None`` (the default): ``True`` for etcd before 3.6, ``False``
            for 3.6 and later, which have no v2 API (:meth:`start` refuses ``True``
            with them, naming the flag).
        extra_args: more command-line arguments for every member, appended last
            (they may override the short ``--heartbeat-interval=50`` and
            ``--election-timeout=500`` the cluster uses).

    Raises:
        EtcdBinaryNotFoundError: if no etcd binary can be found.
        ValueError: if ``size`` is less than 1.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        etcd_binary: str | None = None,
        enable_v2: bool | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of arguments, not a string")
        self._size = size
        self._program = Program.of(find_etcd_binary(etcd_binary), enable_v2, extra_args)
        self._name = f"etcd-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._leftovers = Leftovers()
        self._finalizer = weakref.finalize(self, clean_up, self._leftovers)
        self._members: list[EtcdClusterMember] = []

    # -- what it is ------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of members."""
        return self._size

    @property
    def binary(self) -> str:
        """Path of the etcd binary the members run."""
        return self._program.binary

    @property
    def enable_v2(self) -> bool:
        """Whether the members serve etcd's v2 API (the ``enable_v2`` argument)."""
        return self._program.enable_v2

    @property
    def name(self) -> str:
        """Prefix of the member names, unique to this cluster (e.g. ``etcd-1a2b3c4d``)."""
        return self._name

    @property
    def members(self) -> tuple[EtcdClusterMember, ...]:
        """The members in order; empty before the first :meth:`start`."""
        return tuple(self._members)

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, ``"127.0.0.1:P1,127.0.0.1:P2,..."``.

        The form of a rendezvous ``endpoint`` parameter and of ``torchrun
        --rdzv-endpoint``. Empty before the first :meth:`start`.
        """
        return ",".join(member.endpoint for member in self._members)

    def get_endpoints(self) -> str:
        """Return :attr:`endpoints`."""
        return self.endpoints

    @property
    def version(self) -> str | None:
        """etcd's version (from ``GET /version``), once started."""
        return self._members[0].version if self._members else None

    @property
    def base_dir(self) -> str | None:
        """The directory holding every member's data and log; removed by :meth:`stop`."""
        return self._leftovers.base_dir

    def read_logs(self, tail: int | None = None) -> str:
        """Every member's output (its last ``tail`` lines each), under a heading per member."""
        return "\n".join(
            f"--- {member.name} ({member.endpoint}) ---\n{member.read_log(tail)}"
            for member in self._members
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 60, num_retries: int = 3) -> EtcdCluster:
        """Start every member and wait until each one knows a leader and serves requests.

        A no-op on a started cluster (even if some members were killed since).

        Args:
            timeout: seconds to wait for the cluster to be ready, in total.
            num_retries: attempts, each on new free ports, when a port was taken by
                another process before a member could bind it.

        Returns:
            The cluster itself.

        Raises:
            EtcdServerTimeoutError: if the cluster is not ready within ``timeout``.
            EtcdServerError: if a member exits during start-up (the message has the
                tail of its log), or if the etcd binary does not accept a flag
                (``enable_v2`` on etcd 3.6 or later; the message names the flag).
        """
        with self._lock:
            if self._leftovers.base_dir is not None:
                return self
            problem = self._program.removed_flag_problem()
            if problem:
                raise EtcdServerError(problem)
            self._leftovers.base_dir = tempfile.mkdtemp(prefix="etcd-rendezvous-cluster-")
            started = time.monotonic()
            try:
                self._launch_with_retries(started + timeout, max(1, num_retries))
            except BaseException:
                self._discard()
                raise
            logger.info(
                "etcd %s cluster of %d serving %s in %.2fs",
                self.version,
                self._size,
                self.endpoints,
                time.monotonic() - started,
            )
            return self

    def stop(self, grace: float = 10.0) -> None:
        """Stop every member and remove the cluster's directory; idempotent.

        Each member gets SIGTERM, then SIGKILL if it has not exited after ``grace``
        seconds. The members' logs stay readable (:meth:`read_logs`).
        """
        with self._lock:
            for member in self._members:
                member.stop(grace)
            self._discard()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        running = sum(member.running for member in self._members)
        return (
            f"<EtcdCluster {self._name} {running}/{self._size} running "
            f"[{self.endpoints}] binary={self.binary!r}>"
        )

    # -- the leader ------------------------------------------------------------------

    def leader(self, request_timeout: float = 1.0) -> EtcdClusterMember | None:
        """Return the member that leads the cluster now, or ``None`` if none does.

        Asks every running, unsuspended member for ``POST /v3/maintenance/status``; a
        member leads if the ``leader`` it reports is its own ``header.member_id``. A
        deposed leader that has not heard of a newer term yet is not taken for the
        leader: the answer must have the highest raft term seen.

        Args:
            request_timeout: seconds to wait for each member's answer.
        """
        pool = urllib3.PoolManager(retries=False)
        try:
            answers: list[tuple[EtcdClusterMember, bool, int]] = []
            for member in self._members:
                if not member.running or member.suspended:
                    continue
                try:
                    member_id, leader_id, term = member._member.status(pool, request_timeout)
                except NotReadyError:
                    continue
                answers.append((member, leader_id == member_id, term))
        finally:
            pool.clear()
        leaders = [(term, member) for member, leads, term in answers if leads]
        if not leaders:
            return None
        leader_term, leader = max(leaders, key=lambda pair: pair[0])
        newest_term = max(term for _, _, term in answers)
        return leader if leader_term >= newest_term else None

    def wait_for_leader(self, timeout: float = 30.0) -> EtcdClusterMember:
        """Wait until a running member leads the cluster, and return it.

        Raises:
            EtcdServerTimeoutError: if no member leads within ``timeout`` seconds (a
                cluster that has lost its quorum cannot elect one).
        """
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            member = self.leader(request_timeout=max(0.05, min(1.0, remaining)))
            if member is not None:
                return member
            if time.monotonic() >= deadline:
                running = [m.name for m in self._members if m.running and not m.suspended]
                raise EtcdServerTimeoutError(
                    f"etcd cluster {self._name} has no leader after {timeout}s "
                    f"(members answering: {running or 'none'})"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.2)

    def kill_leader(self, timeout: float = 30.0) -> EtcdClusterMember:
        """SIGKILL the current leader (waiting up to ``timeout`` for one); return it.

        The survivors elect a new leader if they hold a quorum; see
        :meth:`wait_for_leader`.
        """
        member = self.wait_for_leader(timeout)
        logger.info("killing the etcd leader %s (pid %d)", member.name, member.pid)
        member.kill()
        return member

    # -- internals -------------------------------------------------------------------

    def _launch_with_retries(self, deadline: float, attempts: int) -> None:
        for attempt in range(1, attempts + 1):
            if self._launch_all(deadline, attempt):
                return
        raise EtcdServerError(
            f"etcd cluster {self._name} could not start in {attempts} attempts: "
            "another process took one of its ports first each time"
        )

    def _launch_all(self, deadline: float, attempt: int) -> bool:
        """Start every member on new free ports and wait until all are ready.

        Returns ``False`` if a member could not bind a port (all members are stopped
        and their data removed, so the caller may try again), ``True`` once all serve.
        """
        base = self._leftovers.base_dir
        if base is None:
            raise EtcdServerError(f"etcd cluster {self._name} is not started")
        ports = free_ports(2 * self._size)
        client_ports, peer_ports = ports[: self._size], ports[self._size :]
        names = [f"{self._name}-m{i}" for i in range(self._size)]
        initial_cluster = ",".join(
            f"{name}=http://{HOST}:{port}" for name, port in zip(names, peer_ports, strict=True)
        )
        processes = []
        for i, name in enumerate(names):
            member_dir = os.path.join(base, f"m{i}")
            # A failed attempt's data belongs to a cluster with other peer URLs.
            shutil.rmtree(os.path.join(member_dir, DATA_NAME), ignore_errors=True)
            peer_url = f"http://{HOST}:{peer_ports[i]}"
            flags = [
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster={initial_cluster}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token={self._name}-{attempt}",
                *_TIMING_ARGS,
            ]
            processes.append(
                Member(
                    program=self._program,
                    name=name,
                    label=f"etcd member {name}",
                    directory=member_dir,
                    port=client_ports[i],
                    flags=flags,
                    leftovers=self._leftovers,
                )
            )
        self._members = [
            EtcdClusterMember(process, i, peer_ports[i]) for i, process in enumerate(processes)
        ]
        for process in processes:
            process.launch(attempt)
        if all(process.await_ready(deadline) for process in processes):
            return True
        for process in processes:
            process.stop(grace=2.0)
            process.retire()
        return False

    def _discard(self) -> None:
        """Stop the processes and remove the directory, keeping the logs' text."""
        discard(self._leftovers, [member._member for member in self._members])
