"""Mixed fleets: our workers and PyTorch 2.13's ``etcd`` backend in one rendezvous.

Skipped when PyTorch is not installed (CI installs ``torch==2.13.0``), and on an etcd
without the v2 API: PyTorch's backend speaks only v2 (our workers pick v2 too, with
``etcd_api=auto``, where the server serves it).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_rendezvous.api import Deadline
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvous
from etcd_rendezvous.etcd_server import EtcdServer
from support.rdzv import Worker, expect_joined, join_all, started
from support.wait import wait_for_state

pytest.importorskip(
    "torch.distributed.elastic.rendezvous.etcd_rendezvous",
    reason="PyTorch is not installed: `pip install torch==2.13.0` to run mixed-fleet tests",
)

pytestmark = [
    pytest.mark.torch,
    pytest.mark.v2_only(reason="PyTorch's etcd backend speaks only v2"),
]


def _spawn(workers: list[Worker], impls: list[str], etcd_server: EtcdServer, *args, **kw):
    new = [Worker(etcd_server.get_endpoint(), *args, impl=impl, **kw) for impl in impls]
    return started(workers, new)


@pytest.mark.parametrize("first", ["ours", "torch"])
def test_mixed_static_fleet_rendezvous_and_share_a_store(etcd_server, run_id, workers, first):
    other = "torch" if first == "ours" else "ours"
    # Our workers hand out their TorchEtcdStore, as they do by default with PyTorch installed.
    group = _spawn(
        workers,
        [first, other, first, other],
        etcd_server,
        run_id,
        4,
        4,
        extra_args=["--torch-store=auto"],
    )
    # The first worker creates the rendezvous state alone, then the rest join.
    group[0].send("join")
    for worker in group[1:]:
        worker.send("join")
    joined = [expect_joined(w.next_event(), w) for w in group]

    assert sorted(j["rank"] for j in joined) == [0, 1, 2, 3]
    assert {j["world_size"] for j in joined} == {4}
    assert {j["version"] for j in joined} == {"1"}
    assert len({(j["master_addr"], j["master_port"]) for j in joined}) == 1
    assert {j["store_type"] for w, j in zip(group, joined) if w.impl == "ours"} == {
        "TorchEtcdStore"
    }

    # One store: values set by either implementation are read by the other.
    for worker, info in zip(group, joined):
        assert worker.request(f"set from_{info['rank']} {worker.impl}")["event"] == "ok"
    for worker in group:
        for info, writer in zip(joined, group):
            reply = worker.request(f"get from_{info['rank']}")
            assert reply == {"event": "value", "value": writer.impl}
    totals = sorted(w.request("add shared 5")["value"] for w in group)
    assert totals == [5, 10, 15, 20]


# PyTorch's worker sleeps 1 s after a lost race (for example when another worker destroyed
# the lapsed rendezvous first), so a 1 s last call can close the next rendezvous before it
# is back; 4 s leaves it a margin without making the test slow.
LATE_JOINER_LAST_CALL = 4


def test_late_torch_worker_makes_our_members_rerendezvous(etcd_server, run_id, workers, conn):
    members = _spawn(
        workers, ["ours", "torch"], etcd_server, run_id, 2, 3, last_call=LATE_JOINER_LAST_CALL
    )
    first = join_all(members)
    assert {j["world_size"] for j in first} == {2}

    (late,) = _spawn(workers, ["torch"], etcd_server, run_id, 2, 3, last_call=LATE_JOINER_LAST_CALL)
    late.send("join")
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    wait_for_state(conn, key, lambda s: s is not None and s.get("num_workers_waiting") == 1)
    assert members[0].request("waiting") == {"event": "waiting", "n": 1}
    assert members[1].request("waiting") == {"event": "waiting", "n": 1}

    for worker in members:
        worker.send("join")
    second = [expect_joined(w.next_event(), w) for w in [*members, late]]
    assert sorted(j["rank"] for j in second) == [0, 1, 2]
    assert {j["world_size"] for j in second} == {3}
    assert {j["version"] for j in second} == {"2"}


def test_a_late_torch_worker_gets_into_the_next_version_despite_a_short_last_call(
    etcd_server, run_id, workers, conn
):
    """PyTorch's workers pause a second after the version they waited on ends, then try
    again; when PyTorch's workers were among those waiting, the next version's last call
    lasts a few seconds at least, so that a shorter one (1 s here, with min_workers 1)
    does not close it before PyTorch's worker comes."""
    members = _spawn(workers, ["ours", "ours"], etcd_server, run_id, 1, 3, last_call=1)
    first = join_all(members)
    assert {j["version"] for j in first} == {"1"}

    (late,) = _spawn(workers, ["torch"], etcd_server, run_id, 1, 3, last_call=1)
    late.send("join")
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    wait_for_state(conn, key, lambda s: s is not None and s.get("num_workers_waiting") == 1)
    for worker in members:
        worker.send("join")
    second = [expect_joined(w.next_event(), w) for w in [*members, late]]
    assert sorted(j["rank"] for j in second) == [0, 1, 2]
    assert {j["world_size"] for j in second} == {3}


