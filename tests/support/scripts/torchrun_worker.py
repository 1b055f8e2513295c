"""A tiny data-parallel "training" script for the torchrun tests.

Run by ``torchrun`` (one process per ``--nproc-per-node``). Each step all-reduces
``rank + 1`` over gloo and checks the sum ``W * (W + 1) / 2``. Rank 0 checkpoints the
step count in ``--out``, so a worker group restarted by the elastic agent resumes where
the previous one stopped, as real training resumes from a checkpoint.

Files written in ``--out``:

* ``progress-<restart>-<rank>.json`` after every step (what the tests wait on), with the
  wall-clock time of this worker's first step (``first_step_at``);
* ``result-<agent>-<restart>-<local_rank>.json`` when the run finishes;
* ``checkpoint.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    env = os.environ
    restart = int(env["TORCHELASTIC_RESTART_COUNT"])
    agent = env.get("TEST_AGENT_ID", "agent")
    # env:// rendezvous: MASTER_ADDR/PORT come from the rendezvous' bootstrap store info
    # (the agent's shared TCPStore when TORCHELASTIC_USE_AGENT_STORE is True).
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    checkpoint = args.out / "checkpoint.json"
    start = json.loads(checkpoint.read_text())["step"] if checkpoint.exists() else 0
    total = torch.zeros(1)
    first_step_at: float | None = None
    for step in range(start, args.steps):
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        expected = world_size * (world_size + 1) / 2
        if total.item() != expected:
            raise SystemExit(f"rank {rank}: all_reduce gave {total.item()}, expected {expected}")
        first_step_at = first_step_at or time.time()
        _write_json(
            args.out / f"progress-{restart}-{rank}.json",
            {
                "step": step,
                "world_size": world_size,
                "agent": agent,
                "pid": os.getpid(),
                "first_step_at": first_step_at,
            },
        )
        if rank == 0:
            _write_json(checkpoint, {"step": step + 1})
        time.sleep(args.step_seconds)  # the "compute" of a training step

    _write_json(
        args.out / f"result-{agent}-{restart}-{env['LOCAL_RANK']}.json",
        {
            "agent": agent,
            "restart": restart,
            "rank": rank,
            "world_size": world_size,
            "env_world_size": int(env["WORLD_SIZE"]),
            "group_rank": int(env["GROUP_RANK"]),
            "group_world_size": int(env["GROUP_WORLD_SIZE"]),
            "sum": total.item(),
            "resumed_from": start,
            "use_agent_store": env["TORCHELASTIC_USE_AGENT_STORE"],
            "run_id": env["TORCHELASTIC_RUN_ID"],
            "finished_at": time.time(),
        },
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
