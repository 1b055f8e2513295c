"""A rendezvous worker process driven over stdin/stdout, for multi-process tests.

Run as ``python tests/support/scripts/rdzv_worker.py --impl ours|torch --endpoint H:P --run-id R
--min N --max M [--last-call S] [--timeout S] [--prefix P] [--backend etcd|etcd-v2]
[--keep-alive-interval S] [--keep-alive-max-attempt N] [--request-timeout S]
[--silence-timeout S]``. It creates a handler of the
``etcd`` backend (default) or of the ``etcd-v2`` backend with the dynamic rendezvous
(ours, or PyTorch's with ``--impl torch``), prints ``{"event": "ready"}`` and then
executes one command per stdin line, answering each with one JSON line on stdout:

* ``join`` -> ``{"event": "joined", "rank", "world_size", "version", "master_addr",
  "master_port", "elapsed"}`` or ``{"event": "error", "type", "message", "elapsed"}``
  (``elapsed``: the seconds the command took, in the worker); with
  ``etcd-v2`` the dynamic rendezvous' ``round`` replaces ``version``
* ``waiting`` -> ``{"event": "waiting", "n": num_nodes_waiting()}``
* ``closed`` -> ``{"event": "closed", "value": is_closed()}``
* ``close`` -> ``{"event": "ok"}`` after ``set_closed()``
* ``set K V`` / ``get K`` / ``add K N`` -> store operations on the last rendezvous' store
* ``shutdown`` -> ``{"event": "shutdown", "result", "lease_threads"}`` (``etcd``) or
  ``{"event": "shutdown", "result", "threads"}`` (``etcd-v2``: the names of the threads
  still alive besides the main one)
* ``clock`` -> ``{"event": "clock", "time": time.time()}`` (the process' wall clock)
* ``exit`` -> exits 0

``--busy-threads N`` starts N threads, once the handler is made, that spin in Python for
the life of the process: the rendezvous then gets a small share of the interpreter, as in
a worker whose process is busy with something else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _parameters(cls: Any, backend: str, args: argparse.Namespace, config: dict[str, Any]) -> Any:
    """``cls`` (ours or torch's ``RendezvousParameters``) built from the command line."""
    return cls(
        backend=backend,
        endpoint=args.endpoint,
        run_id=args.run_id,
        min_nodes=args.min,
        max_nodes=args.max,
        local_addr="127.0.0.1",
        **config,
    )


def _make_dynamic_handler(args: argparse.Namespace) -> Any:
    config: dict[str, Any] = {
        "join_timeout": args.timeout,
        "last_call_timeout": args.last_call,
        "close_timeout": 10,
        "keep_alive_interval": args.keep_alive_interval,
        "keep_alive_max_attempt": args.keep_alive_max_attempt,
        "read_timeout": 10,
    }
    if args.impl == "ours":
        config.update(_our_request_timeouts(args))
    # With TCPStore sharing (PyTorch's default when it is installed) a node that joins
    # PyTorch 2.13's handlers in a later round waits for MASTER_ADDR until the store
    # times out: its rank 0 publishes it only in its first round (ours republishes it
    # every round; test_late_node_is_admitted_with_the_shared_tcp_store turns sharing on).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.impl == "torch":
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
        from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

        params = _parameters(RendezvousParameters, "etcd-v2", args, config)
        backend, store = create_backend(params)
        return create_handler(store, backend, params)

    from etcd_rendezvous.api import RendezvousParameters as OurParameters
    from etcd_rendezvous.registry import get_rendezvous_handler

    config["torch_store"] = args.torch_store
    return get_rendezvous_handler(_parameters(OurParameters, "etcd-v2", args, config))


def _round(handler: Any) -> int | None:
    """The round of the dynamic rendezvous just joined (a private attribute of both
    implementations, named as in PyTorch)."""
    try:
        return int(handler._state_holder.state.round)
    except AttributeError:
        return None


def _our_request_timeouts(args: argparse.Namespace) -> dict[str, Any]:
    """``request_timeout`` and ``silence_timeout`` where the command line sets them (our
    handlers only: PyTorch's have neither)."""
    return {
        name: value
        for name, value in (
            ("request_timeout", args.request_timeout),
            ("silence_timeout", args.silence_timeout),
        )
        if value is not None
    }


def make_handler(args: argparse.Namespace) -> Any:
    """The handler the command line describes (see :func:`add_handler_arguments`): of
    the ``etcd`` or ``etcd-v2`` backend, ours or PyTorch's."""
    if args.backend == "etcd-v2":
        return _make_dynamic_handler(args)
    config: dict[str, Any] = {
        "timeout": args.timeout,
        "last_call_timeout": args.last_call,
        "etcd_prefix": args.prefix,
    }
    if args.impl == "torch":
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.etcd_rendezvous import create_rdzv_handler
    else:
        from etcd_rendezvous.api import RendezvousParameters
        from etcd_rendezvous.etcd_rendezvous import create_rdzv_handler

        config["read_timeout"] = 10
        config["torch_store"] = args.torch_store
        config.update(_our_request_timeouts(args))
    return create_rdzv_handler(_parameters(RendezvousParameters, "etcd", args, config))


def _log_to_file() -> None:
    """With ``$RDZV_WORKER_LOG_DIR`` set, log everything (DEBUG) to ``<dir>/<pid>.log``:
    the record of a worker that hung, for debugging."""
    log_dir = os.environ.get("RDZV_WORKER_LOG_DIR")
    if not log_dir:
        return
    import logging

    logging.basicConfig(
        filename=os.path.join(log_dir, f"{os.getpid()}.log"),
        level=logging.DEBUG,
        format="%(relativeCreated)8.0f %(threadName)s %(name)s %(levelname)s %(message)s",
    )


def sleep_under_faketime() -> None:
    """Under libfaketime with its monotonic clock left real (``support.rdzv.skewed_clock``,
    the fault harness's clock offsets) ``time.sleep`` fails with EINVAL: libfaketime
    0.9.10 mishandles the absolute monotonic ``clock_nanosleep`` of Python 3.11. Sleep on
    an event instead, whose timed wait it leaves alone (with the monotonic clock faked
    too, timed waits hang instead). Call it before the library binds ``time.sleep``."""
    if "FAKETIME" not in os.environ and "FAKETIME_TIMESTAMP_FILE" not in os.environ:
        return
    never = threading.Event()

    def sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        never.wait(seconds)

    time.sleep = sleep


def _spin() -> None:
    while True:
        pass


def add_handler_arguments(parser: argparse.ArgumentParser) -> None:
    """The options :func:`make_handler` reads (also used by ``tests/chaos/node.py``)."""
    parser.add_argument("--impl", choices=("ours", "torch"), default="ours")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--min", type=int, required=True)
    parser.add_argument("--max", type=int, required=True)
    parser.add_argument("--last-call", type=int, default=30)
    parser.add_argument("--timeout", type=int, default=60)
    parser.add_argument("--prefix", default="/torchelastic/p2p")
    parser.add_argument("--backend", choices=("etcd", "etcd-v2"), default="etcd")
    parser.add_argument("--keep-alive-interval", type=int, default=5)
    parser.add_argument("--keep-alive-max-attempt", type=int, default=3)
    # Ours hands out a torch Store when PyTorch is installed ("auto"), which means
    # importing PyTorch (seconds per process); most tests do not need it.
    parser.add_argument("--torch-store", choices=("auto", "true", "false"), default="false")
    # Ours only; unset: the library's defaults.
    parser.add_argument("--request-timeout", type=float, default=None)
    parser.add_argument("--silence-timeout", type=float, default=None)


def main() -> None:
    sleep_under_faketime()
    parser = argparse.ArgumentParser()
    add_handler_arguments(parser)
    parser.add_argument("--busy-threads", type=int, default=0)
    args = parser.parse_args()
    _log_to_file()

    handler = make_handler(args)
    store: Any = None
    _emit(event="ready")
    for i in range(args.busy_threads):
        threading.Thread(target=_spin, name=f"busy-{i}", daemon=True).start()
    for line in sys.stdin:
        cmd, *rest = line.split()
        started = time.monotonic()
        try:
            if cmd == "join":
                info = handler.next_rendezvous()
                store = info.store
                where: dict[str, Any]
                if args.backend == "etcd-v2":
                    where = {"round": _round(handler)}
                else:
                    prefix = store.prefix
                    where = {"version": prefix.split("/rdzv/v_")[1].split("/")[0]}
                _emit(
                    event="joined",
                    rank=info.rank,
                    world_size=info.world_size,
                    **where,
                    master_addr=info.bootstrap_store_info.master_addr,
                    master_port=info.bootstrap_store_info.master_port,
                    elapsed=time.monotonic() - started,
                    store_type=type(store).__name__,
                )
            elif cmd == "waiting":
                _emit(event="waiting", n=handler.num_nodes_waiting())
            elif cmd == "closed":
                _emit(event="closed", value=handler.is_closed())
            elif cmd == "close":
                handler.set_closed()
                _emit(event="ok")
            elif cmd == "set":
                store.set(rest[0], rest[1])
                _emit(event="ok")
            elif cmd == "get":
                _emit(event="value", value=store.get(rest[0]).decode())
            elif cmd == "add":
                _emit(event="value", value=store.add(rest[0], int(rest[1])))
            elif cmd == "shutdown":
                result = handler.shutdown()
                if args.backend == "etcd-v2":
                    threads = [
                        t.name
                        for t in threading.enumerate()
                        if t is not threading.main_thread() and t.is_alive()
                    ]
                    _emit(event="shutdown", result=result, threads=threads)
                else:
                    lease_threads = [
                        t.name
                        for t in threading.enumerate()
                        if t.name.startswith("etcd-rendezvous")
                    ]
                    _emit(event="shutdown", result=result, lease_threads=lease_threads)
            elif cmd == "clock":
                _emit(event="clock", time=time.time())
            elif cmd == "exit":
                return
            else:
                _emit(event="error", type="UnknownCommand", message=cmd)
        except Exception as exc:
            elapsed = time.monotonic() - started
            _emit(event="error", type=type(exc).__name__, message=str(exc), elapsed=elapsed)


if __name__ == "__main__":
    main()
