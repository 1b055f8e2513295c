"""A leader change is a non-event: both backends against a real 3-member etcd cluster.

The leader is SIGKILLed while workers join, while keep-alives and heartbeats are due,
and while the workers add to a store counter. Every worker lists all three members,
each in another order, so that some talk to the leader (their requests die with it)
and some to a follower (their writes wait out etcd's request timeout, then go
elsewhere). The outcome must be as if nothing had happened: one consistent set of
ranks, no worker dropped as dead, and every increment counted exactly once.

The cluster serves the API under test (``ETCD_RENDEZVOUS_ETCD_API``; the handlers pick
it with ``etcd_api=auto``).
"""

from __future__ import annotations

import json
import threading
import time
from base64 import b64decode
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import Any

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, decode_state
from etcd_rendezvous.etcd_cluster import EtcdCluster, EtcdClusterMember
from etcd_rendezvous.etcd_rendezvous import CONST_WORKER_KEEPALIVE_TTL, EtcdRendezvousHandler
from etcd_rendezvous.layout import (
    LegacyLayout,
    normalize_key,
)
from etcd_rendezvous.registry import get_rendezvous_handler
from support.closing import closing_factory
from support.rdzv import state_key
from support.wait import wait_for_value, wait_until

BACKENDS = ("etcd", "etcd-v2")
#: The rendezvous timeout: long enough to wait out an election (etcd's request timeout
#: is 6 s in the test cluster) several times over.
TIMEOUT = 90
#: Heartbeat settings of the dynamic rendezvous: a node is dead after 2 s x 5 = 10 s.
KEEP_ALIVE_INTERVAL = 2
KEEP_ALIVE_MAX_ATTEMPT = 5


# -- helpers ----------------------------------------------------------------------------


def _endpoints(cluster: EtcdCluster, worker: int) -> str:
    """All members, the leader first for worker 0, then rotated by one per worker."""
    leader = cluster.wait_for_leader()
    members = [leader] + [m for m in cluster.members if m is not leader]
    shift = worker % len(members)
    return ",".join(m.endpoint for m in members[shift:] + members[:shift])


def _params(backend: str, endpoint: str, run_id: str, nodes: int) -> RendezvousParameters:
    config: dict[str, Any]
    if backend == "etcd":
        config = {"timeout": TIMEOUT, "last_call_timeout": 1}
    else:
        config = {
            "join_timeout": TIMEOUT,
            "last_call_timeout": 1,
            "keep_alive_interval": KEEP_ALIVE_INTERVAL,
            "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPT,
        }
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        local_addr="127.0.0.1",
        torch_store="false",
        **config,
    )


class Workers:
    """Handlers of one run, one per worker, each joining in a thread of its own."""

    def __init__(self, cluster: EtcdCluster, backend: str, run_id: str, nodes: int) -> None:
        self.backend = backend
        self.handlers: list[RendezvousHandler] = [
            get_rendezvous_handler(_params(backend, _endpoints(cluster, i), run_id, nodes))
            for i in range(nodes)
        ]
        self.infos: dict[int, RendezvousInfo] = {}
        self.errors: dict[int, BaseException] = {}
        self._threads: dict[int, threading.Thread] = {}

    def join(self, worker: int) -> None:
        """Start ``next_rendezvous()`` of ``worker`` in a thread."""

        def run() -> None:
            try:
                self.infos[worker] = self.handlers[worker].next_rendezvous()
            except BaseException as exc:  # reported by wait()
                self.errors[worker] = exc

        thread = threading.Thread(target=run, name=f"worker-{worker}", daemon=True)
        self._threads[worker] = thread
        thread.start()

    def join_all(self) -> list[RendezvousInfo]:
        """Every worker joins at once; their results in worker order."""
        for worker in range(len(self.handlers)):
            self.join(worker)
        return self.wait()

    def wait(self, timeout: float = TIMEOUT + 30) -> list[RendezvousInfo]:
        """Wait for every started worker; return their results in worker order."""
        deadline = time.monotonic() + timeout
        for thread in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not self.errors, self.errors
        assert len(self.infos) == len(self._threads), "a worker never returned"
        return [self.infos[i] for i in sorted(self.infos)]

    def close(self) -> None:
        for handler in self.handlers:
            handler.close()


