"""Rendezvous worker processes (``scripts/rdzv_worker.py``) driven by the tests."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    LegacyLayout,
    etcd_v2_state_key,
)
from support import RDZV_WORKER

WORKER = str(RDZV_WORKER)


def state_key(backend: str, run_id: str) -> str:
    """The etcd key of a run's state, under the default prefixes, for a rendezvous
    backend: ``"etcd"`` (the legacy one) or ``"etcd-v2"`` (the dynamic one)."""
    if backend == "etcd":
        return LegacyLayout(DEFAULT_PREFIX, run_id).state_key
    if backend == "etcd-v2":
        return etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX)
    raise ValueError(f"backend: expected etcd or etcd-v2, got {backend!r}")


#: libfaketime's preload library (Debian's ``libfaketime`` package).
FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def skewed_clock(seconds: int) -> dict[str, str]:
    """The environment of a process whose wall clock is ``seconds`` off (behind if
    negative) under libfaketime; its monotonic clock stays real, so its deadlines do
    (``rdzv_worker.py`` then sleeps on an event: libfaketime breaks ``time.sleep``)."""
    return {
        "LD_PRELOAD": FAKETIME_LIBRARY,
        "FAKETIME": f"{seconds:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


class Worker:
    """One ``rdzv_worker.py`` process; send commands, wait for JSON events. ``env`` is
    added to the process' environment (e.g. :func:`skewed_clock`)."""

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        impl: str = "ours",
        last_call: int = 30,
        timeout: int = 60,
        prefix: str = "/torchelastic/p2p",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        cmd = [
            sys.executable,
            WORKER,
            f"--impl={impl}",
            f"--endpoint={endpoint}",
            f"--run-id={run_id}",
            f"--min={min_nodes}",
            f"--max={max_nodes}",
            f"--last-call={last_call}",
            f"--timeout={timeout}",
            f"--prefix={prefix}",
            *extra_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.impl = impl
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._events.put(json.loads(line))
        self._events.put({"event": "eof"})

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        """The last 60 lines the worker wrote to stderr (for failure messages)."""
        return "".join(self._stderr[-60:])

    @property
    def all_stderr(self) -> str:
        """Everything the worker wrote to stderr so far."""
        return "".join(self._stderr)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.proc.pid} sent nothing within {timeout} s; stderr:\n{self.stderr}"
            ) from None
        if event["event"] == "eof":
            raise AssertionError(f"worker {self.proc.pid} exited; stderr:\n{self.stderr}")
        return event

    def request(self, command: str, timeout: float = 60.0) -> dict[str, Any]:
        self.send(command)
        return self.next_event(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        event = self.next_event(timeout)
        assert event["event"] == "ready", (event, self.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def started(workers: list[Worker], new: Sequence[Worker]) -> list[Worker]:
    """Add ``new`` to ``workers`` (the test's, stopped at teardown) and wait until each
    is ready; ``new`` as a list."""
    workers.extend(new)
    for worker in new:
        worker.wait_ready()
    return list(new)


def expect_joined(event: dict[str, Any], worker: Worker) -> dict[str, Any]:
    assert event["event"] == "joined", (event, worker.stderr)
    return event


def join_all(group: Sequence[Worker]) -> list[dict[str, Any]]:
    """Every worker of ``group`` joins at once; their ``joined`` events, in group order."""
    for worker in group:
        worker.send("join")
    return [expect_joined(worker.next_event(), worker) for worker in group]


def check_shared_store(group: Sequence[Worker], joined: Sequence[dict[str, Any]]) -> None:
    """Every worker reads what every rank wrote through the rendezvous' store, and their
    adds to one counter are counted once each."""
    by_rank = {j["rank"]: w for j, w in zip(joined, group)}
    for rank, worker in by_rank.items():
        assert worker.request(f"set key{rank} value{rank}")["event"] == "ok"
    for worker in group:
        for rank in by_rank:
            assert worker.request(f"get key{rank}") == {"event": "value", "value": f"value{rank}"}
    totals = [w.request("add counter 1")["value"] for w in group]
    assert sorted(totals) == list(range(1, len(group) + 1))