def test_late_workers_of_both_kinds_are_counted_exactly_and_admitted(
    etcd_server, run_id, workers, conn
):
    """Two PyTorch and two of our workers arrive at a final version together: PyTorch's
    increment num_workers_waiting themselves, ours are counted in one write through
    their wait keys (the 'waiting' field survives PyTorch's writes); every member sees
    4, and the re-rendezvous admits all six."""
    members = _spawn(
        workers, ["ours", "torch"], etcd_server, run_id, 2, 6, last_call=LATE_JOINER_LAST_CALL
    )
    for worker in members:
        worker.send("join")
    assert {expect_joined(w.next_event(), w)["world_size"] for w in members} == {2}

    late = _spawn(
        workers,
        ["torch", "ours", "torch", "ours"],
        etcd_server,
        run_id,
        2,
        6,
        last_call=LATE_JOINER_LAST_CALL,
    )
    for worker in late:
        worker.send("join")
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    state = wait_for_state(conn, key, lambda s: s is not None and s["num_workers_waiting"] >= 4)
    assert state is not None
    assert state["num_workers_waiting"] == 4
    assert len(state["waiting"]) == 2
    assert state["tag"]  # our count's own; PyTorch's increments carry it along
    assert [w.request("waiting") for w in members] == [{"event": "waiting", "n": 4}] * 2

    for worker in members:
        worker.send("join")
    second = [expect_joined(w.next_event(), w) for w in [*members, *late]]
    assert sorted(j["rank"] for j in second) == list(range(6))
    assert {(j["version"], j["world_size"]) for j in second} == {("2", 6)}
    # At least two of ours were admitted by one of ours: a tagged admission, whose tag
    # PyTorch's joins carried along.
    assert json.loads(conn.get(key).value)["tag"]


def test_torch_sees_a_rendezvous_closed_by_us(etcd_server, run_id, workers, conn):
    ours, theirs = _spawn(workers, ["ours", "torch"], etcd_server, run_id, 2, 2)
    for worker in (ours, theirs):
        worker.send("join")
    for worker in (ours, theirs):
        expect_joined(worker.next_event(), worker)
    assert ours.request("close") == {"event": "ok"}
    assert theirs.request("closed") == {"event": "closed", "value": True}
    state = json.loads(conn.get(f"/torchelastic/p2p/run_{run_id}/rdzv/active_version").value)
    assert state["status"] == "closed"
    reply = theirs.request("join")
    assert reply["event"] == "error"
    assert reply["type"] == "RendezvousClosedError"


# -- batched admission next to PyTorch's join (N >= 8, interleaved) -----------------------

MIXED = ["ours", "torch", "ours", "torch", "ours", "torch", "ours", "torch"]


def _state_history(conn, key: str, since: int) -> list[dict]:
    """Every value the state key held after etcd index ``since``, oldest first (v2 keeps
    the last 1000 changes of the whole store: enough for one test's run)."""
    history, index = [], since + 1
    while (change := conn.watch(key, index, Deadline(0.5))) is not None:
        if change.value:
            history.append(json.loads(change.value))
        index = change.modified_index + 1
    return history


def _etcd_index(conn) -> int:
    return conn.get("/").etcd_index


def _assert_one_rendezvous(joined: list[dict], n: int) -> None:
    assert len({(j["version"], j["world_size"]) for j in joined}) == 1, joined
    assert {j["world_size"] for j in joined} == {n}
    assert sorted(j["rank"] for j in joined) == list(range(n))


def _assert_members_kept(history: list[dict], ours: int) -> None:
    """Once recorded, ``members`` is in every later state of the version (PyTorch's
    writes among them), and ends up naming each of our workers' ranks."""
    version = history[-1]["version"]
    states = [s for s in history if s.get("version") == version]
    seen: dict[str, int] = {}
    for state in states:
        members = state.get("members", {})
        assert members.items() >= seen.items(), f"members lost in {state}"
        seen = members
    assert len(seen) == ours
    final = states[-1]
    assert final["status"] == "final"
    for name, rank in seen.items():
        assert rank in final["participants"]
        assert any(k.endswith("/" + name) for k in final["keep_alives"])


