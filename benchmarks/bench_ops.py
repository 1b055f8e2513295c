"""``status`` and the dashboard on runs of 4,096 members, on both backends and APIs.

Usage::

    python benchmarks/bench_ops.py [--members 4096]

The runs are written straight into etcd with the library's encoders
(``tests/support/large_runs.py``): an ``etcd`` run (a final state, a keep-alive and a
member key per rank) and an ``etcd-v2`` run (a complete state, a heartbeat and a node
key per node). One etcd 3.5 serves both APIs. Measured, each the best of 3:
``status`` (summary) and ``status -v`` in this process, the dashboard's read of one run
(what it does at each change of the run), and its JSON answers for the run list and
one page of 100 members (what the browser asks for every second).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous._transport.options import create_etcd_connection
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.cli import main
from etcd_rendezvous.cli._dashboard.follow import Snapshot, Source
from etcd_rendezvous.cli._dashboard.model import observe
from etcd_rendezvous.cli._dashboard.views import run_view, runs_view
from etcd_rendezvous.etcd_server import EtcdServer
from support.large_runs import write_etcd_v2_run, write_legacy_run


def best(call: Callable[[], object], tries: int = 3) -> float:
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def status(endpoint: str, api: str, *args: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["status", "--endpoint", endpoint, "--etcd-api", api, *args])
    if code != 0:
        raise SystemExit(f"status {args} exited {code}")


def measure(conn: Transport, endpoint: str, backend: str, run_id: str) -> str:
    """One row: the times of ``status`` and of the dashboard on run ``run_id``."""
    source = Source.default(backend)
    args = ["--run-id", run_id, "--backend", backend]
    summary = best(functools.partial(status, endpoint, conn.api, *args))
    verbose = best(functools.partial(status, endpoint, conn.api, *args, "-v"))
    read = best(functools.partial(source.read, conn, run_id))
    got = source.read(conn, run_id)
    assert got is not None
    record = observe(None, got, time.monotonic())
    snapshot = Snapshot({(backend, run_id): record}, None, None, 0.0, (source,))
    now = time.monotonic()
    listing = best(functools.partial(runs_view, snapshot, now))
    page = best(functools.partial(run_view, snapshot, backend, run_id, now, offset=2000))
    return (
        f"{conn.api:4} {backend:8} {summary:8.2f} {verbose:10.2f} {read:9.2f} "
        f"{listing:10.4f} {page:10.4f}"
    )


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4096)
    members = parser.parse_args().members
    print(
        f"{'api':4} {'backend':8} {'status':>8} {'status -v':>10} {'read run':>9} "
        f"{'list json':>10} {'page json':>10}  (seconds, best of 3; {members} members)"
    )
    with EtcdServer(enable_v2=True) as server:
        endpoint = server.get_endpoint()
        for api in ("v2", "v3"):
            params = RendezvousParameters("etcd", endpoint, "bench", 1, 1, etcd_api=api)
            with create_etcd_connection(params) as conn:
                legacy, v2 = f"big-{api}", f"big2-{api}"
                write_legacy_run(conn, Source.default("etcd").prefix, legacy, members)
                write_etcd_v2_run(conn, Source.default("etcd-v2").prefix, v2, members)
                print(measure(conn, endpoint, "etcd", legacy))
                print(measure(conn, endpoint, "etcd-v2", v2))


if __name__ == "__main__":
    main_()
