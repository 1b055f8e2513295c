"""The fault harness's checker on hand-made records: each invariant holds on a clean
history and is reported on one that breaks it (a checker that cannot fail is a defect).

These run in the ordinary test pass: no etcd, no processes.
"""

from __future__ import annotations

from typing import Any

import pytest

from chaos import checker
from chaos.scenario import Fault, NodeSpec, Scenario, generate

T0 = 1000.0
BOUND = 30.0
SETTINGS = {
    "timeout": 45.0,
    "last_call": 1.0,
    "keep_alive_interval": 1.0,
    "keep_alive_max_attempt": 3.0,
    "request_timeout": 2.0,
    "silence_timeout": 5.0,
    "step_timeout": 5.0,
    "step_interval": 0.5,
}


class History:
    """A scenario's records, written by hand: times are seconds after the start."""

    def __init__(self, backend: str = "etcd-v2", nodes: int = 3, min_nodes: int = 2) -> None:
        self.scenario: dict[str, Any] = {
            "seed": 1,
            "flavor": "3.5",
            "family": "mixed",
            "backend": backend,
            "run_id": "chaos-1",
            "members": 1,
            "min_nodes": min_nodes,
            "max_nodes": nodes,
            "nodes": [
                {"name": f"n{i}", "impl": "ours", "start": 0.0, "proxied": False}
                for i in range(nodes)
            ],
            "faults": [],
            "settings": dict(SETTINGS),
            "max_request_bytes": None,
        }
        self.runner: list[dict[str, Any]] = [{"t": T0, "ev": "begin", "bound": BOUND}]
        self.nodes: dict[str, list[dict[str, Any]]] = {}
        self.ids = iter(range(1, 1000))
        for i in range(nodes):
            self.start(f"n{i}", pid=100 + i)

    def start(self, name: str, pid: int, at: float = 0.0) -> None:
        self.runner.append({"t": T0 + at, "ev": "proc", "node": name, "pid": pid})
        self.nodes[name] = [{"t": T0 + at, "ev": "start", "node": name, "pid": pid, "impl": "ours"}]

    def node(self, name: str, at: float, ev: str, **fields: Any) -> None:
        self.nodes[name].append({"t": T0 + at, "ev": ev, "node": name, **fields})

    def run(self, ev: str, at: float, **fields: Any) -> None:
        self.runner.append({"t": T0 + at, "ev": ev, **fields})

    def fault(self, kind: str, at: float, end: float | None, target: str | None = None, **params):
        self.run(
            "fault",
            at,
            id=next(self.ids),
            kind=kind,
            target=target,
            params=params,
            end=None if end is None else T0 + end,
        )

    def faults_over(self, at: float) -> None:
        self.run("faults_over", at)

    def round(self, names: list[str], round_: int, at: float, steps: int = 3, call: int = 1):
        """``names`` (by rank) join ``round_`` at ``at`` and pass ``steps`` barriers."""
        for rank, name in enumerate(names):
            self.node(name, at - 1, "join_start", call=call)
            self.node(
                name,
                at,
                "joined",
                call=call,
                round=round_,
                rank=rank,
                world_size=len(names),
                elapsed=1.0,
            )
            self.node(name, at + 0.1, "world", round=round_, members=list(names), conflict=False)
            self.node(name, at + 0.2, "stored", round=round_, key=f"chaos/data/{name}")
            for k in range(steps):
                self.node(name, at + 1 + k, "step", round=round_, k=k)

    def finish(self, at: float) -> None:
        for name in self.nodes:
            self.node(name, at, "stop", how="stop")
            self.node(name, at + 0.5, "shutdown", result=True, error=None, elapsed=0.1)
            self.node(
                name,
                at + 1,
                "leaks",
                threads=[],
                threads_after_close=[],
                sockets=[],
                sockets_after_gc=[],
            )
            self.node(name, at + 1.1, "exit")
            self.run("proc_end", at + 1.2, node=name, rc=0, killed=False, stderr="")

    def check(self) -> list[checker.Violation]:
        return checker.check(self.scenario, self.runner, self.nodes)

    def invariants(self) -> list[str]:
        return sorted({v.invariant for v in self.check()})


def clean(backend: str = "etcd-v2") -> History:
    h = History(backend=backend)
    h.faults_over(5.0)
    h.round(["n0", "n1", "n2"], 0, at=2.0, steps=8)
    h.finish(20.0)
    return h