def _pytorch_wrote_after_members(history: list[dict]) -> bool:
    """Whether a state written by a PyTorch worker (a participant without a member entry
    appended, or a ``rank_<r>`` key confirmed) followed one holding ``members``."""
    for before, after in itertools.pairwise(history):
        if not before.get("members"):
            continue
        joined = len(after.get("participants", [])) > len(before.get("participants", []))
        grew = len(after.get("members", {})) > len(before.get("members", {}))
        confirmed = [k for k in after.get("keep_alives", []) if "/rank_" in k]
        if (joined and not grew) or len(confirmed) > len(
            [k for k in before.get("keep_alives", []) if "/rank_" in k]
        ):
            return True
    return False


def test_interleaved_fleet_starting_together(etcd_server, run_id, workers, conn):
    since = _etcd_index(conn)
    group = _spawn(workers, MIXED, etcd_server, run_id, 8, 8)
    joined = join_all(group)

    _assert_one_rendezvous(joined, 8)
    history = _state_history(conn, f"/torchelastic/p2p/run_{run_id}/rdzv/active_version", since)
    _assert_members_kept(history, ours=4)
    assert _pytorch_wrote_after_members(history)


def _join_until(group, conn, key: str, participants: int) -> None:
    for worker in group:
        worker.send("join")
    wait_for_state(
        conn, key, lambda s: s is not None and len(s.get("participants", [])) == participants
    )


@pytest.mark.parametrize("last", ["torch", "ours"])
def test_the_worker_reaching_max_workers_freezes(etcd_server, run_id, workers, conn, last):
    """(a) a PyTorch worker reaches max_workers and freezes with empty keep_alives: our
    lowest-ranked member confirms all of ours in one write; (c) ours does, with our
    members confirmed in the freezing write, and PyTorch's members confirm themselves."""
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    since = _etcd_index(conn)
    first = _spawn(workers, MIXED[:7], etcd_server, run_id, 8, 8)
    (closer,) = _spawn(workers, [last], etcd_server, run_id, 8, 8)
    _join_until(first, conn, key, 7)
    closer.send("join")
    group = [*first, closer]
    joined = [expect_joined(w.next_event(), w) for w in group]

    _assert_one_rendezvous(joined, 8)
    ours = MIXED[:7].count("ours") + (last == "ours")
    history = _state_history(conn, key, since)
    _assert_members_kept(history, ours=ours)
    assert _pytorch_wrote_after_members(history)
    # The freezing write (the states after it add confirmations).
    frozen = next(s for s in history if s["status"] in ("frozen", "final"))
    our_keys = [k for k in frozen["keep_alives"] if "/node_" in k]
    if last == "torch":
        assert frozen["keep_alives"] == []
        # Then one write confirmed all of our members.
        confirmations = [
            len([k for k in s["keep_alives"] if "/node_" in k])
            for s in history
            if s["status"] in ("frozen", "final") and s.get("keep_alives")
        ]
        assert ours in confirmations, history
        assert 1 not in confirmations, history
    else:
        assert len(our_keys) == ours
        assert not [k for k in frozen["keep_alives"] if "/rank_" in k]


@pytest.mark.parametrize("last_caller", ["torch", "ours"])
def test_the_last_call_worker_freezes(etcd_server, run_id, workers, conn, last_caller):
    """(b) the worker ranked min_workers - 1 is PyTorch's: it runs the last call and
    freezes with empty keep_alives, then ours confirm together; or it is ours, and it
    freezes with our members confirmed."""
    key = f"/torchelastic/p2p/run_{run_id}/rdzv/active_version"
    other = "torch" if last_caller == "ours" else "ours"
    since = _etcd_index(conn)
    kw = {"last_call": LATE_JOINER_LAST_CALL}
    early = _spawn(workers, [other] * 3, etcd_server, run_id, 4, 10, **kw)
    (caller,) = _spawn(workers, [last_caller], etcd_server, run_id, 4, 10, **kw)
    late = _spawn(workers, MIXED[:4], etcd_server, run_id, 4, 10, **kw)
    _join_until(early, conn, key, 3)
    _join_until([caller], conn, key, 4)
    _join_until(late, conn, key, 8)
    group = [*early, caller, *late]
    joined = [expect_joined(w.next_event(), w) for w in group]

    _assert_one_rendezvous(joined, 8)
    assert next(j for w, j in zip(group, joined) if w is caller)["rank"] == 3
    ours = sum(w.impl == "ours" for w in group)
    history = _state_history(conn, key, since)
    _assert_members_kept(history, ours=ours)
    assert _pytorch_wrote_after_members(history)
    frozen = next(s for s in history if s["status"] in ("frozen", "final"))
    assert len(frozen["participants"]) == 8
    if last_caller == "torch":
        assert frozen["keep_alives"] == []
    else:
        assert len(frozen["keep_alives"]) == ours
        assert all("/node_" in k for k in frozen["keep_alives"])


