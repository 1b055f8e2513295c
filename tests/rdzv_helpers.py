"""Helpers for rendezvous tests: worker processes and waiting on etcd state."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from etcd_rendezvous._transport.interface import KeyNotFoundError, Transport

WORKER = str(Path(__file__).with_name("rdzv_worker.py"))


class Worker:
    """One ``rdzv_worker.py`` process; send commands, wait for JSON events."""

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
        env = dict(os.environ, PYTHONUNBUFFERED="1")
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
        return "".join(self._stderr[-60:])

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


def expect_joined(event: dict[str, Any], worker: Worker) -> dict[str, Any]:
    assert event["event"] == "joined", (event, worker.stderr)
    return event


def wait_for_state(
    conn: Transport,
    key: str,
    predicate: Callable[[dict[str, Any] | None], bool],
    timeout: float = 30.0,
) -> dict[str, Any] | None:
    """Block until the JSON state under ``key`` satisfies ``predicate`` (watching etcd)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            node = conn.get(key)
            state = json.loads(node.value) if node.value else None
            index = node.etcd_index + 1
        except KeyNotFoundError as exc:
            state = None
            index = (exc.etcd_index or conn.last_index) + 1
        if predicate(state):
            return state
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"state of {key} never matched; last: {state}")
        conn.watch(key, index, min(remaining, 5.0))


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` (which itself queries something) until true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)
