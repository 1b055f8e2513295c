"""One rendezvous over etcd's v2 API vs its v3 API: time, and etcd requests per node.

Usage::

    python benchmarks/bench_v2_v3.py [--nodes 8 32 64] [--repeat 1]
        [--backends etcd etcd-v2] [--apis v2 v3] [--impls ours torch]

One etcd is started (bundled etcd 3.5 unless ``ETCD_BINARY_PATH`` says otherwise), with
the v2 API enabled when ``--apis`` includes v2, so that it serves both APIs; etcd 3.6
and later have no v2 API: measure them with ``--apis v3``. For each backend (``etcd``, the legacy
state machine; ``etcd-v2``, the dynamic rendezvous), API and node count, N nodes run
as threads of this process, each with its own handler from
``etcd_rendezvous.registry.get_rendezvous_handler`` (``etcd_api=v2`` or ``v3``,
``torch_store=false``). Handlers are created first (not measured); then every node
calls ``next_rendezvous()`` at once. Reported:

* **seconds** from the first ``next_rendezvous()`` call to the last rank;
* **writes/node** and **reads/node**: the etcd requests of that interval, from etcd's
  ``/metrics``, divided by N, as ``tests/support/etcd_requests.py`` classifies them. v2:
  ``etcd_http_received_total`` by method (reads GET, writes PUT, POST, DELETE) plus
  the watches, which that counter leaves out and etcd's v2 store counts in
  ``etcd_debugging_store_watch_requests_total`` (reads). v3:
  ``grpc_server_started_total`` by ``grpc_method`` (reads Range, Watch -- a stream per
  wait -- and LeaseTimeToLive; writes Put, Txn, DeleteRange, LeaseGrant, LeaseRevoke).
  A request of any other kind is printed after its row;
* **keep-alive/node**, not counted above: lease keep-alives (v3 LeaseKeepAlive) and
  v2 TTL refreshes (PUTs that etcd's v2 store counts as ``action="update"``, even when
  they fail; neither implementation issues other updates).

``--breakdown`` prints each row's requests by API and method.

PyTorch 2.13's own ``etcd`` and ``etcd-v2`` backends run as a reference on v2 (they
cannot speak v3), when torch is installed. Every variant gets the same settings:
``min_nodes = max_nodes = N`` (so the rendezvous completes when the last node
arrives), ``last_call_timeout=1``, a 300 s timeout, and for ``etcd-v2`` a 30 s
``keep_alive_interval`` so that heartbeats (keep-alive traffic, written into the state
key) do not fall within the measurement. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: no
handler starts a TCPStore; rank 0 publishes its address through the etcd store.

PyTorch's legacy backend cannot refresh its run directory's TTL on etcd 3.5: its
keep-alive thread dies once per node, and the script counts such deaths and prints one
line for them. Results: ``docs/etcd-v3.rst``, section "Cost: v2 against v3".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _bench_common import (
    APIS,
    BACKENDS,
    IMPLS,
    ThreadDeaths,
    Variant,
    handler_factory,
    release,
    torch_available,
    variants,
)

from etcd_rendezvous.etcd_server import EtcdServer
from support.etcd_requests import Requests, read_metrics, requests_since

#: Seconds a whole rendezvous may take before the benchmark gives up.
_TIMEOUT = 300

#: Options every variant gets, by backend (strings, as torchrun passes them).
_OPTIONS = {
    "etcd": {"timeout": str(_TIMEOUT), "last_call_timeout": "1"},
    "etcd-v2": {
        "join_timeout": str(_TIMEOUT),
        "last_call_timeout": "1",
        "keep_alive_interval": "30",
    },
}


# -- one measurement --------------------------------------------------------------------


def one_rendezvous(handlers: list[Any]) -> tuple[float, list[int]]:
    """Every handler calls ``next_rendezvous()`` in its own thread, all at once.

    Returns the seconds from the first call to the last rank, and the ranks.
    """
    count = len(handlers)
    go = threading.Barrier(count + 1)
    started = [0.0] * count
    finished = [0.0] * count
    ranks = [-1] * count
    errors: list[BaseException] = []

    def node(i: int) -> None:
        try:
            go.wait()
            started[i] = time.monotonic()
            ranks[i] = handlers[i].next_rendezvous().rank
            finished[i] = time.monotonic()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=node, args=(i,), name=f"node-{i}", daemon=True)
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    go.wait()
    for thread in threads:
        thread.join(_TIMEOUT + 30)
    if errors:
        raise RuntimeError(f"{len(errors)} node(s) failed; the first: {errors[0]!r}")
    if any(thread.is_alive() for thread in threads) or sorted(ranks) != list(range(count)):
        raise RuntimeError(f"the rendezvous did not complete: ranks {sorted(ranks)}")
    return max(finished) - min(started), ranks


def measure(server: EtcdServer, variant: Variant, nodes: int) -> tuple[float, Requests]:
    """One rendezvous of ``nodes`` fresh handlers on a fresh run id: seconds, requests."""
    make = handler_factory(variant, server.get_endpoint(), nodes, _OPTIONS[variant.backend])
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handlers: list[Any] = []
    try:
        handlers.extend(make(run_id) for _ in range(nodes))
        before = read_metrics(server.client_url)
        seconds, _ = one_rendezvous(handlers)
        requests = requests_since(server.client_url, before)
    finally:
        for handler in handlers:
            release(handler, variant.impl)
    return seconds, requests


# -- the table --------------------------------------------------------------------------


def _mean_by_name(tables: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each entry over ``tables`` (an absent entry counts as 0)."""
    names = sorted({name for table in tables for name in table})
    return {name: sum(t.get(name, 0.0) for t in tables) / len(tables) for name in names}


