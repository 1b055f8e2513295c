"""How long our legacy workers take to confirm a version that PyTorch 2.13's worker froze.

Usage::

    python benchmarks/bench_frozen_confirm.py [--runs 10] [--ours 1] [--load 0]

Our workers (``--ours``, admitted first) wait in a joinable version that stays quiet for
a random 10 to 22 s, long enough for their silence to back off; then a PyTorch worker
joins, reaches ``max_workers`` and freezes the state with an empty ``keep_alives``
(a TTL of 10 s, ``CONST_ETCD_FROZEN_TTL``) and confirms itself. PyTorch's workers write
no progress hint, so ours learn of the freeze only by reading the state after a
silence, and one of them then confirms all of ours. A watch on the state key times the
gap from PyTorch's last write (the frozen state lapses 10 s after it) to the write that
confirms our members; the margin is 10 s minus that gap. ``--load N`` runs N processes
that spin on the CPU meanwhile. etcd 3.5 over v2 (PyTorch's backend speaks only v2) is
started by the script unless ``ETCD_BINARY_PATH`` says otherwise.

Results are in ``docs/how-it-works.rst`` (the progress key of the ``etcd`` backend).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from etcd_rendezvous._legacy.state import CONST_ETCD_FROZEN_TTL
from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.layout import DEFAULT_PREFIX, LegacyLayout
from support.rdzv import Worker
from support.wait import wait_for_state

#: A CPU burner: spins until killed, or for 15 minutes at most.
_SPIN = "import time\nend = time.time() + 900\nwhile time.time() < end:\n    pass\n"


def one_run(server: EtcdServer, conn: Transport, ours: int) -> tuple[float, float | None, str]:
    """The quiet wait before the freeze, the gap from PyTorch's last write to our
    confirmation (``None``: there was none) and how the version ended."""
    run_id = f"bench-frozen-{uuid.uuid4().hex[:8]}"
    key = LegacyLayout(DEFAULT_PREFIX, run_id).state_key
    size = ours + 1
    ep = server.get_endpoint()
    group = [Worker(ep, run_id, size, size, impl="ours", timeout=120) for _ in range(ours)]
    closer = Worker(ep, run_id, size, size, impl="torch", timeout=120)
    try:
        for worker in [*group, closer]:
            worker.wait_ready(120)
        for worker in group:
            worker.send("join")
        wait_for_state(
            conn, key, lambda s: s is not None and len(s.get("participants", [])) == ours
        )
        quiet = random.uniform(10, 22)
        time.sleep(quiet)  # the state stays quiet: our workers' silence backs off
        with conn.watch_stream(key, conn.get(key).etcd_index + 1) as stream:
            closer.send("join")
            last_torch, confirmed, outcome = None, None, "no end within 60 s"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                change = stream.next(Deadline(1.0))
                if change is None:
                    continue
                now = time.monotonic()
                state = json.loads(change.value) if change.value else None
                if state is None:
                    outcome = f"the state was {change.action}d: the version restarts"
                    break
                if any("/node_" in k for k in state.get("keep_alives", [])):
                    confirmed = confirmed or now
                elif state["status"] == "frozen":
                    last_torch = now
                if state["status"] == "final":
                    outcome = "final"
                    break
        gap = None if confirmed is None or last_torch is None else confirmed - last_torch
        return quiet, gap, outcome
    finally:
        for worker in [*group, closer]:
            worker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ours", type=int, default=1, help="our workers in the version")
    parser.add_argument("--load", type=int, default=0, help="CPU-spinning processes")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(args.load)]
    try:
        with EtcdServer(enable_v2=True) as server:
            conn = open_transport([(server.get_host(), server.get_port())], read_timeout=10)
            print(f"etcd {server.version}; {args.ours} of ours; load {args.load}", flush=True)
            gaps = []
            for n in range(args.runs):
                quiet, gap, outcome = one_run(server, conn, args.ours)
                shown = "-" if gap is None else f"{gap:5.2f} s"
                print(
                    f"run {n}: quiet {quiet:4.1f} s, confirmed {shown} after PyTorch's last "
                    f"write; {outcome}",
                    flush=True,
                )
                if gap is not None:
                    gaps.append(gap)
            conn.close()
    finally:
        for burner in burners:
            burner.kill()
    if gaps:
        worst = max(gaps)
        print(
            f"{len(gaps)}/{args.runs} confirmed: mean {sum(gaps) / len(gaps):.2f} s, "
            f"max {worst:.2f} s, least margin {CONST_ETCD_FROZEN_TTL - worst:.2f} s"
        )


if __name__ == "__main__":
    main()
