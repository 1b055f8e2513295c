"""A throw-away multi-member etcd cluster on loopback, for failover tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from types import TracebackType

import urllib3

from etcd_rendezvous.api import _get_free_port
from etcd_rendezvous.etcd_server import find_etcd_binary


class EtcdCluster:
    """``size`` etcd members (v2 API enabled) forming one cluster on 127.0.0.1."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.binary = find_etcd_binary()
        self._base = tempfile.mkdtemp(prefix="etcd-cluster-")
        self._client_ports = [_get_free_port() for _ in range(size)]
        self._peer_ports = [_get_free_port() for _ in range(size)]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._logs: list[str] = [os.path.join(self._base, f"m{i}.log") for i in range(size)]
        self._pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(2, 2))

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """The client endpoints of all members, in member order."""
        return [("127.0.0.1", port) for port in self._client_ports]

    def endpoint_string(self) -> str:
        """``"127.0.0.1:P1,127.0.0.1:P2,..."``, as a rendezvous ``endpoint`` parameter."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _command(self, i: int) -> list[str]:
        peers = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self._peer_ports))
        client = f"http://127.0.0.1:{self._client_ports[i]}"
        peer = f"http://127.0.0.1:{self._peer_ports[i]}"
        return [
            self.binary,
            "--enable-v2=true",
            f"--name=m{i}",
            f"--data-dir={os.path.join(self._base, f'm{i}')}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={peers}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=etcd-rendezvous-test",
            "--heartbeat-interval=50",
            "--election-timeout=500",
        ]

    def start_member(self, i: int) -> None:
        """Start (or restart, keeping its data) member ``i``."""
        with open(self._logs[i], "ab") as log:
            self._procs[i] = subprocess.Popen(
                self._command(i), stdout=log, stderr=subprocess.STDOUT
            )

    def kill_member(self, i: int) -> None:
        """SIGKILL member ``i``."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        self._procs[i] = None

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        """Start every member and wait until the cluster has a leader and serves v2."""
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy(range(self.size), timeout)
        return self

    def wait_healthy(self, members: range | list[int], timeout: float = 60.0) -> None:
        """Wait until each of ``members`` answers a v2 quorum read."""
        deadline = time.monotonic() + timeout
        for i in members:
            while not self._answers(i):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member m{i} not healthy; log:\n{self.log(i)}")
                time.sleep(0.1)

    def _answers(self, i: int) -> bool:
        url = f"http://127.0.0.1:{self._client_ports[i]}/v2/keys/?quorum=true"
        try:
            return self._pool.request("GET", url).status == 200
        except urllib3.exceptions.HTTPError:
            return False

    def leader(self) -> int:
        """Index of the member that currently leads the cluster."""
        for i, port in enumerate(self._client_ports):
            if self._procs[i] is None:
                continue
            with contextlib.suppress(urllib3.exceptions.HTTPError, ValueError):
                url = f"http://127.0.0.1:{port}/v2/stats/self"
                stats = json.loads(self._pool.request("GET", url).data)
                if stats.get("state") == "StateLeader":
                    return i
        raise RuntimeError("no leader")

    def log(self, i: int) -> str:
        with open(self._logs[i], errors="replace") as f:
            return "".join(f.readlines()[-30:])

    def stop(self) -> None:
        """Kill every member and delete the data."""
        for i in range(self.size):
            self.kill_member(i)
        shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