def test_a_clean_history_has_no_violation():
    assert clean().check() == []


# -- one world --------------------------------------------------------------------------


def test_two_nodes_with_one_rank_are_one_world_broken():
    h = clean()
    h.node("n2", 12.0, "join_start", call=2)
    h.node("n2", 13.0, "joined", call=2, round=1, rank=0, world_size=2, elapsed=1)
    h.node("n1", 13.0, "joined", call=2, round=1, rank=0, world_size=2, elapsed=1)
    found = h.check()
    assert [v.invariant for v in found] == ["one-world"]
    assert "ranks [0, 0]" in found[0].detail


def test_different_world_sizes_in_a_round_are_reported():
    h = clean()
    h.node("n0", 13.0, "joined", call=2, round=1, rank=0, world_size=2, elapsed=1)
    h.node("n1", 13.0, "joined", call=2, round=1, rank=1, world_size=3, elapsed=1)
    assert h.invariants() == ["one-world"]


def test_a_split_world_shows_in_the_fingerprints():
    h = clean()
    h.node("n0", 13.0, "world", round=0, members=["n0", "n2", "n1"], conflict=False)
    assert "one-world" in h.invariants()


def test_a_rank_claimed_twice_in_the_store_is_reported():
    h = clean()
    h.node("n1", 13.0, "world", round=0, members=["n0", "n1", "n2"], conflict=True)
    assert h.invariants() == ["one-world"]


def test_a_barrier_counting_past_the_world_is_reported():
    h = clean()
    h.node("n1", 13.0, "overflow", round=0, k=4, count=4)
    assert h.invariants() == ["one-world"]


def test_a_round_number_used_twice_by_a_node_is_reported():
    h = clean()
    h.node("n0", 15.0, "joined", call=2, round=0, rank=0, world_size=3, elapsed=1)
    assert "rounds-increase" in h.invariants()


# -- operator commands --------------------------------------------------------------------


def delete(h: History, at: float, args: list[str], deleted: list[str]) -> None:
    h.run(
        "command",
        at + 0.5,
        kind="delete",
        args=args,
        t0=T0 + at,
        rc=0,
        stdout="",
        stderr="",
        report={"deleted": deleted},
    )


def test_deleting_a_live_run_is_reported():
    h = clean()
    delete(h, 10.0, ["--yes", "--json"], ["/torch/elastic/rendezvous/chaos-1"])
    found = h.check()
    assert [v.invariant for v in found] == ["no-live-run-deleted"]
    assert found[0].nodes == ["n0", "n1", "n2"]


def test_deleting_with_force_or_another_run_is_not_a_violation():
    h = clean()
    delete(h, 10.0, ["--yes", "--force"], ["/torch/elastic/rendezvous/chaos-1"])
    delete(h, 11.0, ["--yes"], ["/torch/elastic/rendezvous/chaos-12"])
    assert h.check() == []


def test_a_run_whose_nodes_were_all_disturbed_may_be_deleted():
    h = clean()
    for name in ("n0", "n1", "n2"):
        h.fault("pause", 4.0, 8.0, name)
    delete(h, 10.0, ["--yes"], ["/torch/elastic/rendezvous/chaos-1"])
    assert "no-live-run-deleted" not in h.invariants()


def test_a_node_just_arrived_does_not_make_a_run_live():
    h = History(nodes=1, min_nodes=1)
    h.faults_over(0.0)
    h.node("n0", 9.0, "join_start", call=1)
    delete(h, 10.0, ["--yes"], ["/torch/elastic/rendezvous/chaos-1"])
    assert "no-live-run-deleted" not in h.invariants()


def test_a_command_that_crashes_is_reported():
    h = clean()
    h.run(
        "command",
        10.0,
        kind="status",
        args=[],
        t0=T0 + 9,
        rc=1,
        stdout="",
        stderr="Traceback (most recent call last):\n  ...\nKeyError: 'x'",
        report=None,
    )
    h.run(
        "command",
        11.0,
        kind="gc",
        args=["--bogus"],
        t0=T0 + 10,
        rc=2,
        stdout="",
        stderr="usage: ...",
        report=None,
    )
    assert len([v for v in h.check() if v.invariant == "operator-commands"]) == 2


