"""The progress key of our ``etcd-v2`` nodes against a real etcd: a hint, never the
authority.

Our waiting nodes watch a small progress key instead of the state, and read the state
when it says something concerns them. Here the key is left behind, corrupted or
deleted mid-rendezvous, and the state is written by a writer that never writes the key
(our backend's bare ``set_state``, or PyTorch 2.13's own backend): the rendezvous
completes all the same, through the silence fallback and the relay.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timezone
from typing import Any

import pytest

from etcd_rendezvous._dynamic.keys import Progress
from etcd_rendezvous._dynamic.state import _encode_state
from etcd_rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    NodeDesc,
    RendezvousState,
    decode_state,
)
from etcd_rendezvous.etcd_server import EtcdServer
from support.etcd_requests import read_metrics, requests_since
from support.handlers import backend_of, join_in
from support.wait import wait_until

pytestmark = pytest.mark.slow

_HAVE_TORCH = importlib.util.find_spec("torch") is not None

Handlers = Callable[..., list[DynamicRendezvousHandler]]

#: A node of another implementation, last in rank order (so that rank 0 is ours).
STRANGER = NodeDesc("zzz-host", 7, 0)


@pytest.fixture
def handler_options() -> dict[str, Any]:
    """A long last call (a round ends when it is full) and a tolerant heartbeat."""
    return {"last_call_timeout": 30, "keep_alive_interval": 1, "keep_alive_max_attempt": 10}


def _state(handler: DynamicRendezvousHandler) -> tuple[RendezvousState, int]:
    result = backend_of(handler).get_state()
    assert result is not None
    return decode_state(result[0], "the test"), int(result[1])


def _participants(handler: DynamicRendezvousHandler, count: int) -> None:
    wait_until(
        lambda: (
            backend_of(handler).get_state() is not None
            and len(_state(handler)[0].participants) == count
        ),
        timeout=30,
        what=f"{count} participants",
    )


def _complete_with(state: Any, stranger: Any) -> None:
    """Add ``stranger`` to ``state`` (ours or PyTorch's) and complete its round, ranks in
    node order."""
    state.participants[stranger] = 0
    state.last_heartbeats[stranger] = datetime.now(timezone.utc)
    state.complete, state.deadline = True, None
    for rank, node in enumerate(sorted(state.participants)):
        state.participants[node] = rank


def _check_written(written: tuple[Any, ...] | None) -> None:
    """``set_state``'s answer says that the test's write was applied."""
    assert written is not None
    assert written[2], "the state changed under the test's write"


def _complete_with_a_stranger_raw(handler: DynamicRendezvousHandler) -> None:
    """Add :data:`STRANGER` and complete the round with the backend's bare compare-and-
    swap: a state write without a progress summary."""
    backend = backend_of(handler)
    state, token = _state(handler)
    _complete_with(state, STRANGER)
    _check_written(backend.set_state(_encode_state(state), token))


def _complete_with_a_stranger_torch(handler: DynamicRendezvousHandler) -> None:
    """The same, through PyTorch 2.13's own ``EtcdRendezvousBackend``, with PyTorch's
    classes and ``pickle``."""
    import etcd
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
        EtcdRendezvousBackend as TorchBackend,
    )

    host, port = backend_of(handler).connection.endpoints[0].rsplit("//", 1)[-1].split(":")
    torch_backend = TorchBackend(
        etcd.Client(host, int(port)), handler.get_run_id(), "/torch/elastic/rendezvous"
    )
    result = torch_backend.get_state()
    assert result is not None
    state = pickle.loads(result[0])
    stranger = torch_dynamic._NodeDesc(STRANGER.addr, STRANGER.pid, STRANGER.local_id)
    _complete_with(state, stranger)
    _check_written(torch_backend.set_state(pickle.dumps(state), result[1]))


WRITERS = [
    pytest.param(_complete_with_a_stranger_raw, id="raw"),
    pytest.param(
        _complete_with_a_stranger_torch,
        id="torch",
        marks=[
            pytest.mark.skipif(not _HAVE_TORCH, reason="PyTorch is not installed"),
            pytest.mark.torch,
            pytest.mark.v2_only(reason="PyTorch's etcd-v2 backend speaks only v2"),
        ],
    ),
]


@pytest.mark.parametrize("writer", WRITERS)
def test_a_state_written_without_a_summary_is_noticed_and_relayed(
    handlers: Handlers, pool: ThreadPoolExecutor, writer: Callable[..., None]
) -> None:
    """Another implementation completes the round (it never writes the progress key):
    our waiting nodes read the state after a silence, finish, and one of them writes the
    summary it missed."""
    group = handlers(2, 3, 3)
    futures = join_in(pool, group)
    _participants(group[0], 2)
    writer(group[0])
    infos = [future.result(60) for future in futures]
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {3}
    _, token = _state(group[0])
    progress = Progress.decode(backend_of(group[0]).connection.get(_progress_key(group[0])).value)
    assert progress is not None
    assert progress.token == token
    assert progress.complete


def _progress_key(handler: DynamicRendezvousHandler) -> str:
    return backend_of(handler).nodes_layout.progress_key


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_progress_key_damaged_mid_rendezvous_is_rebuilt(
    handlers: Handlers, pool: ThreadPoolExecutor, damage: str
) -> None:
    """Two nodes wait for a third; the progress key is overwritten with garbage (or
    deleted); the third joins all the same, and all three complete."""
    group = handlers(3, 3, 3)
    first, last = group[:2], group[2]
    futures = join_in(pool, first)
    _participants(first[0], 2)
    conn, key = backend_of(last).connection, _progress_key(last)
    if damage == "garbage":
        conn.set(key, "not a summary {")
    else:
        conn.delete(key)
    futures += join_in(pool, [last])
    infos = [future.result(60) for future in futures]
    assert sorted(info.rank for info in infos) == [0, 1, 2]
    assert {info.world_size for info in infos} == {3}


def test_a_rendezvous_after_a_thousand_other_writes_makes_few_requests(
    private_etcd_server: EtcdServer, handlers: Handlers, pool: ThreadPoolExecutor
) -> None:
    """A re-rendezvous on a busy etcd: by then the progress key is older than the event
    history etcd keeps (1000 events on v2). The node that waits for the other one watches
    the key from the read that found it, not from its last change (a watch of history
    that is gone fails at once, and reading the key and watching from the same old index
    again would loop as fast as etcd answers)."""
    server = private_etcd_server
    # The default heartbeat (every 5 s), not this module's (every 1 s): the requests
    # counted are the rendezvous', not a second's heartbeats.
    group = handlers(2, 2, 2, server=server, keep_alive_interval=5, keep_alive_max_attempt=3)
    assert sorted(f.result(60).rank for f in join_in(pool, group)) == [0, 1]
    conn = backend_of(group[0]).connection
    for i in range(1100):  # other work on the same etcd
        conn.set(f"/other/work/{i % 40}", str(i))
    before = read_metrics(server.client_url)
    first = pool.submit(group[0].next_rendezvous)
    # The first node waits in the next round for 2 s (its silences included).
    with pytest.raises(FutureTimeout):  # alone, it waits (3 s, silences included)
        first.result(3.0)
    second = pool.submit(group[1].next_rendezvous)
    assert sorted([first.result(60).rank, second.result(60).rank]) == [0, 1]
    requests = requests_since(server.client_url, before)
    # Both nodes' requests, the first's 3 s of waiting included (30 on v2; spinning
    # on the lost history made 300).
    assert requests.reads + requests.writes <= 50, requests.describe()


@pytest.mark.parametrize("lie", ["beyond-its-write", "above-the-state"])
def test_a_summary_that_lies_mid_rendezvous_stops_nobody(
    handlers: Handlers, pool: ThreadPoolExecutor, lie: str
) -> None:
    """Two nodes wait for a third; the progress key is overwritten with a summary that
    reads as one but describes no state: a token beyond the write
    that holds it, or within it but above every state. The third joins all the same, and
    all three complete: the state, read, is the authority."""
    group = handlers(3, 3, 3)
    first, last = group[:2], group[2]
    futures = join_in(pool, first)
    _participants(first[0], 2)
    conn, key = backend_of(last).connection, _progress_key(last)
    conn.set(f"{key}-test-marker", "x")  # an index above the state's
    index = conn.get(f"{key}-test-marker").modified_index
    token = 10**12 if lie == "beyond-its-write" else index
    fields = {"token": token, "round": 0, "complete": False, "closed": False}
    fields |= {"decided_upto": 0, "participants": 0, "waiting": 0}
    conn.set(key, json.dumps(fields))
    assert Progress.decode(conn.get(key).value) is not None  # it reads as a summary
    futures += join_in(pool, [last])
    infos = [future.result(60) for future in futures]
    assert sorted(info.rank for info in infos) == [0, 1, 2]
    assert {info.world_size for info in infos} == {3}


def test_a_summary_is_written_with_a_ttl_and_never_over_a_newer_one(handlers: Handlers) -> None:
    """Two writers summarise two state writes; the one with the older summary comes
    last, comparing on the version it heard: it keeps the newer summary. A writer of a
    newer one than the key holds replaces it even so. The key always has the state's
    TTL (a run that ends leaves nothing behind for ever)."""
    (handler,) = handlers(1, 1, 1)
    backend = backend_of(handler)
    conn, key = backend.connection, _progress_key(handler)

    def summary(token: int) -> Progress:
        return Progress(token, 0, False, False, 0, 1, 0)

    first = backend.create_progress(summary(1))
    assert first is not None
    assert backend.create_progress(summary(2)) is None  # exists
    assert backend.ttl - 5 <= (conn.time_to_live(conn.get(key)) or 0) <= backend.ttl
    newer = backend.replace_progress(summary(50), first)
    assert newer is not None
    assert backend.write_progress(summary(40), first) is None  # heard before 50
    assert Progress.decode(conn.get(key).value) == summary(50)
    written = backend.write_progress(summary(60), first)
    assert written is not None
    held = conn.get(key)
    assert Progress.decode(held.value) == summary(60)
    assert held.modified_index == written
    assert backend.ttl - 5 <= (conn.time_to_live(held) or 0) <= backend.ttl


def test_a_batch_summary_replaces_a_relay_of_the_same_state_that_knew_less(
    handlers: Handlers,
) -> None:
    """A node that read a batch's state before its writer summarised it relays the
    summary with the decided index it knew, an older one: the writer's summary, with
    the index its batch decided up to, must replace it. Otherwise the nodes waiting for
    their turn never learn that the batch decided their predecessors: they all wait out
    the longest stagger, and every admitted node reads the state on a silence."""
    (handler,) = handlers(1, 1, 1)
    backend = backend_of(handler)
    conn, key = backend.connection, _progress_key(handler)

    def summary(decided_upto: int) -> Progress:
        return Progress(70, 0, False, False, decided_upto, 1, 0)

    first = backend.create_progress(Progress(60, 0, False, False, 3, 1, 0))
    assert first is not None
    relayed = backend.replace_progress(summary(3), first)  # a relay of state 70
    assert relayed is not None
    assert backend.write_progress(summary(69), first) is not None  # its writer's
    assert Progress.decode(conn.get(key).value) == summary(69)
    assert backend.write_progress(summary(3), relayed) is None  # never back again
    assert Progress.decode(conn.get(key).value) == summary(69)


def test_a_summary_of_a_state_deleted_since_does_not_stall_a_new_job(
    handlers: Handlers, pool: ThreadPoolExecutor
) -> None:
    """A job's state key is deleted while its progress key stays (an operator removes
    the state, or ``etcd-rendezvous delete`` leaves the rest of the run to a job that
    took the run id meanwhile). The summary describes a state that no longer exists:
    the nodes of the next job must not wait for it (they read the absent state as fast
    as etcd answered, thousands of times a second, until their timeout), but make the
    first state and complete."""
    old = handlers(2, 2, 2)
    assert sorted(f.result(60).rank for f in join_in(pool, old)) == [0, 1]
    for handler in old:
        handler.close()  # (not shutdown: the run is not closed; its agents are gone)
    (operator,) = handlers(1, 1, 1)
    backend_of(operator).connection.delete(backend_of(operator).key)
    assert Progress.decode(backend_of(operator).connection.get(_progress_key(operator)).value)
    new = handlers(2, 2, 2, join_timeout=20)
    infos = [future.result(60) for future in join_in(pool, new)]
    assert sorted(info.rank for info in infos) == [0, 1]
    assert {info.world_size for info in infos} == {2}