# -- the "tag" our workers add to the setup state and to an announcement --------------------


#: PyTorch's run-directory lease thread refreshes the directory as if it were a file;
#: etcd answers "Not a file" and the thread ends (in PyTorch's own workers too).
_torch_lease_thread_dies = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)


@pytest.fixture
def torch_rdzv(etcd_client, etcd_prefix, run_id):
    """PyTorch 2.13's own ``EtcdRendezvous``, in this process, on the test's prefix."""
    from torch.distributed.elastic.rendezvous import etcd_rendezvous as torch_etcd

    rdzv = torch_etcd.EtcdRendezvous(etcd_client, etcd_prefix, run_id, 1, 2, 30, 0)
    rdzv._rendezvous_deadline = time.time() + 30  # set by its rendezvous_barrier
    yield rdzv
    rdzv._lease_run_id_stop.set()


@_torch_lease_thread_dies
def test_torch_treats_our_tagged_setup_state_as_setup(
    conn, etcd_client, etcd_prefix, run_id, torch_rdzv, monkeypatch
):
    """While our worker sets a version up (its setup state tagged), PyTorch's waits for
    the state to change, leaves it alone, then joins the version we opened."""
    from torch.distributed.elastic.rendezvous import etcd_rendezvous as torch_etcd

    in_setup, release, torch_watching = (threading.Event() for _ in range(3))
    real_mkdir = conn.mkdir

    def mkdir_held_in_setup(key, **kwargs):
        if key.endswith("/rdzv/v_1"):
            in_setup.set()
            assert release.wait(30)
        return real_mkdir(key, **kwargs)

    monkeypatch.setattr(conn, "mkdir", mkdir_held_in_setup)
    real_watch = etcd_client.watch

    def watch(*args, **kwargs):
        torch_watching.set()
        return real_watch(*args, **kwargs)

    monkeypatch.setattr(etcd_client, "watch", watch)

    with EtcdRendezvous(conn, etcd_prefix, run_id, 1, 2, 30, 0) as ours:
        state_key = ours.get_path("/rdzv/active_version")
        creator = ThreadPoolExecutor(1)
        created = creator.submit(ours.try_create_rendezvous)
        assert in_setup.wait(30)
        setup = json.loads(conn.get(state_key).value)
        assert setup["status"] == "setup"
        assert setup["tag"]

        torch_side = ThreadPoolExecutor(1)
        phase = torch_side.submit(torch_rdzv.init_phase)
        assert torch_watching.wait(30)  # PyTorch waits for the setup to end
        assert json.loads(conn.get(state_key).value) == setup
        release.set()
        opened = json.loads(created.result(30).value)
        with pytest.raises(torch_etcd.EtcdRendezvousRetryableFailure):
            phase.result(30)  # PyTorch's answer to a state that left "setup": retry
        creator.shutdown()
        torch_side.shutdown()

        assert (opened["status"], opened["version"]) == ("joinable", "1")
        assert "tag" not in opened
        # PyTorch's worker joins the version we opened.
        joined, rank = torch_rdzv.join_rendezvous("1")
        assert rank == len(opened["participants"])
        assert json.loads(joined.value)["participants"] == [*opened["participants"], rank]


@_torch_lease_thread_dies
def test_torch_keeps_our_tag_when_it_announces_itself_waiting(
    conn, etcd_prefix, run_id, torch_rdzv
):
    """A final state our worker counted itself waiting in carries a tag; PyTorch's
    announce increments ``num_workers_waiting`` and carries the tag along."""
    with EtcdRendezvous(conn, etcd_prefix, run_id, 1, 1, 30, 0) as ours:
        assert ours.rendezvous_barrier() == ("1", 0, 1)
        state_key = ours.get_path("/rdzv/active_version")
        final = json.loads(conn.get(state_key).value)
        assert final["num_workers_waiting"] == 0

        announced = json.loads(ours.announce_self_waiting("1").value)
        assert announced == {**final, "num_workers_waiting": 1, "tag": announced["tag"]}
        assert announced["tag"]

        torch_rdzv.announce_self_waiting("1")
        after_torch = json.loads(conn.get(state_key).value)
        assert after_torch == {**announced, "num_workers_waiting": 2}

        again = json.loads(ours.announce_self_waiting("1").value)
        assert again["num_workers_waiting"] == 3
        assert again["tag"] != announced["tag"]  # each increment its own
