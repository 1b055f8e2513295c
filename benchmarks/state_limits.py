"""At what number of nodes each backend's state outgrows etcd's request limit.

Usage::

    python benchmarks/state_limits.py [--host TEMPLATE] [--run-id ID]
        [--limits 1572864 4194304 10485760] [--verify LIMIT]

Builds real states with the backends' own encoders and prints, per backend and etcd API,
the bytes per node of the request that writes the state and the N at which that request
passes each limit. The states are the largest a first rendezvous of N nodes writes:

* ``etcd``: the final state, as the batch that admits the last worker writes it (the
  legacy admission planner: ``participants``, ``members``, ``keep_alives``), with the tag
  our workers add. Host names are not in it; the run id is, in every keep-alive key.
* ``etcd-v2``: the complete round (PyTorch's pickle of ``_RendezvousState``, in base64 as
  the backend stores it): every node a participant with its rank and a heartbeat, each
  on a host of its own named by ``--host`` (a Kubernetes pod's name by default).

What etcd counts (measured on etcd 3.4 to 3.7: a compare-and-swap of a value of L - 143
bytes on a 30-byte key is the largest accepted under ``--max-request-bytes L``):

* v3 API: the compare-and-swap transaction the transport sends (the key three times,
  the value, a lease), as the transport sizes it, plus 53 bytes of protobuf; the JSON
  gateway's base64 does not count.
* v2 API: ``--max-request-bytes`` does not apply. A write's form (the value
  percent-encoded, and on the legacy backend the previous value too, which its
  compare-and-swap compares) may not pass 10 MiB, Go's form limit, which no flag raises.

``--verify LIMIT`` starts an etcd (the default binary, or ``ETCD_BINARY_PATH``) with
``--max-request-bytes LIMIT`` and checks the prediction for that limit on the v3 API:
the state of N - 1 nodes is accepted, the state of N refused. The documentation's table
(docs, "etcd's limits") is this script's output.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from etcd_rendezvous._dynamic.state import _encode_state, _NodeDesc, _RendezvousState
from etcd_rendezvous._legacy.admission import Announced, plan_admission
from etcd_rendezvous._transport import v3_wire as wire
from etcd_rendezvous._transport.limits import DEFAULT_MAX_REQUEST_BYTES, V2_FORM_LIMIT
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    LegacyLayout,
    etcd_v2_state_key,
    new_member_name,
)

#: A pod of a Kubeflow PyTorchJob, by its DNS name (about 65 characters).
DEFAULT_HOST = "pytorchjob-llama-70b-worker-{i}.pytorchjob-llama-70b.default.svc"
#: The run id Kubeflow's training operator gives a job: its name.
DEFAULT_RUN_ID = "pytorchjob-llama-70b"
#: The process id of a torchrun agent in a container (small: it starts first).
AGENT_PID = 42
#: What etcd's protobuf adds to the keys and values of a compare-and-swap (measured).
PROTOBUF_BYTES = 53
#: A lease id as the transport sends it (every state write has one on v3).
LEASE = "7587883251244557074"
#: A modification index (the compare of a compare-and-swap).
INDEX = "1234567"
#: 1.5 MiB, 4 MiB, 10 MiB (where etcd warns).
LIMITS = (DEFAULT_MAX_REQUEST_BYTES, 4 * 1024 * 1024, 10 * 1024 * 1024)


def legacy_value(nodes: int, run_id: str) -> str:
    """The legacy backend's final state of ``nodes`` workers, as our batch writes it."""
    layout = LegacyLayout(DEFAULT_PREFIX, run_id)
    names = [new_member_name(0x5D2F189A41E07B3C * (i + 1) % (1 << 64)) for i in range(nodes)]
    entries = [
        Announced(1000 + i, name, layout.member_key("1", name)) for i, name in enumerate(names)
    ]
    opening = {"status": "joinable", "version": "1", "participants": []}
    write = plan_admission(opening, entries, min_workers=nodes, max_workers=nodes)
    if write is None or write.state["status"] != "final":
        raise RuntimeError(f"the admission of {nodes} workers did not complete the state")
    return json.dumps({**write.state, "tag": "5d2f189a41e07b3c"})


def dynamic_value(nodes: int, host: str) -> str:
    """The ``etcd-v2`` backend's complete round of ``nodes`` nodes, base64 as stored."""
    state = _RendezvousState()
    state.complete = True
    now = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)
    descs = sorted(_NodeDesc(host.format(i=i), AGENT_PID, 0) for i in range(nodes))
    for rank, node in enumerate(descs):
        state.participants[node] = rank
        state.last_heartbeats[node] = now
    return base64.b64encode(_encode_state(state)).decode()


def v3_request(key: str, value: str) -> int:
    """The bytes etcd counts of the transport's compare-and-swap of ``value`` on ``key``."""
    put = {"key": wire.b64(key), "value": wire.b64(value), "lease": LEASE}
    _, size = wire.request_size(wire.guarded_txn(key, int(INDEX), {"request_put": put}))
    return size + PROTOBUF_BYTES


