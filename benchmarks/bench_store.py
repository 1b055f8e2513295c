"""Time ``EtcdStore.get`` of a present key with 10 vs 2,000 keys in the store: ours vs torch.

Usage::

    python benchmarks/bench_store.py [--sizes 10 2000] [--gets 300]

Starts its own etcd (bundled etcd 3.5 unless ``ETCD_BINARY_PATH`` says otherwise), fills
one store directory per size, then times ``--gets`` sequential ``get`` calls of one key
with each implementation (PyTorch's only if torch is installed) and prints the mean
latency. PyTorch 2.13's ``get`` reads the whole store directory on every call; ours
reads the one key, so its cost does not depend on how many keys the store holds.

Results: ``docs/scale.rst``, section Results (reading the store).
"""

from __future__ import annotations

import argparse
import importlib
import time
import uuid
from typing import Any

from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore


def fill(store: EtcdStore, count: int) -> None:
    """Write ``count`` keys (``key-0`` ...) into ``store``."""
    store.multi_set([f"key-{i}" for i in range(count)], [f"value-{i}" * 4 for i in range(count)])


def time_gets(store: Any, key: str, gets: int) -> float:
    """Mean seconds per ``store.get(key)`` over ``gets`` calls (after one warm-up)."""
    store.get(key)
    start = time.perf_counter()
    for _ in range(gets):
        store.get(key)
    return (time.perf_counter() - start) / gets


def _torch_store_class() -> Any:
    """PyTorch's ``EtcdStore`` class, or ``None`` without torch."""
    try:
        module = importlib.import_module("torch.distributed.elastic.rendezvous.etcd_store")
    except ImportError:
        return None
    return module.EtcdStore


def main() -> None:
    """Run the benchmark and print a table of mean latencies in milliseconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 2000])
    parser.add_argument("--gets", type=int, default=300)
    args = parser.parse_args()

    torch_store_class = _torch_store_class()

    with EtcdServer() as server:
        conn = EtcdConnection([(server.get_host(), server.get_port())])
        print(f"etcd {server.version}, {args.gets} gets per cell, mean ms per get")
        print(f"{'keys':>6}  {'ours':>8}  {'torch':>8}")
        for size in args.sizes:
            prefix = f"/bench/store-{size}-{uuid.uuid4().hex[:8]}"
            ours = EtcdStore(conn, prefix)
            fill(ours, size)
            key = f"key-{size // 2}"
            ours_ms = time_gets(ours, key, args.gets) * 1e3
            torch_cell = "n/a"
            if torch_store_class is not None:
                theirs = torch_store_class(server.get_client(), prefix)
                torch_cell = f"{time_gets(theirs, key, args.gets) * 1e3:8.2f}"
            print(f"{size:>6}  {ours_ms:8.2f}  {torch_cell:>8}")
        conn.close()


if __name__ == "__main__":
    main()