def row(variant: Variant, nodes: int, results: list[tuple[float, Requests]]) -> str:
    """One line of the table: medians over the repeats; requests per node.

    Requests that fit none of the classes are appended, so nothing goes uncounted.
    """

    def per_node(pick: Callable[[Requests], float]) -> float:
        return statistics.median(pick(requests) for _, requests in results) / nodes

    seconds = statistics.median(seconds for seconds, _ in results)
    other = _mean_by_name([requests.other for _, requests in results])
    note = "".join(f"  +{v / nodes:.1f} {k}" for k, v in other.items())
    return (
        f"{variant.backend:<8} {variant.api:<3} {variant.impl:<5} {nodes:>3} {seconds:>8.2f} "
        f"{per_node(lambda r: r.writes):>11.1f} {per_node(lambda r: r.reads):>10.1f} "
        f"{per_node(lambda r: r.keepalives):>15.1f}{note}"
    )


def breakdown(nodes: int, results: list[tuple[float, Requests]]) -> str:
    """The requests of one row by API and method, per node (mean over the repeats)."""
    means = _mean_by_name([requests.by_method for _, requests in results])
    return "    " + ", ".join(f"{name} {value / nodes:.1f}" for name, value in means.items())


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--repeat", type=int, default=1, help="rendezvous per row (median)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--apis", nargs="+", choices=APIS, default=list(APIS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument(
        "--breakdown", action="store_true", help="also print each row's requests by method"
    )
    args = parser.parse_args()
    if args.repeat < 1 or min(args.nodes) < 1:
        parser.error("--repeat and --nodes must be at least 1")
    return args


def main() -> None:
    """Measure every variant and print the table."""
    args = parse_args()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    thread_errors = ThreadDeaths()
    threading.excepthook = thread_errors
    impls = list(args.impls)
    if "torch" in impls and not torch_available():
        print("note: torch is not installed; PyTorch's reference rows are skipped")
        impls.remove("torch")
    # etcd 3.6 and later have no v2 API: there, ask for --apis v3 (EtcdServer refuses
    # enable_v2=True with them, naming the flag).
    with EtcdServer(enable_v2=True if "v2" in args.apis else None) as server:
        served = "the v2 and v3 APIs" if server.enable_v2 else "the v3 API only"
        print(
            f"etcd {server.version} at {server.get_endpoint()} serving {served}; "
            f"{os.cpu_count()} CPUs shared with other work, so the seconds are noisy; "
            f"median of {args.repeat} rendezvous per row"
        )
        print(
            f"{'backend':<8} {'API':<3} {'impl':<5} {'N':>3} {'seconds':>8} "
            f"{'writes/node':>11} {'reads/node':>10} {'keep-alive/node':>15}"
        )
        for nodes in args.nodes:
            for variant in variants(args.backends, args.apis, impls):
                results = [measure(server, variant, nodes) for _ in range(args.repeat)]
                print(row(variant, nodes, results), flush=True)
                if args.breakdown:
                    print(breakdown(nodes, results), flush=True)
    thread_errors.report()


if __name__ == "__main__":
    main()