# -- liveness -----------------------------------------------------------------------------


def test_no_progress_after_the_faults_is_a_liveness_violation():
    h = History()
    h.faults_over(5.0)
    h.round(["n0", "n1", "n2"], 0, at=2.0, steps=2)  # both barriers before T_f
    for name in ("n0", "n1", "n2"):
        h.node(name, 6.0, "join_start", call=2)
    h.finish(50.0)
    found = h.check()
    assert [v.invariant for v in found] == ["liveness"]
    assert "blocked in next_rendezvous() since" in found[0].detail


def test_progress_of_a_world_without_a_healthy_node_is_not_liveness():
    h = History()
    h.faults_over(5.0)
    h.round(["n0", "n1"], 0, at=6.0, steps=5)
    h.node("n2", 4.0, "join_start", call=1)
    h.finish(50.0)
    assert h.invariants() == ["liveness"]


def test_progress_after_the_bound_is_a_liveness_violation():
    h = History()
    h.faults_over(5.0)
    h.round(["n0", "n1", "n2"], 0, at=5.0 + BOUND, steps=3)
    h.finish(60.0)
    assert h.invariants() == ["liveness"]


def test_a_killed_node_is_not_waited_for():
    h = History()
    h.fault("kill", 3.0, None, "n2")
    h.faults_over(5.0)
    h.round(["n0", "n1"], 1, at=10.0, steps=3)
    h.finish(20.0)
    assert h.check() == []


def test_every_healthy_node_failing_with_a_named_error_satisfies_liveness():
    h = History()
    h.faults_over(5.0)
    for name in ("n0", "n1", "n2"):
        h.node(name, 4.0, "join_start", call=1)
        h.node(
            name,
            8.0,
            "join_error",
            call=1,
            error="RendezvousStateError",
            named=True,
            closed=False,
            message="request too large",
            elapsed=4.0,
        )
    h.finish(20.0)
    live = checker.liveness(h.scenario, h.runner, h.nodes)
    assert live.how == "failed"
    assert h.check() == []


def _refused(h: History, name: str, at: float) -> None:
    h.node(name, at - 1.0, "join_start", call=1)
    h.node(
        name,
        at,
        "join_error",
        call=1,
        error="RequestTooLargeError",
        named=True,
        closed=False,
        message="request too large",
        elapsed=1.0,
    )


def test_under_a_request_limit_a_round_of_some_and_the_others_refused_is_liveness():
    h = History(nodes=4)
    h.scenario["max_request_bytes"] = 900
    h.faults_over(5.0)
    h.round(["n0", "n1"], 0, at=6.0, steps=3)
    _refused(h, "n2", 8.0)
    _refused(h, "n3", 9.0)
    h.finish(30.0)
    assert checker.liveness(h.scenario, h.runner, h.nodes).how == "progress"
    assert h.check() == []


def test_the_split_needs_the_limit_and_every_other_node_refused_for_its_size():
    def history(limit: int | None, error: str) -> History:
        h = History(nodes=4)
        h.scenario["max_request_bytes"] = limit
        h.faults_over(5.0)
        h.round(["n0", "n1"], 0, at=6.0, steps=3)
        _refused(h, "n2", 8.0)
        h.node("n3", 8.0, "join_start", call=1)  # blocked for good
        if error:
            h.node(
                "n3",
                9.0,
                "join_error",
                call=1,
                error=error,
                named=True,
                closed=False,
                message="x",
                elapsed=1.0,
            )
        h.finish(60.0)
        return h

    assert history(900, "").invariants() == ["liveness"]  # n3 hangs
    assert history(900, "RendezvousTimeoutError").invariants() == ["liveness"]
    assert history(None, "RequestTooLargeError").invariants() == ["liveness"]  # no limit


def test_liveness_does_not_apply_below_min_nodes():
    h = History(min_nodes=3)
    h.fault("kill", 3.0, None, "n2")
    h.faults_over(5.0)
    h.finish(20.0)
    live = checker.liveness(h.scenario, h.runner, h.nodes)
    assert not live.applies
    assert "min_nodes" in live.why


def test_liveness_is_not_yet_violated_before_the_bound():
    h = History()
    h.faults_over(5.0)
    live = checker.liveness(h.scenario, h.runner, h.nodes, now=T0 + 10.0)
    assert live.applies
    assert live.violations == []
    assert live.held_at is None


