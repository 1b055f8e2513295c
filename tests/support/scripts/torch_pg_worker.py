"""One process of a gloo process group built on this package's store (for test_torch_store).

``store ENDPOINT PREFIX RANK WORLD``: ``init_process_group(store=TorchEtcdStore(...))``.
``handler BACKEND ENDPOINT RUN_ID WORLD``: a handler from PyTorch's own registry (so
through our ``torchrun.handlers`` entry points), then
``init_process_group(store=info.store)``.

Prints one JSON line: rank, world size, the all-reduced sum and the store's type.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def _all_reduce(store: object, rank: int, world_size: int) -> float:
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    return float(total.item())


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "store":
        from etcd_rendezvous._transport.connect import open_transport
        from etcd_rendezvous.etcd_store import EtcdStore
        from etcd_rendezvous.torch_store import TorchEtcdStore

        endpoint, prefix, rank_arg, world_arg = args
        host, port = endpoint.rsplit(":", 1)
        # Over whichever API the server serves (etcd_api=auto); the store owns it.
        conn = open_transport([(host, int(port))])
        etcd_store = EtcdStore(conn, prefix, timeout=timedelta(seconds=60), owns_connection=True)
        store = TorchEtcdStore(etcd_store)
        rank, world_size = int(rank_arg), int(world_arg)
        handler = None
    else:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        backend, endpoint, run_id, world_arg = args
        params = RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=int(world_arg),
            max_nodes=int(world_arg),
            local_addr="127.0.0.1",
            last_call_timeout="1",
            read_timeout="10",
        )
        handler = get_rendezvous_handler(params)
        info = handler.next_rendezvous()
        store, rank, world_size = info.store, info.rank, info.world_size

    result = {
        "rank": rank,
        "world_size": world_size,
        "store_type": type(store).__name__,
        "is_torch_store": isinstance(store, dist.Store),
        "backend": handler.get_backend() if handler is not None else None,
        "handler_module": type(handler).__module__ if handler is not None else None,
    }
    result["sum"] = _all_reduce(store, rank, world_size)
    if handler is not None:
        handler.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