@pytest.fixture
def workers_factory(etcd_cluster: EtcdCluster) -> Iterator[Callable[..., Workers]]:
    """``make(backend, run_id, nodes)``: the handlers of one run on ``etcd_cluster``,
    closed after the test."""
    with closing_factory(partial(Workers, etcd_cluster), Workers.close) as make:
        yield make


@pytest.fixture
def observer(etcd_cluster: EtcdCluster) -> Iterator[Transport]:
    """A connection of the test itself to every member (a follower first)."""
    members = etcd_cluster.members
    with open_transport([(m.host, m.port) for m in reversed(members)], read_timeout=10) as conn:
        yield conn


def _participants(backend: str, value: str | None) -> int:
    """How many workers joined, according to a state key's value."""
    if value is None:
        return 0
    if backend == "etcd":
        return len(json.loads(value).get("participants", []))
    return len(decode_state(b64decode(value), "test").participants)


def _assert_one_group(infos: list[RendezvousInfo], nodes: int) -> None:
    """Every worker got its own rank in one world of ``nodes``, in the same round."""
    assert sorted(info.rank for info in infos) == list(range(nodes))
    assert {info.world_size for info in infos} == {nodes}
    assert len({info.bootstrap_store_info.master_addr for info in infos}) == 1
    assert len({info.bootstrap_store_info.master_port for info in infos}) == 1


def _kill_leader(cluster: EtcdCluster) -> tuple[EtcdClusterMember, float]:
    killed = cluster.kill_leader()
    return killed, time.monotonic()


# -- the leader dies while workers join -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_leader_killed_while_workers_join(
    backend: str,
    etcd_cluster: EtcdCluster,
    workers_factory: Callable[..., Workers],
    observer: Transport,
    run_id: str,
) -> None:
    workers = workers_factory(backend, run_id, 3)
    key = state_key(backend, run_id)
    workers.join(0)
    workers.join(1)
    wait_for_value(observer, key, lambda value: _participants(backend, value) == 2, 60)
    _kill_leader(etcd_cluster)
    workers.join(2)
    infos = workers.wait()
    _assert_one_group(infos, 3)


# -- the leader dies while keep-alives are due ------------------------------------------


def test_leader_killed_while_keep_alives_are_due(
    etcd_cluster: EtcdCluster,
    workers_factory: Callable[..., Workers],
    observer: Transport,
    run_id: str,
) -> None:
    workers = workers_factory("etcd", run_id, 2)
    workers.join_all()
    layout = LegacyLayout("/torchelastic/p2p", run_id)
    state = json.loads(observer.get(layout.state_key).value or "")
    keys = [normalize_key(k) for k in state["keep_alives"]]
    half = CONST_WORKER_KEEPALIVE_TTL / 2
    # Each key is refreshed when half its TTL is left: kill the leader just then.
    wait_until(
        lambda: min(ttl or 0 for ttl in _live_ttls(observer, keys)) <= half + 1,
        what="a keep-alive refresh falling due",
    )
    _, killed_at = _kill_leader(etcd_cluster)

    # Every key lives on, refreshed after the election: without a refresh, more than
    # half a TTL after the kill each would have less than half a TTL left (and soon be
    # gone, the worker dropped as dead by the next one to arrive).
    def refreshed_after_kill() -> bool:
        ttls = _live_ttls(observer, keys)
        assert None not in ttls, f"a keep-alive key expired: {dict(zip(keys, ttls))}"
        late = time.monotonic() - killed_at > half
        return late and all(ttl is not None and ttl > half for ttl in ttls)

    wait_until(refreshed_after_kill, what="keep-alive refreshes after the leader was killed")
    after = json.loads(observer.get(layout.state_key).value or "")
    assert after["status"] == "final"
    assert after["version"] == state["version"]
    for handler in workers.handlers:
        assert isinstance(handler, EtcdRendezvousHandler)
        keeper = handler.rendezvous._lease_this_rank
        assert keeper is not None
        assert keeper.alive
        assert handler.num_nodes_waiting() == 0