# -- errors, deadlines, the store, leaks ----------------------------------------------------


def test_an_unnamed_error_is_reported():
    h = clean()
    h.node(
        "n1",
        10.0,
        "op_error",
        op="store.add",
        round=0,
        error="KeyError",
        named=False,
        message="'x'",
        elapsed=0.1,
        timeout=30,
    )
    assert h.invariants() == ["named-errors"]


def test_an_error_past_the_timeout_is_reported_unless_the_node_was_paused():
    h = clean()
    h.node(
        "n1",
        60.0,
        "join_error",
        call=2,
        error="RendezvousTimeoutError",
        named=True,
        closed=False,
        message="",
        elapsed=50.0,
    )
    assert h.invariants() == ["named-errors"]
    h.fault("pause", 12.0, 20.0, "n1")
    assert "named-errors" not in h.invariants()


def test_a_node_that_does_not_stop_is_reported():
    h = clean()
    h.run("hung", 80.0, node="n2", waited=60.0, last={"ev": "join_start"})
    assert h.invariants() == ["named-errors"]


def test_a_stored_value_lost_is_reported():
    h = clean()
    h.node("n0", 9.0, "lost", round=0, key="chaos/data/n0")
    assert h.invariants() == ["store-kept"]


@pytest.mark.parametrize(
    "leaks",
    [
        {
            "threads": ["etcd-watch /x"],
            "threads_after_close": [],
            "sockets": [],
            "sockets_after_gc": [],
        },
        {
            "threads": [],
            "threads_after_close": ["keepalive"],
            "sockets": [],
            "sockets_after_gc": [],
        },
        {
            "threads": [],
            "threads_after_close": [],
            "sockets": ["127.0.0.1:2379 ESTABLISHED"],
            "sockets_after_gc": [],
        },
    ],
)
def test_threads_and_sockets_left_after_shutdown_are_leaks(leaks):
    h = clean()
    h.nodes["n0"] = [r for r in h.nodes["n0"] if r["ev"] != "leaks"]
    h.node("n0", 21.0, "leaks", **leaks)
    assert h.invariants() == ["no-leaks"]


def test_a_lease_of_a_node_that_shut_down_is_a_leak():
    h = clean()
    h.run(
        "leases",
        25.0,
        leases=[
            {
                "id": 7,
                "ttl": 2,
                "keys": ["/torch/elastic/rendezvous_nodes/chaos-1/127.0.0.1_101_0"],
                "pids": [101],
            },
            {"id": 8, "ttl": 7000, "keys": ["/torch/elastic/rendezvous/chaos-1"], "pids": []},
        ],
    )
    found = h.check()
    assert [v.invariant for v in found] == ["no-leaks"]
    assert found[0].nodes == ["n1"]


def test_a_node_that_crashes_is_reported():
    h = clean()
    h.run("proc_end", 21.0, node="n1", rc=1, killed=False, stderr="Traceback ...")
    assert h.invariants() == ["node-crashed"]


def test_a_torchrun_agent_failing_with_a_named_error_or_told_to_leave_did_not_crash():
    named = "Traceback ...\netcd_rendezvous.api.RendezvousTimeoutError: could not join\n"
    left = "Traceback ...\ntorch...api.SignalException: Process 7 got signal: 15\n"
    h = clean()
    h.run("proc_end", 21.0, node="n1", rc=1, killed=False, stderr=named)
    assert h.invariants() == []
    h = clean()
    h.run("proc_end", 21.0, node="n1", rc=1, killed=False, stderr=left)
    assert h.invariants() == ["node-crashed"]  # nobody asked it to leave
    h = clean()
    h.fault("leave", 10.0, None, "n1")
    h.run("proc_end", 21.0, node="n1", rc=1, killed=False, stderr=left)
    assert "node-crashed" not in h.invariants()
    h = clean()
    h.fault("leave", 10.0, None, "n1")
    h.run("proc_end", 21.0, node="n1", rc=-15, killed=False, stderr="")  # ended by SIGTERM
    assert "node-crashed" not in h.invariants()


