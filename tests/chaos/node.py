"""One node of a chaos scenario: a rendezvous handler driven as torchrun's agent drives it.

Run by the runner as ``python -m chaos.node CONFIG.json`` (``tests/`` and ``src/`` on
``PYTHONPATH``). The handler comes from ``support/scripts/rdzv_worker.py``
(:func:`make_handler`: ours or PyTorch's, ``etcd`` or ``etcd-v2``). The node then loops
until the runner writes ``stop`` (or ``leave``) on its stdin:

1. ``next_rendezvous()``; a failure is recorded and the call repeated (a healthy node
   keeps trying), unless the run is closed;
2. the round's **fingerprint**: each rank claims its rank in the round's store (a
   counter that must reach 1 exactly) and writes its name there, then reads every
   rank's name: all nodes of one world read the same list;
3. one value **stored** in the round's store, which the node reads back at every step;
4. **steps**, as a training job's collectives: every rank adds 1 to the step's counter
   in the store, the rank that completes it writes ``done``, and all wait for it
   (``step_timeout``). A barrier that does not pass means the world lost a member: the
   node re-rendezvouses, as torchrun's agent does when its workers fail. Before each
   step the node asks ``num_nodes_waiting()`` and re-rendezvouses if it is not 0.

On ``stop`` the node calls ``shutdown()`` (which closes the run for everyone, as the
first agent to finish does) and then ``close()``; on ``leave`` only ``close()`` (a node
that leaves the job). It then records the threads and etcd sockets still open and exits.
Everything it does is a record (:mod:`chaos.records`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from chaos.records import Recorder

T = TypeVar("T")

#: The thread that reads the runner's commands (not a leak of the library's).
_STDIN_THREAD = "chaos-node-stdin"
#: How long the node lets the library's threads end after ``close()``.
_LEAK_GRACE = 3.0
#: Chunks of a barrier wait, so that ``stop`` is noticed within about this long.
_WAIT_CHUNK = 1.0


class StoppedError(Exception):
    """The runner asked the node to end."""


class Node:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.name: str = config["name"]
        self.impl: str = config["impl"]
        self.backend: str = config["backend"]
        self.record = Recorder(Path(config["records"]), node=self.name)
        self.stop = threading.Event()
        self.leave = False
        self.handler: Any = None
        self.call = 0
        self.ports = {int(e.rsplit(":", 1)[1]) for e in config["endpoint"].split(",")}

    # -- errors ------------------------------------------------------------------------

    def named(self, exc: BaseException) -> bool:
        """Whether ``exc`` is one of the rendezvous' named errors: a ``RendezvousError``
        (ours, or PyTorch's where it is loaded)."""
        from etcd_rendezvous.api import RendezvousError

        if isinstance(exc, RendezvousError):
            return True
        torch_api = sys.modules.get("torch.distributed.elastic.rendezvous.api")
        return torch_api is not None and isinstance(exc, torch_api.RendezvousError)

    @staticmethod
    def closed_error(exc: BaseException) -> bool:
        return type(exc).__name__ == "RendezvousClosedError"

    def op(self, name: str, round_: Any, fn: Callable[[], T], timeout: float) -> T:
        """Run one store or handler call; a failure is recorded and raised on."""
        started = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            self.record(
                "op_error",
                op=name,
                round=round_,
                error=type(exc).__name__,
                named=self.named(exc) or isinstance(exc, LookupError),
                message=str(exc)[:300],
                elapsed=time.monotonic() - started,
                timeout=timeout,
            )
            raise

    # -- the runner's commands -----------------------------------------------------------

    def read_commands(self) -> None:
        for line in sys.stdin:
            command = line.strip()
            if command in ("stop", "leave"):
                self.leave = command == "leave"
                self.record("stop", how=command)
                self.stop.set()
        self.stop.set()

    # -- the agent ---------------------------------------------------------------------

    def make_handler(self) -> None:
        from support.scripts.rdzv_worker import add_handler_arguments, make_handler

        parser = argparse.ArgumentParser()
        add_handler_arguments(parser)
        c = self.config
        argv = [
            f"--impl={self.impl}",
            f"--backend={self.backend}",
            f"--endpoint={c['endpoint']}",
            f"--run-id={c['run_id']}",
            f"--min={c['min_nodes']}",
            f"--max={c['max_nodes']}",
            f"--last-call={c['last_call']}",
            f"--timeout={c['timeout']}",
            f"--keep-alive-interval={c['keep_alive_interval']}",
            f"--keep-alive-max-attempt={c['keep_alive_max_attempt']}",
        ]
        if self.impl == "ours":
            argv += [
                f"--request-timeout={c['request_timeout']}",
                f"--silence-timeout={c['silence_timeout']}",
            ]
        args = parser.parse_args(argv)
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.handler = make_handler(args)
                return
            except Exception as exc:
                self.record(
                    "create_error",
                    error=type(exc).__name__,
                    named=self.named(exc),
                    message=str(exc)[:300],
                    elapsed=time.monotonic() - started,
                )
                self.stop.wait(0.5)

    def run(self) -> None:
        c = self.config
        self.record(
            "start",
            pid=os.getpid(),
            impl=self.impl,
            backend=self.backend,
            run_id=c["run_id"],
            timeout=c["timeout"],
            store_timeout=c["step_timeout"],
        )
        threading.Thread(target=self.read_commands, name=_STDIN_THREAD, daemon=True).start()
        self.make_handler()
        closed = False
        while self.handler is not None and not self.stop.is_set() and not closed:
            closed = self.one_round()
        self.finish()

    def one_round(self) -> bool:
        """One ``next_rendezvous()`` and the round it gives; whether the run is closed."""
        self.call += 1
        self.record("join_start", call=self.call)
        started = time.monotonic()
        try:
            info = self.handler.next_rendezvous()
        except Exception as exc:
            closed = self.closed_error(exc)
            self.record(
                "join_error",
                call=self.call,
                error=type(exc).__name__,
                named=self.named(exc),
                closed=closed,
                message=str(exc)[:300],
                elapsed=time.monotonic() - started,
            )
            if not closed:
                self.stop.wait(0.5)
            return closed
        try:
            self.in_round(info, started)
        except StoppedError:
            pass
        except Exception:  # recorded by op(); the agent re-rendezvouses
            self.stop.wait(0.2)
        return False

    def round_of(self, info: Any) -> Any:
        """The round (``etcd-v2``) or version (``etcd``) the call joined."""
        store = info.store
        if self.backend == "etcd":
            return int(store.prefix.split("/rdzv/v_")[1].split("/")[0])
        prefix = getattr(store, "prefix", None)
        if isinstance(prefix, str):  # ours: torch.rendezvous.<run_id>.<round>
            return int(prefix.rsplit(".", 1)[1])
        return None  # PyTorch's PrefixStore does not say: found by probing (below)

    def probe_round(self, info: Any, token: str) -> int | None:
        """For PyTorch's dynamic handler: the round whose store holds our fingerprint."""
        guess = int(self.handler._state_holder.state.round)
        underlying = info.store.underlying_store
        for candidate in (guess, guess - 1, guess + 1, guess - 2):
            key = f"torch.rendezvous.{self.config['run_id']}.{candidate}/chaos/fp/{info.rank}"
            if underlying.check([key]) and underlying.get(key).decode() == token:
                return candidate
        return None

    def wait_key(self, store: Any, key: str, seconds: float, round_: Any) -> bool:
        """Wait for ``key`` in chunks, so that ``stop`` is noticed; whether it came."""
        deadline = time.monotonic() + seconds
        while True:
            if self.stop.is_set():
                raise StoppedError
            chunk = min(_WAIT_CHUNK, deadline - time.monotonic())
            if chunk <= 0:
                return False
            try:
                store.wait([key], timedelta(seconds=chunk))
                return True
            except Exception as exc:
                if not self.timed_out(exc):
                    self.record(
                        "op_error",
                        op="store.wait",
                        round=round_,
                        error=type(exc).__name__,
                        named=self.named(exc),
                        message=str(exc)[:300],
                        elapsed=chunk,
                        timeout=chunk,
                    )
                    raise

    @staticmethod
    def timed_out(exc: BaseException) -> bool:
        """A store wait that timed out (``LookupError`` from ours and PyTorch's
        ``EtcdStore``; c10d's ``DistStoreError`` or a "timeout" ``RuntimeError``)."""
        return isinstance(exc, LookupError) or "timeout" in str(exc).lower()

    def in_round(self, info: Any, started: float) -> None:
        c = self.config
        store, rank, world = info.store, int(info.rank), int(info.world_size)
        step_timeout = float(c["step_timeout"])
        token = f"{self.name}#{self.call}"

        def joined(round_: Any) -> None:
            elapsed = time.monotonic() - started
            self.record(
                "joined", call=self.call, round=round_, rank=rank, world_size=world, elapsed=elapsed
            )

        round_ = self.round_of(info)
        if round_ is not None:
            joined(round_)
        claims = self.op("store.add", round_, lambda: store.add(f"chaos/fpc/{rank}", 1), 30)
        self.op("store.set", round_, lambda: store.set(f"chaos/fp/{rank}", token), 30)
        if round_ is None:
            round_ = self.op("probe", None, lambda: self.probe_round(info, token), 30)
            joined(round_)
        members: list[str | None] = []
        for other in range(world):
            key = f"chaos/fp/{other}"
            if self.wait_key(store, key, step_timeout, round_):
                value = self.op("store.get", round_, lambda k=key: store.get(k), 30)
                members.append(value.decode().split("#")[0])
            else:
                members.append(None)
        self.record("world", round=round_, members=members, conflict=int(claims) != 1)
        if None in members:
            self.record("step_failed", round=round_, k=-1)
            return
        data_key = f"chaos/data/{self.name}"
        self.op("store.set", round_, lambda: store.set(data_key, token), 30)
        self.record("stored", round=round_, key=data_key)
        for k in range(1_000_000):
            if self.stop.is_set():
                return
            waiting = self.op(
                "num_nodes_waiting", round_, self.handler.num_nodes_waiting, c["timeout"]
            )
            if waiting:
                self.record("waiting", round=round_, n=waiting)
                return
            count = int(
                self.op("store.add", round_, lambda k=k: store.add(f"chaos/step/{k}", 1), 30)
            )
            if count > world:
                self.record("overflow", round=round_, k=k, count=count)
            if count == world:
                self.op("store.set", round_, lambda k=k: store.set(f"chaos/done/{k}", "1"), 30)
            if not self.wait_key(store, f"chaos/done/{k}", step_timeout, round_):
                self.record("step_failed", round=round_, k=k)
                return
            self.record("step", round=round_, k=k)
            if not self.op("store.check", round_, lambda: store.check([data_key]), 30):
                self.record("lost", round=round_, key=data_key)
            self.stop.wait(float(c["step_interval"]))

    # -- the end -------------------------------------------------------------------------

    def finish(self) -> None:
        handler = self.handler
        if handler is None:
            self.record("exit")
            return
        threads: list[str] | None = None
        if not self.leave:
            started = time.monotonic()
            result, error = None, None
            try:
                result = handler.shutdown()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
            self.record("shutdown", result=result, error=error, elapsed=time.monotonic() - started)
            threads = self.leaked_threads()
        close = getattr(handler, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()
        if self.impl == "ours":
            after_close = self.leaked_threads()
            sockets = self.etcd_sockets()
            self.handler = handler = close = None
            gc.collect()
            self.record(
                "leaks",
                threads=after_close if threads is None else threads,
                threads_after_close=after_close,
                sockets=[s for s in sockets if s.endswith("ESTABLISHED")],
                sockets_after_gc=self.etcd_sockets(),
            )
        self.record("exit")

    def leaked_threads(self) -> list[str]:
        deadline = time.monotonic() + _LEAK_GRACE
        while True:
            names = [
                t.name
                for t in threading.enumerate()
                if t is not threading.main_thread() and t.name != _STDIN_THREAD and t.is_alive()
            ]
            if not names or time.monotonic() >= deadline:
                return names
            self.stop.wait(0.1)

    def etcd_sockets(self) -> list[str]:
        """``host:port state`` of each open TCP connection of this process to an etcd
        endpoint it was given."""
        from support.net import own_tcp_connections

        return [
            f"{c.remote}:{c.port} {c.state}" for c in own_tcp_connections() if c.port in self.ports
        ]


def main() -> None:
    from support.scripts.rdzv_worker import sleep_under_faketime

    sleep_under_faketime()
    # The library's INFO lines go to the node's log (``node-<name>.log``), with the
    # time since the process started and the thread: what to read when a seed fails.
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("CHAOS_DEBUG") else logging.INFO,
        format="%(relativeCreated)8.0f %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    with open(sys.argv[1]) as fh:
        config = json.load(fh)
    Node(config).run()


if __name__ == "__main__":
    main()