def v2_form(value: str, previous: bool) -> int:
    """The form of a v2 compare-and-swap of ``value`` (with it as the previous value too,
    as the legacy backend compares it)."""
    fields = {"value": value, "prevIndex": INDEX, "ttl": "7200"}
    if previous:
        fields["prevValue"] = value
    return len(urllib.parse.urlencode(fields))


@dataclass(frozen=True)
class Row:
    """One backend over one API: the request's size for N nodes."""

    backend: str
    api: str
    request: Callable[[int], int]


def rows(host: str, run_id: str) -> list[Row]:
    """The four rows, each sizing its requests once per N."""
    legacy_key = LegacyLayout(DEFAULT_PREFIX, run_id).state_key
    dynamic_key = etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX)
    return [
        Row("etcd", "v3", cache(lambda n: v3_request(legacy_key, legacy_value(n, run_id)))),
        Row("etcd", "v2", cache(lambda n: v2_form(legacy_value(n, run_id), previous=True))),
        Row("etcd-v2", "v3", cache(lambda n: v3_request(dynamic_key, dynamic_value(n, host)))),
        Row("etcd-v2", "v2", cache(lambda n: v2_form(dynamic_value(n, host), previous=False))),
    ]


def cache(size: Callable[[int], int]) -> Callable[[int], int]:
    """``size``, computed once per N."""
    return functools.lru_cache(maxsize=None)(size)


def first_over(request: Callable[[int], int], limit: int) -> int:
    """The smallest N whose request is over ``limit``. The size grows by about the same
    for each node (a digit more now and then): from the slope between two encodings, the
    guess is refined on encodings near it, then settled by the states around it."""
    guess = 1000
    for _ in range(4):
        here, there = request(guess), request(guess + 64)
        guess = max(2, guess + int((limit - here) * 64 / (there - here)))
    while request(guess) <= limit:
        guess += 1
    while guess > 2 and request(guess - 1) > limit:
        guess -= 1
    return guess


def per_node(request: Callable[[int], int]) -> float:
    return (request(2000) - request(1000)) / 1000


def verify(limit: int, host: str, run_id: str) -> None:
    """Write the v3 states around the predicted N into an etcd with ``limit``."""
    from etcd_rendezvous._transport.v3 import EtcdV3Connection  # noqa: PLC0415
    from etcd_rendezvous.api import RequestTooLargeError  # noqa: PLC0415
    from etcd_rendezvous.etcd_server import EtcdServer  # noqa: PLC0415

    args = ["--max-request-bytes", str(limit)]
    with EtcdServer(enable_v2=False, extra_args=args) as server:
        conn = EtcdV3Connection([(server.get_host(), server.get_port())], read_timeout=30)
        for row in rows(host, run_id):
            if row.api != "v3":
                continue
            n = first_over(row.request, limit)
            key = (
                LegacyLayout(DEFAULT_PREFIX, run_id).state_key
                if row.backend == "etcd"
                else etcd_v2_state_key(run_id, ETCD_V2_STATE_PREFIX)
            )
            value = legacy_value if row.backend == "etcd" else dynamic_value
            arg = run_id if row.backend == "etcd" else host
            outcomes = []
            for nodes in (n - 1, n):
                node = conn.create(f"{key}-{nodes}", "0", ttl=600)
                try:
                    conn.compare_and_swap(node.key, value(nodes, arg), node, ttl=600)  # type: ignore[operator]
                    outcomes.append("accepted")
                except RequestTooLargeError:
                    outcomes.append("refused")
            ok = outcomes == ["accepted", "refused"]
            verdict = "as predicted" if ok else "NOT AS PREDICTED"
            print(f"{row.backend:8} v3  N={n - 1}: {outcomes[0]}, N={n}: {outcomes[1]}  {verdict}")
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default=DEFAULT_HOST, help="host name template ({i}: node)")
    parser.add_argument("--run-id", default=DEFAULT_RUN_ID)
    parser.add_argument("--limits", type=int, nargs="+", default=list(LIMITS))
    parser.add_argument("--verify", type=int, metavar="LIMIT")
    args = parser.parse_args()
    if args.verify:
        verify(args.verify, args.host, args.run_id)
        return
    host = args.host.format(i=1234)
    print(f"host names like {host!r} ({len(host)} characters); run id {args.run_id!r}")
    heads = [f"over {limit:,}" for limit in args.limits] + [f"v2 form {V2_FORM_LIMIT:,}"]
    print(f"{'backend':8} {'API':3} {'bytes/node':>10}  " + "  ".join(f"{h:>17}" for h in heads))
    for row in rows(args.host, args.run_id):
        limits = [None] * len(args.limits) + [V2_FORM_LIMIT]
        if row.api == "v3":
            limits = [*args.limits, None]
        cells = ["-" if lim is None else f"{first_over(row.request, lim):,}" for lim in limits]
        print(
            f"{row.backend:8} {row.api:3} {per_node(row.request):>10.1f}  "
            + "  ".join(f"{cell:>17}" for cell in cells)
        )


if __name__ == "__main__":
    main()