def test_torchrun_agents_that_all_exit_with_a_named_error_satisfy_liveness():
    named = "Traceback ...\netcd_rendezvous.api.RendezvousConnectionError: unreachable\n"
    h = History()
    h.faults_over(5.0)
    for name in ("n0", "n1", "n2"):
        h.run("proc_end", 6.0, node=name, rc=1, killed=False, stderr=named)
    h.finish(50.0)
    assert checker.liveness(h.scenario, h.runner, h.nodes).how == "failed"
    h = History()
    h.faults_over(5.0)
    for name in ("n0", "n1", "n2"):  # a crash is no named failure
        h.run("proc_end", 6.0, node=name, rc=1, killed=False, stderr="Traceback ...\nKeyError")
    h.finish(50.0)
    assert "liveness" in h.invariants()


# -- healthy nodes kept ---------------------------------------------------------------------


def states(h: History, at: float, before: dict[str, int], after: dict[str, int]) -> None:
    h.run("state", at - 0.5, round=0, complete=True, participants=before, wait_list=[])
    h.run("state", at, round=0, complete=True, participants=after, wait_list=[])


def everyone() -> dict[str, int]:
    return {"127.0.0.1_100_0": 0, "127.0.0.1_101_0": 1, "127.0.0.1_102_0": 2}


def test_a_healthy_node_taken_out_of_its_round_is_reported():
    h = clean()
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    found = h.check()
    assert [v.invariant for v in found] == ["healthy-kept"]
    assert found[0].nodes == ["n1"]


def test_a_drop_seen_late_counts_the_faults_since_the_node_was_last_seen_in():
    """The runner could not read the state during an etcd pause: the drop it sees 6 s
    after the pause ended may have been made right after it (a newcomer reading the
    heartbeats the pause made stale), so the pause counts."""
    h = clean()
    h.run("state", 3.0, round=0, complete=True, participants=everyone(), wait_list=[])
    h.fault("etcd_pause", 3.5, 6.0, "leader")
    dropped = {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2}
    h.run("state", 12.0, round=0, complete=True, participants=dropped, wait_list=[])
    assert "healthy-kept" not in h.invariants()
    # Seen in until just before: the pause is then more than the horizon (4 s) away.
    h.run("state", 11.5, round=0, complete=True, participants=everyone(), wait_list=[])
    h.runner.sort(key=lambda r: r["t"])
    assert "healthy-kept" in h.invariants()


def test_a_node_that_left_its_round_itself_was_not_dropped():
    h = clean()
    h.node("n1", 7.8, "join_start", call=2)
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    assert "healthy-kept" not in h.invariants()


def test_a_node_behind_a_clock_far_ahead_may_be_dropped_but_not_by_a_slow_one():
    h = clean()
    h.fault("clock", 1.0, None, "n2", offset=20.0)  # n2 runs 20 s ahead: PyTorch drops n1 too
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    assert "healthy-kept" not in h.invariants()
    h = clean()
    h.fault("clock", 1.0, None, "n2", offset=-20.0)  # n2 runs behind: only n2 is at risk
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    assert h.invariants() == ["healthy-kept"]


# -- scenarios --------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["3.4", "3.5", "3.5-v3", "3.6", "3.7"])
def test_a_seed_gives_the_same_scenario_every_time(flavor):
    for seed in range(1, 40):
        first, again = generate(seed, flavor), generate(seed, flavor)
        assert first == again
        # Forcing the family the seed drew changes nothing.
        assert generate(seed, flavor, first.family) == first
        assert Scenario.from_dict(first.as_dict()) == first


def test_scenarios_keep_to_their_rules():
    for seed in range(1, 200):
        for flavor in ("3.5", "3.6"):
            sc = generate(seed, flavor)
            assert 3 <= len(sc.nodes) <= 8
            assert sc.min_nodes <= sc.max_nodes
            if sc.api == "v3":
                assert all(n.impl != "torch" for n in sc.nodes)  # PyTorch's speak v2 only
            if sc.backend == "etcd":
                assert len(sc.nodes) <= sc.max_nodes
            if sc.members == 1:  # one member cannot stay down
                assert all(f.duration is not None for f in sc.faults if f.kind.startswith("etcd_"))
            gone = {f.target for f in sc.faults if f.kind in ("kill", "freeze", "leave")}
            assert len(sc.nodes) - len(gone) >= sc.min_nodes
            assert sc.settings["timeout"] > sc.liveness_bound().total


