"""Runs of thousands of members written straight into etcd, with the library's own
encoders, for measuring and testing what reads them (``status``, the dashboard)
without starting thousands of workers.

An ``etcd`` run: a final state (JSON, as the legacy backend writes it, with our
``members`` field) and, in its version directory, a keep-alive key per rank and a member
key per worker (each with a TTL, as live workers keep them). An ``etcd-v2`` run: a
complete state (pickled by the dynamic rendezvous' encoder) with every node a
participant and a heartbeat, and one node key per node (with a TTL).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from etcd_rendezvous._dynamic.state import _encode_state, _NodeDesc, _RendezvousState
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend
from etcd_rendezvous.layout import LegacyLayout

__all__ = ["write_etcd_v2_run", "write_legacy_run"]

#: TTL of the member and node keys written: long enough for a measurement.
KEY_TTL = 600
#: Concurrent writes (each a request of its own).
_WRITERS = 16


def _write_all(conn: Transport, keys: list[tuple[str, str]], ttl: int) -> None:
    with ThreadPoolExecutor(_WRITERS) as pool:
        list(pool.map(lambda item: conn.set(item[0], item[1], ttl=ttl), keys))


def write_legacy_run(conn: Transport, prefix: str, run_id: str, members: int) -> str:
    """A final version 1 of ``members`` workers (ranks 0 .. members-1); returns the
    state key."""
    layout = LegacyLayout(prefix, run_id)
    version = "1"
    names = [f"node_{rank:016x}" for rank in range(members)]
    keys = [(layout.keep_alive_key(version, rank), "") for rank in range(members)]
    keys += [
        (layout.member_key(version, name), json.dumps({"host": f"host-{rank}", "pid": 1000 + rank}))
        for rank, name in enumerate(names)
    ]
    _write_all(conn, keys, KEY_TTL)
    state = {
        "status": "final",
        "version": version,
        "participants": list(range(members)),
        "keep_alives": [layout.keep_alive_key(version, rank) for rank in range(members)],
        "num_workers_waiting": 0,
        "members": {name: rank for rank, name in enumerate(names)},
    }
    conn.set(layout.counter_key, version)
    conn.set(layout.state_key, json.dumps(state))
    return layout.state_key


def write_etcd_v2_run(conn: Transport, prefix: str, run_id: str, members: int) -> str:
    """A complete round 1 of ``members`` nodes, each with a heartbeat of now and a node
    key; returns the state key."""
    backend = EtcdRendezvousBackend(conn, run_id, key_prefix=prefix)
    nodes = [_NodeDesc(f"host-{i}", 1000 + i, 0) for i in range(members)]
    state = _RendezvousState()
    state.round = 1
    state.complete = True
    state.participants = {node: rank for rank, node in enumerate(nodes)}
    now = datetime.now(timezone.utc)
    state.last_heartbeats = dict.fromkeys(nodes, now)
    with ThreadPoolExecutor(_WRITERS) as pool:
        list(pool.map(lambda node: backend.announce_node(node, KEY_TTL), nodes))
    backend.set_state(_encode_state(state))
    return backend.key
