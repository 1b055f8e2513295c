"""Count the etcd requests one rendezvous of N workers costs (from etcd's /metrics).

Usage::

    python benchmarks/rendezvous_requests.py [--nodes 32] [--impl ours|torch]

Requests per node, measured by ``bench_scale.py``: ``docs/scale.rst``.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _bench_common import join_round, ready_workers

from etcd_rendezvous.etcd_server import EtcdServer
from support.etcd_requests import changes, read_metrics
from support.rdzv import Worker

_COUNTERS = ("etcd_http_received_total", "etcd_debugging_store_writes_total")


def main() -> None:
    """Run one rendezvous and print the counters it moved."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--impl", choices=("ours", "torch"), default="ours")
    args = parser.parse_args()
    with EtcdServer() as server:
        run_id = f"count-{uuid.uuid4().hex[:8]}"
        endpoint = server.get_endpoint()
        with ready_workers(
            lambda: Worker(endpoint, run_id, args.nodes, args.nodes, impl=args.impl),
            args.nodes,
        ) as workers:
            before = read_metrics(server.client_url)
            elapsed = join_round(workers)
            after = read_metrics(server.client_url)
    print(f"{args.impl}, {args.nodes} nodes: {elapsed:.2f} s")
    for sample, change in sorted(changes(before, after).items()):
        if sample.startswith(_COUNTERS):
            print(f"  {sample} {int(change)}")


if __name__ == "__main__":
    main()
