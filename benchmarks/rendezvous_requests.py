"""Count the etcd requests one rendezvous of N workers costs (from etcd's /metrics).

Usage::

    python benchmarks/rendezvous_requests.py [--nodes 32] [--impl ours|torch]

Measured on 2026-11-23 (etcd 3.5.1, 32 nodes): ours 475 GET + 448 PUT requests;
torch 2.13: 1286 GET + 389 PUT.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from etcd_rendezvous.etcd_server import EtcdServer
from rdzv_helpers import Worker

_COUNTERS = ("etcd_http_received_total", "etcd_debugging_store_writes_total")


def metrics(server: EtcdServer) -> dict[str, float]:
    text = urllib3.PoolManager().request("GET", server.client_url + "/metrics").data.decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(_COUNTERS):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--impl", choices=("ours", "torch"), default="ours")
    args = parser.parse_args()
    with EtcdServer() as server:
        run_id = f"count-{uuid.uuid4().hex[:8]}"
        workers = [
            Worker(server.get_endpoint(), run_id, args.nodes, args.nodes, impl=args.impl)
            for _ in range(args.nodes)
        ]
        try:
            for worker in workers:
                worker.wait_ready(timeout=300)
            before = metrics(server)
            started = time.monotonic()
            for worker in workers:
                worker.send("join")
            for worker in workers:
                event = worker.next_event(timeout=300)
                if event["event"] != "joined":
                    raise RuntimeError(f"worker failed: {event}")
            elapsed = time.monotonic() - started
            after = metrics(server)
        finally:
            for worker in workers:
                worker.stop()
    print(f"{args.impl}, {args.nodes} nodes: {elapsed:.2f} s")
    for name, value in sorted(after.items()):
        if value - before.get(name, 0):
            print(f"  {name} {int(value - before.get(name, 0))}")


if __name__ == "__main__":
    main()