def _live_ttls(conn: Transport, keys: list[str]) -> list[int | None]:
    """The TTLs of ``keys`` (``None`` for a key that is gone)."""
    ttls: list[int | None] = []
    for key in keys:
        node = conn.try_get(key)
        ttls.append(None if node is None else conn.time_to_live(node))
    return ttls


def test_leader_killed_while_heartbeats_are_due(
    etcd_cluster: EtcdCluster,
    workers_factory: Callable[..., Workers],
    observer: Transport,
    run_id: str,
) -> None:
    workers = workers_factory("etcd-v2", run_id, 2)
    workers.join_all()
    key = state_key("etcd-v2", run_id)
    nodes = {h._this_node for h in workers.handlers if isinstance(h, DynamicRendezvousHandler)}

    def state() -> Any:
        node = observer.get(key)
        return decode_state(b64decode(node.value or ""), key)

    interval = timedelta(seconds=KEEP_ALIVE_INTERVAL)
    first = state()
    # The heartbeats are dated on etcd's clock as the nodes estimate it from the Date of
    # its answers (whole seconds: within half a second at first), so an age read here
    # against this host's clock may be up to half a second short.
    due = interval * 0.8 - timedelta(seconds=0.5)
    wait_until(
        lambda: datetime.now(timezone.utc) - min(state().last_heartbeats.values()) >= due,
        what="a heartbeat falling due",
    )
    _kill_leader(etcd_cluster)
    killed_at = datetime.now(timezone.utc)
    lifetime = interval * KEEP_ALIVE_MAX_ATTEMPT

    # Both nodes keep beating through the election and past the lifetime a silent
    # node has, without ever being dropped from the round they completed.
    def beating_past_lifetime() -> bool:
        current = state()
        assert set(current.participants) == nodes, "a node was dropped as dead"
        assert current.round == first.round
        return min(current.last_heartbeats.values()) > killed_at + lifetime

    wait_until(beating_past_lifetime, what="heartbeats a node lifetime after the kill")
    for handler in workers.handlers:
        assert handler.num_nodes_waiting() == 0
        assert not handler.is_closed()


# -- the leader dies during store writes ------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_leader_killed_during_store_adds(
    backend: str,
    etcd_cluster: EtcdCluster,
    workers_factory: Callable[..., Workers],
    run_id: str,
) -> None:
    nodes, adds = 3, 40
    workers = workers_factory(backend, run_id, nodes)
    infos = workers.join_all()
    _assert_one_group(infos, nodes)
    results: dict[int, list[int]] = {i: [] for i in range(nodes)}
    errors: list[BaseException] = []
    progress = threading.Semaphore(0)

    def add(worker: int) -> None:
        try:
            for _ in range(adds):
                results[worker].append(infos[worker].store.add("counter", 1))
                progress.release()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(i,), daemon=True) for i in range(nodes)]
    for thread in threads:
        thread.start()
    for _ in range(nodes * adds // 4):  # a quarter of the increments done
        assert progress.acquire(timeout=60)
    _kill_leader(etcd_cluster)
    for thread in threads:
        thread.join(TIMEOUT)
    assert not errors, errors
    values = sorted(value for worker in results.values() for value in worker)
    # Exactly once each: the results are 1..N, each handed out once, and so is the total.
    assert values == list(range(1, nodes * adds + 1))
    assert int(infos[0].store.get("counter")) == nodes * adds