def test_the_bound_adds_up_its_terms():
    sc = Scenario(
        seed=1,
        flavor="3.5",
        family="mixed",
        backend="etcd-v2",
        run_id="r",
        members=3,
        min_nodes=2,
        max_nodes=3,
        nodes=[NodeSpec("n0", "ours", 0.0)],
        faults=[Fault("etcd_freeze", 3.0, None, "leader")],
        settings=dict(SETTINGS),
    )
    bound = sc.liveness_bound()
    assert bound.failover == 2.0 + 5.0  # request_timeout + silence_timeout: a member stays frozen
    assert bound.cycle == 2 * 3 + 4 + 6 + 4 + 1 + 2 + 2
    assert bound.total == bound.detect + 2 * bound.cycle + bound.failover + bound.margin


def test_liveness_does_not_apply_beyond_max_nodes():
    h = History(nodes=3)
    h.scenario["max_nodes"] = 2
    h.faults_over(5.0)
    live = checker.liveness(h.scenario, h.runner, h.nodes)
    assert not live.applies
    assert "max_nodes" in live.why


def test_a_node_whose_only_member_is_lost_is_not_waited_for():
    h = History()
    h.runner[1]["members"] = ["127.0.0.1:1"]  # n0 (PyTorch's) talks to one member
    h.fault("etcd_freeze", 3.0, None, "leader", member="127.0.0.1:1")
    h.faults_over(5.0)
    assert checker.healthy_nodes(h.scenario, h.runner, h.nodes) == ["n1", "n2"]


def test_pytorch_nodes_are_not_held_to_healthy_kept():
    h = clean()
    h.nodes["n1"][0]["impl"] = "torch"
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    assert "healthy-kept" not in h.invariants()


def test_long_leases_holding_nothing_after_shutdown_are_leaks():
    h = clean("etcd")
    orphan = {"id": 9, "ttl": 7100, "keys": [], "pids": []}
    h.run("leases", 25.0, leases=[orphan, {**orphan, "id": 10, "ttl": 3}])
    assert h.invariants() == ["no-leaks"]
    h.fault("kill", 3.0, None, "n2")  # n2 could not revoke its own
    h.runner = [r for r in h.runner if r["ev"] != "leases"]
    h.run("leases", 25.0, leases=[orphan])
    assert "no-leaks" not in h.invariants()


def test_etcd_v2_nodes_may_each_leave_one_lease_emptied_by_the_states_writers():
    h = clean("etcd-v2")
    orphans = [{"id": i, "ttl": 7100, "keys": [], "pids": []} for i in range(10, 14)]
    h.run("leases", 25.0, leases=orphans[:3])  # one for each of the three nodes
    assert "no-leaks" not in h.invariants()
    h.runner = [r for r in h.runner if r["ev"] != "leases"]
    h.run("leases", 25.0, leases=orphans)  # a fourth: more than one of some node's
    assert h.invariants() == ["no-leaks"]


def test_a_legacy_member_key_lapsing_after_shutdown_is_not_a_leak_but_a_long_lease_is():
    key = "/torchelastic/p2p/run_chaos-1/rdzv/v_1/node_00aa"
    lapsing = {"id": 7, "ttl": 6, "keys": [key], "pids": [101]}
    h = clean("etcd")
    h.run("leases", 25.0, leases=[lapsing])
    assert h.check() == []
    h.runner = [r for r in h.runner if r["ev"] != "leases"]
    h.run("leases", 25.0, leases=[{**lapsing, "ttl": 7000}])
    assert h.invariants() == ["no-leaks"]


def test_a_stalled_machine_disturbs_everyone_and_gives_its_time_back():
    h = clean()
    states(h, 8.0, everyone(), {"127.0.0.1_100_0": 0, "127.0.0.1_102_0": 2})
    assert h.invariants() == ["healthy-kept"]
    h.run("stall", 6.5, start=T0 + 5.0, late=1.5)
    assert h.check() == []
    # A late progress is on time once the stall is given back.
    h = History()
    h.faults_over(5.0)
    h.round(["n0", "n1", "n2"], 0, at=5.0 + BOUND - 1.0, steps=3)
    h.finish(60.0)
    assert h.invariants() == ["liveness"]
    h.run("stall", 20.0, start=T0 + 10.0, late=3.0)
    assert h.check() == []
