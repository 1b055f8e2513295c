"""The training script of the fault harness's ``torchrun`` agents (one worker an agent).

Run by ``torchrun`` as ``python -m chaos.train --chaos-records FILE --chaos-stop FILE
--chaos-node NAME --chaos-step-interval S --chaos-collective-timeout S`` (prefixed so
that torchrun, which also parses what follows the script, takes none of them for its
own abbreviated options). It writes the same records as a node
process (:mod:`chaos.records`), with the process group standing for the round:

* ``joined``: ``round`` is a token rank 0 draws and broadcasts (one per process
  group), ``rank``/``world_size`` the group's, ``call`` torchrun's restart count;
* ``world``: the agent name of every rank (``n<i>``), gathered through the group;
* ``step``: an all-reduce of ``rank + 1`` that summed to ``W (W + 1) / 2``
  (``overflow`` with the sum otherwise).

A collective that does not complete within ``--chaos-collective-timeout`` fails the worker,
and torchrun's agent restarts the group (a new rendezvous), as in a real job. When the
``--chaos-stop`` file exists, rank 0 says so through the next all-reduce and every worker
ends after it, so the agents finish together and shut the rendezvous down.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chaos-records", type=Path, required=True)
    parser.add_argument("--chaos-stop", type=Path, required=True)
    parser.add_argument("--chaos-node", required=True)
    parser.add_argument("--chaos-step-interval", type=float, default=0.5)
    parser.add_argument("--chaos-collective-timeout", type=float, default=10.0)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    records = open(args.chaos_records, "a", buffering=1)  # noqa: SIM115 (until the process ends)

    def record(ev: str, **fields: object) -> None:
        records.write(
            json.dumps({"t": time.monotonic(), "ev": ev, "node": args.chaos_node, **fields}) + "\n"
        )
        records.flush()

    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.chaos_collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    # Tensors only: the object collectives need NumPy, which PyTorch does not require.
    token = torch.tensor([uuid.uuid4().int >> 80 if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(token, src=0)
    round_ = f"g-{int(token.item()):012x}"
    record("joined", call=restart, round=round_, rank=rank, world_size=world, elapsed=0.0)
    mine = torch.tensor([int(args.chaos_node.lstrip("n"))], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine)
    members = [f"n{int(t.item())}" for t in gathered]
    record("world", round=round_, members=members, conflict=False)
    expected = world * (world + 1) / 2
    pause = threading.Event()
    for k in range(1_000_000):
        stop = 1.0 if rank == 0 and args.chaos_stop.exists() else 0.0
        total = torch.tensor([float(rank + 1), stop])
        dist.all_reduce(total)
        if total[0].item() != expected:
            record("overflow", round=round_, k=k, count=total[0].item())
        record("step", round=round_, k=k)
        if total[1].item() > 0:
            break
        pause.wait(args.chaos_step_interval)
    dist.destroy_process_group()
    records.close()


if __name__ == "__main__":
    main()
