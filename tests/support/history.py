"""Making etcd forget its history, so that a watch from an old index or revision fails."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from etcd_rendezvous._transport.interface import Transport
from support import v3_gateway

__all__ = ["EVENT_HISTORY", "forget_history"]

#: etcd v2 keeps the last 1000 events; a watch from an older index is refused.
EVENT_HISTORY = 1000


def forget_history(conn: Transport, client_url: str, key: str) -> None:
    """Make the etcd at ``client_url`` forget every change made so far and the next one,
    writing only ``key`` through ``conn``: on v2 by more than :data:`EVENT_HISTORY`
    writes, on v3 by compacting at the second of two writes (a compaction keeps the
    revision it compacts at)."""
    if conn.api == "v2":
        with ThreadPoolExecutor(8, thread_name_prefix="history-filler") as pool:
            list(pool.map(lambda i: conn.set(key, str(i)), range(EVENT_HISTORY + 50)))
        return
    conn.set(key, "0")
    revision = conn.set(key, "1").modified_index
    v3_gateway.call(client_url, "/v3/kv/compaction", {"revision": str(revision)})
