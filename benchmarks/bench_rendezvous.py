"""Time a full rendezvous of N worker processes: ours vs PyTorch 2.13's ``etcd`` backend.

Usage::

    python benchmarks/bench_rendezvous.py [--nodes 4 64] [--repeat 3] [--impl ours torch]

Each worker process is started and connected first (imports and handler creation are
not timed); then every worker is told to join at once, and the time from the first
``join`` to the last worker holding its rank is reported (min/median over repeats, each
on a fresh run id). etcd is started by the script (bundled etcd 3.5 unless
``ETCD_BINARY_PATH`` says otherwise).

Results of the rendezvous benchmarks are in ``docs/scale.rst`` (section Results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _bench_common import join_round, ready_workers

from etcd_rendezvous.etcd_server import EtcdServer
from support.rdzv import Worker


def one_round(server: EtcdServer, impl: str, nodes: int) -> float:
    """Seconds from the first ``join`` to the last rank, for ``nodes`` fresh workers."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    endpoint = server.get_endpoint()
    with ready_workers(
        lambda: Worker(endpoint, run_id, nodes, nodes, impl=impl, timeout=300), nodes
    ) as workers:
        return join_round(workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--impl", nargs="+", default=["ours", "torch"], choices=["ours", "torch"])
    args = parser.parse_args()

    with EtcdServer() as server:
        print(f"etcd {server.version} at {server.get_endpoint()}")
        print(f"{'impl':<6} {'nodes':>5} {'min s':>8} {'median s':>9}")
        for nodes in args.nodes:
            for impl in args.impl:
                times = [one_round(server, impl, nodes) for _ in range(args.repeat)]
                print(f"{impl:<6} {nodes:>5} {min(times):>8.3f} {statistics.median(times):>9.3f}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
