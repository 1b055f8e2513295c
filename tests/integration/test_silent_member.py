"""A member that goes silent does not stall the job: both backends on a 3-member cluster.

Every worker lists the same follower first, so that all its requests and watches go
there. Two workers join and wait; then that follower is frozen for good (SIGSTOP, never
continued: its connections stay open, nothing answers, as with a host behind a network
partition) and the third worker arrives. The other two members keep quorum, so the
rendezvous must complete soon after: waits that hear nothing from their member for
``silence_timeout`` seconds are re-armed from the last index seen, and a request the
frozen member does not answer within that time goes to the next endpoint. Without that
bound each wait sat on the frozen member until ``read_timeout`` (60 s).

The cluster serves the API under test (``ETCD_RENDEZVOUS_ETCD_API``; the handlers pick
it with ``etcd_api=auto``). The test prints the time taken (``pytest -rA``).
"""

from __future__ import annotations

import json
import threading
import time
from base64 import b64decode
from collections.abc import Iterator

import pytest

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters
from etcd_rendezvous.dynamic_rendezvous import decode_state
from etcd_rendezvous.etcd_cluster import EtcdCluster, EtcdClusterMember
from etcd_rendezvous.registry import get_rendezvous_handler
from support.rdzv import state_key
from support.wait import wait_until

pytestmark = pytest.mark.slow

NODES = 3
#: The rendezvous timeout of each worker: longer than the read timeout, so that a wait
#: stuck until the read timeout would still complete (late) and the bound below tells.
TIMEOUT = 120
#: Seconds the rendezvous may take after the freeze: generous (a machine under load),
#: and still far below the 60 s read timeout a silent member used to cost.
BOUND = 30.0


def _params(backend: str, endpoints: str, run_id: str) -> RendezvousParameters:
    config = (
        {"timeout": TIMEOUT, "last_call_timeout": 1}
        if backend == "etcd"
        else {"join_timeout": TIMEOUT, "last_call_timeout": 1, "keep_alive_interval": 2}
    )
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoints,
        run_id=run_id,
        min_nodes=NODES,
        max_nodes=NODES,
        local_addr="127.0.0.1",
        torch_store="false",
        **config,
    )


def _participants(backend: str, run_id: str, value: str | None) -> int:
    if value is None:
        return 0
    if backend == "etcd":
        return len(json.loads(value).get("participants", []))
    return len(decode_state(b64decode(value), run_id).participants)


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class _Joins:
    """``next_rendezvous()`` of each handler in a thread of its own."""

    def __init__(self, handlers: list[RendezvousHandler]) -> None:
        self.handlers = handlers
        self.infos: dict[int, RendezvousInfo] = {}
        self.errors: dict[int, BaseException] = {}
        self.done: dict[int, float] = {}
        self.threads: list[threading.Thread] = []

    def start(self, worker: int) -> None:
        def run() -> None:
            try:
                self.infos[worker] = self.handlers[worker].next_rendezvous()
            except BaseException as exc:  # reported by wait()
                self.errors[worker] = exc
            self.done[worker] = time.monotonic()

        thread = threading.Thread(target=run, name=f"worker-{worker}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def wait(self) -> list[RendezvousInfo]:
        deadline = time.monotonic() + TIMEOUT + 30
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not self.errors, self.errors
        assert len(self.infos) == NODES, "a worker never returned"
        return [self.infos[i] for i in sorted(self.infos)]


@pytest.fixture
def handlers(
    request: pytest.FixtureRequest, etcd_cluster: EtcdCluster, run_id: str
) -> Iterator[tuple[list[RendezvousHandler], EtcdClusterMember]]:
    """``NODES`` handlers of the backend the test is parametrized with, each listing the
    same follower first; and that follower."""
    leader = etcd_cluster.wait_for_leader(timeout=30)
    silent = next(m for m in etcd_cluster.members if m is not leader)
    order = [silent] + [m for m in etcd_cluster.members if m is not silent]
    endpoints = ",".join(m.endpoint for m in order)
    made = [get_rendezvous_handler(_params(request.param, endpoints, run_id)) for _ in range(NODES)]
    try:
        yield made, silent
    finally:
        for handler in made:
            handler.close()


def rendezvous_through_a_frozen_member(
    backend: str,
    handlers: list[RendezvousHandler],
    silent: EtcdClusterMember,
    cluster: EtcdCluster,
    run_id: str,
) -> tuple[float, list[RendezvousInfo]]:
    """Two workers join and wait through ``silent``, which is then frozen for good; the
    third joins. Returns the seconds from the freeze to the last worker's return, and
    the workers' results."""
    healthy = [(m.host, m.port) for m in cluster.members if m is not silent]
    key = state_key(backend, run_id)
    joins = _Joins(handlers)
    with open_transport(healthy, read_timeout=10) as observer:

        def waiting() -> bool:
            node = observer.try_get(key)
            return _participants(backend, run_id, None if node is None else node.value) == 2

        joins.start(0)
        joins.start(1)
        wait_until(waiting, timeout=60, what="two workers waiting")
    silent.suspend()
    wait_until(lambda: _process_state(silent.pid) == "T", what="the member to be stopped")
    frozen_at = time.monotonic()
    joins.start(2)
    infos = joins.wait()
    return max(joins.done.values()) - frozen_at, infos


@pytest.mark.parametrize("handlers", ["etcd", "etcd-v2"], indirect=True)
def test_rendezvous_completes_soon_after_a_member_freezes_for_good(
    handlers: tuple[list[RendezvousHandler], EtcdClusterMember],
    etcd_cluster: EtcdCluster,
    run_id: str,
    request: pytest.FixtureRequest,
) -> None:
    made, silent = handlers
    backend = request.node.callspec.params["handlers"]
    took, infos = rendezvous_through_a_frozen_member(backend, made, silent, etcd_cluster, run_id)
    assert sorted(info.rank for info in infos) == list(range(NODES))
    assert {info.world_size for info in infos} == {NODES}
    assert silent.suspended
    assert took < BOUND, f"the rendezvous took {took:.1f} s after the freeze"
    # The figure itself, for the docs (shown by pytest -rA or -s).
    print(f"{backend} on etcd {etcd_cluster.version}: {took:.1f} s after the freeze")
