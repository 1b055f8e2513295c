"""Unit tests of the batched legacy join's decisions (etcd_rendezvous._legacy.admission):
plain functions of what a worker observed, so every case is spelled out here."""

from __future__ import annotations

import json
from typing import Any

import pytest

from etcd_rendezvous._legacy.admission import (
    ADMISSION_GRACE,
    ADMIT_CANDIDATES,
    ADMIT_GATHER,
    ADMIT_STAGGER,
    ADMIT_TAIL,
    AdmissionStep,
    Admit,
    Admitted,
    Announced,
    Complete,
    Confirm,
    ConfirmationStep,
    Leave,
    Read,
    Wait,
    admission_step,
    admit_delay,
    announced,
    confirmation_step,
    create_spread,
    grace,
    plan_admission,
    plan_confirmation,
    plan_freeze,
    refusal_verdict,
)
from etcd_rendezvous._legacy.feed import SILENCE, SILENCE_MAX, Observed, StateFeed
from etcd_rendezvous._legacy.rendezvous import progress_line
from etcd_rendezvous._legacy.state import (
    CONST_ETCD_FROZEN_TTL,
    CONST_ETCD_JOINABLE_EPHEMERAL_TTL,
    MEMBERS,
    Hint,
    describe,
)
from etcd_rendezvous._transport.interface import Node
from etcd_rendezvous._transport.limits import Refusal, Verdict
from etcd_rendezvous.api import Deadline, RendezvousStateError, RequestTooLargeError
from etcd_rendezvous.layout import LegacyLayout, new_member_name

LAYOUT = LegacyLayout("/p", "r")
VDIR = LAYOUT.version_dir("1")


def entry(i: int, created: int | None = None) -> Announced:
    """The member key ``node_<i>`` created at index ``created`` (default ``100 + i``)."""
    name = new_member_name(i)
    return Announced(100 + i if created is None else created, name, LAYOUT.member_key("1", name))


A, B, C, D = (entry(i) for i in range(1, 5))


def joinable(participants: int = 0, members: dict[str, int] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"status": "joinable", "version": "1"}
    state["participants"] = list(range(participants))
    if members is not None:
        state[MEMBERS] = members
    return state


def observed(state: dict[str, Any] | None, index: int = 50) -> Observed:
    node = None
    if state is not None:
        node = Node(LAYOUT.state_key, "{}", index, 1, index, None, False, (), "get")
    return Observed(node, state, index)


# -- the listing --------------------------------------------------------------------------


def _child(key: str, created: int, is_dir: bool = False) -> Node:
    return Node(key, None if is_dir else "", created, created, 200, 10, is_dir, (), "get")


def test_announced_keeps_member_keys_oldest_first() -> None:
    listing = Node(
        VDIR,
        None,
        1,
        1,
        200,
        None,
        True,
        (
            _child(B.key, B.created_index),
            _child(f"{VDIR}/rank_3", 90),
            _child(f"{VDIR}/kv", 91, is_dir=True),
            _child(f"{VDIR}/extra_data", 92),
            _child(f"{VDIR}/node_xyz", 93),
            _child(A.key + "/", A.created_index),
        ),
        "get",
    )
    assert announced(listing) == [A, B]


# -- admission ----------------------------------------------------------------------------


def test_admission_appends_ranks_in_announce_order_and_records_members() -> None:
    state = joinable(1)  # a PyTorch worker joined first
    write = plan_admission(state, [A, B, C], min_workers=5, max_workers=8)
    assert write is not None
    assert write.state["participants"] == [0, 1, 2, 3]
    assert write.state[MEMBERS] == {A.name: 1, B.name: 2, C.name: 3}
    assert write.state["status"] == "joinable"
    assert write.ttl is None  # below min_workers: no TTL, as PyTorch's join writes it
    assert state == joinable(1)  # not modified


def test_admission_skips_admitted_keys_and_gives_the_joinable_ttl_from_min() -> None:
    state = joinable(2, {A.name: 0})
    write = plan_admission(state, [A, B], min_workers=3, max_workers=8)
    assert write is not None
    assert write.state[MEMBERS] == {A.name: 0, B.name: 2}
    assert write.ttl == CONST_ETCD_JOINABLE_EPHEMERAL_TTL


def test_admission_with_nothing_new_writes_nothing() -> None:
    assert plan_admission(joinable(1, {A.name: 0}), [A], min_workers=1, max_workers=4) is None


def test_admission_leaves_out_older_keys_when_impatient() -> None:
    write = plan_admission(
        joinable(), [A, B, C], min_workers=1, max_workers=8, skip_older_than=B.created_index
    )
    assert write is not None
    assert write.state[MEMBERS] == {B.name: 0, C.name: 1}


def test_admission_reaching_max_freezes_with_our_members_confirmed() -> None:
    # Rank 0 is a PyTorch worker: it confirms itself, so the state stays frozen.
    write = plan_admission(joinable(1), [A, B, C], min_workers=1, max_workers=3)
    assert write is not None
    assert write.state["status"] == "frozen"
    assert write.state[MEMBERS] == {A.name: 1, B.name: 2}  # C is late
    assert write.state["keep_alives"] == [A.key, B.key]
    assert write.ttl == CONST_ETCD_FROZEN_TTL


def test_admission_reaching_max_with_only_our_members_is_final_at_once() -> None:
    write = plan_admission(joinable(1, {A.name: 0}), [A, B], min_workers=2, max_workers=2)
    assert write is not None
    assert write.state["status"] == "final"
    assert write.state["keep_alives"] == [A.key, B.key]
    assert write.state["num_workers_waiting"] == 0
    assert write.ttl is None


def test_freezing_leaves_out_members_whose_keys_are_gone() -> None:
    # A's key lapsed: it is not in the listing, so only B is confirmed.
    write = plan_freeze(joinable(2, {A.name: 0, B.name: 1}), [B], min_workers=1)
    assert write.state["status"] == "frozen"
    assert write.state["keep_alives"] == [B.key]
    assert write.ttl == CONST_ETCD_FROZEN_TTL


def test_admission_into_a_full_joinable_state_names_the_mismatch() -> None:
    with pytest.raises(RendezvousStateError, match="max_workers"):
        plan_admission(joinable(3), [A], min_workers=1, max_workers=3)


# -- confirmation -------------------------------------------------------------------------


def frozen(keep_alives: list[str], members: dict[str, int], participants: int) -> dict[str, Any]:
    return {
        "status": "frozen",
        "version": "1",
        "participants": list(range(participants)),
        MEMBERS: members,
        "keep_alives": keep_alives,
    }


def test_confirmation_adds_our_live_members_after_pytorchs() -> None:
    torch_key = LAYOUT.keep_alive_key("1", 0)
    state = frozen([torch_key], {A.name: 2, B.name: 1}, 3)
    write = plan_confirmation(state, [A, B], min_workers=1)
    assert write is not None
    assert write.state["keep_alives"] == [torch_key, B.key, A.key]  # by rank
    assert write.state["status"] == "final"
    assert write.ttl is None


def test_confirmation_can_leave_lower_ranks_out_and_stay_frozen() -> None:
    state = frozen([], {A.name: 0, B.name: 1}, 2)
    write = plan_confirmation(state, [A, B], min_workers=1, skip_below_rank=1)
    assert write is not None
    assert write.state["keep_alives"] == [B.key]
    assert write.state["status"] == "frozen"
    assert write.ttl == CONST_ETCD_FROZEN_TTL
    assert plan_confirmation(write.state, [B], min_workers=1) is None


# -- what a waiting worker does ------------------------------------------------------------


_LATE = "version 1 ended before we were admitted"
_GONE = "Rendezvous state transition no longer possible."
#: A and B admitted; C, announced later, is left the oldest un-admitted worker.
_AB_ADMITTED = joinable(2, {A.name: 0, B.name: 1})


def hint(index: int, decided_upto: int, status: str = "joinable", version: str = "1") -> Hint:
    return Hint(index, status, version, decided_upto, count=2, waiting=0)


#: The last state write admitted the keys up to index 100 (A and older).
_DECIDED = 100
_ONE_STEP = admit_delay(2, A.name)


@pytest.mark.parametrize(
    ("state", "news", "me", "quiet_for", "expected"),
    [
        pytest.param(joinable(), None, A, 0.0, Wait(ADMIT_GATHER), id="oldest-gathers-first"),
        pytest.param(joinable(), None, A, ADMIT_GATHER, Admit(), id="oldest-admits-first"),
        pytest.param(joinable(), None, B, ADMIT_GATHER, Wait(ADMIT_STAGGER), id="next-waits"),
        pytest.param(
            joinable(), None, B, _ONE_STEP, Admit(), id="next-admits-a-slow-oldest-one-step-later"
        ),
        pytest.param(joinable(), hint(60, 103), C, 0.0, Read(), id="hint-says-our-key-was-decided"),
        pytest.param(
            joinable(), hint(60, 101, "frozen"), C, 0.0, Read(), id="hint-says-status-changed"
        ),
        pytest.param(
            joinable(), hint(60, 102), C, 0.0, Wait(admit_delay(3, C.name)), id="hint-not-ours"
        ),
        pytest.param(joinable(3, {B.name: 2}), None, B, 0.0, Admitted(2), id="admitted-has-rank"),
        pytest.param(
            joinable(), hint(60, 500), B, 0.0, Read(), id="a-hint-is-never-taken-for-admission"
        ),
        pytest.param(None, None, B, 0.0, Leave(_LATE), id="no-state"),
        pytest.param({"status": "setup"}, None, B, 0.0, Leave(_LATE), id="setup"),
        pytest.param({"status": "closed"}, None, B, 0.0, Leave(_LATE), id="closed"),
        pytest.param({**joinable(), "version": "2"}, None, B, 0.0, Leave(_LATE), id="next-version"),
        pytest.param(
            frozen([], {A.name: 0}, 1),
            None,
            B,
            0.0,
            Leave("version 1 became frozen without us: late"),
            id="frozen-without-us",
        ),
        pytest.param(
            {**frozen([A.key], {A.name: 0}, 1), "status": "final", "num_workers_waiting": 0},
            None,
            B,
            0.0,
            Leave("version 1 became final without us: late"),
            id="final-without-us",
        ),
    ],
)
def test_admission_step(
    state: dict[str, Any] | None,
    news: Hint | None,
    me: Announced,
    quiet_for: float,
    expected: AdmissionStep,
) -> None:
    """What a worker waiting to be admitted does next, for each state it may observe (and
    hint of a newer one): keys A (101), B (102), C (103) after the last decided one (100)."""
    step = admission_step(observed(state, 50), news, _DECIDED, "1", me, quiet_for)
    if isinstance(expected, Wait) and isinstance(step, Wait):
        assert step.timeout == pytest.approx(expected.timeout)
    else:
        assert step == expected


def test_a_slow_head_is_admitted_by_its_successor() -> None:
    """B fires one stagger after A would have; its batch admits A too, in created order."""
    assert admit_delay(B.created_index - _DECIDED, B.name) > admit_delay(1, A.name)
    assert admission_step(observed(joinable(), 50), None, _DECIDED, "1", B, _ONE_STEP) == Admit()
    write = plan_admission(joinable(), [A, B, C], min_workers=1, max_workers=8)
    assert write is not None
    assert write.state[MEMBERS] == {A.name: 0, B.name: 1, C.name: 2}


def test_a_far_behind_worker_waits_for_the_tail_before_it_lists() -> None:
    """Beyond the candidates' steps a worker never fires before every candidate had its
    turn, then at a moment of its own (drawn from its name), within the tail."""
    candidates_done = ADMIT_GATHER + ADMIT_STAGGER * (ADMIT_CANDIDATES - 1)
    delays = [admit_delay(ADMIT_CANDIDATES + i, new_member_name(i * 7919)) for i in range(200)]
    assert all(candidates_done <= d <= candidates_done + ADMIT_TAIL for d in delays)
    assert len({round(d, 3) for d in delays}) > 100  # spread, not all at once
    far = entry(1, created=_DECIDED + 1000)
    quiet = candidates_done - 0.01
    step = admission_step(observed(joinable(), 50), None, _DECIDED, "1", far, quiet)
    assert isinstance(step, Wait)
    # The delays never shrink with the distance: the oldest undecided worker goes first.
    assert [admit_delay(d, A.name) for d in range(1, 20)] == sorted(
        admit_delay(d, A.name) for d in range(1, 20)
    )


def test_the_state_and_hint_writes_do_not_count_in_the_distance() -> None:
    """Our key came after the batch's state write (101) and hint (102): it is first."""
    me = entry(3, created=103)
    step = admission_step(observed(joinable(), 101), None, 100, "1", me, ADMIT_GATHER, (101, 102))
    assert step == Admit()
    assert admission_step(observed(joinable(), 101), None, 100, "1", me, ADMIT_GATHER) == Wait(
        pytest.approx(2 * ADMIT_STAGGER)
    )


def test_without_a_decided_index_the_distance_is_from_the_state() -> None:
    """No hint (PyTorch's workers made the state): the distance counts from the state's
    own index; a key older than the state, not admitted, is first in line."""
    old = entry(1, created=40)
    assert admission_step(observed(joinable(), 50), None, 0, "1", old, ADMIT_GATHER) == Admit()


_MEMBERS = {A.name: 0, B.name: 1, C.name: 2}
#: Frozen by a PyTorch worker (rank 3): none of ours confirmed yet.
_FROZEN_BY_TORCH = frozen([], _MEMBERS, 4)
_CONFIRMED = frozen([A.key, B.key, C.key], _MEMBERS, 4)
_LONG = 100.0


@pytest.mark.parametrize(
    ("state", "news", "me", "quiet_for", "unheard", "expected"),
    [
        pytest.param(_FROZEN_BY_TORCH, None, A, 0.0, _LONG, Confirm(), id="lowest-confirms"),
        pytest.param(
            _FROZEN_BY_TORCH, None, C, 0.0, _LONG, Wait(grace(2)), id="others-wait-their-turn"
        ),
        pytest.param(
            _FROZEN_BY_TORCH,
            None,
            C,
            grace(2),
            _LONG,
            Confirm(without_lower=True),
            id="then-confirm-anyway",
        ),
        pytest.param(_CONFIRMED, None, A, 0.0, _LONG, Wait(_LONG), id="confirmed-waits"),
        pytest.param(
            {**_CONFIRMED, "status": "final", "num_workers_waiting": 0},
            None,
            A,
            0.0,
            _LONG,
            Complete(world_size=4),
            id="final-completes",
        ),
        pytest.param(joinable(3, _MEMBERS), None, A, 0.0, _LONG, Wait(_LONG), id="joinable-waits"),
        pytest.param(
            joinable(3, _MEMBERS), hint(60, 200), A, 0.0, _LONG, Wait(_LONG), id="more-admitted"
        ),
        pytest.param(
            joinable(3, _MEMBERS), hint(60, 200, "final"), A, 0.0, _LONG, Read(), id="hint-final"
        ),
        pytest.param(
            _CONFIRMED, hint(60, 200, "frozen"), A, 0.0, _LONG, Read(), id="frozen-any-news"
        ),
        pytest.param(
            joinable(3, _MEMBERS), None, A, 0.0, 0.0, Read(silence=True), id="silence-reads"
        ),
        pytest.param(None, None, A, 0.0, _LONG, Leave(_GONE), id="no-state"),
        pytest.param(_CONFIRMED, None, D, 0.0, _LONG, Leave(_GONE), id="not-a-member"),
    ],
)
def test_confirmation_step(
    state: dict[str, Any] | None,
    news: Hint | None,
    me: Announced,
    quiet_for: float,
    unheard: float,
    expected: ConfirmationStep,
) -> None:
    """What an admitted worker does next until the version is final."""
    step = confirmation_step(observed(state), news, "1", me.name, VDIR, quiet_for, unheard)
    assert step == expected


def test_the_grace_grows_with_the_place_in_line_up_to_twice_its_length() -> None:
    assert grace(1) == ADMISSION_GRACE
    assert ADMISSION_GRACE < grace(2) < grace(3) < 2 * ADMISSION_GRACE
    assert grace(1000) == 2 * ADMISSION_GRACE


def test_create_spread_grows_with_workers_and_round_trips_and_is_capped() -> None:
    assert all(0 <= create_spread(1, 0.0) <= 0.001 for _ in range(100))
    assert all(0 <= create_spread(64, 0.001) <= 64 * 0.003 for _ in range(100))
    assert max(create_spread(10_000, 1.0) for _ in range(100)) <= 2.0


# -- the state feed -----------------------------------------------------------------------


#: The deadline of the feed's requests (the fakes answer at once).
FOREVER = Deadline.never()


class _Stream:
    """A watch stream whose changes the test hands over (``delivered``)."""

    def __init__(self) -> None:
        self.delivered: list[Node] = []
        self.closed = False

    def next(self, deadline: Deadline) -> Node | None:
        return self.delivered.pop(0) if self.delivered else None

    def close(self) -> None:
        self.closed = True


class _Conn:
    """What StateFeed asks of a transport: one read of the state, then a stream."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.node = Node(LAYOUT.state_key, json.dumps(state), 10, 1, 10, None, False, (), "get")
        self.reads = 0
        self.streams: list[_Stream] = []

    def get(self, key: str, *, deadline: Deadline) -> Node:
        self.reads += 1
        return self.node

    def watch_stream(self, key: str, start_index: int, *, deadline: Deadline) -> _Stream:
        assert start_index == 0 or start_index == self.node.etcd_index + 1
        self.streams.append(_Stream())
        return self.streams[-1]


def _change(state: dict[str, Any] | None, index: int) -> Node:
    if state is None:
        return Node(LAYOUT.state_key, None, index, 1, index, None, False, (), "delete")
    return Node(LAYOUT.state_key, json.dumps(state), index, 1, index, None, False, (), "set")


def _feed(state: dict[str, Any]) -> tuple[StateFeed, _Conn]:
    conn = _Conn(state)
    feed = StateFeed(conn, LAYOUT.state_key, lambda node: json.loads(node.value or ""))  # type: ignore[arg-type]
    return feed, conn


def test_the_feed_hands_out_the_changes_its_stream_already_delivered() -> None:
    """A caller that goes round without waiting (it read the key itself) must not decide
    again on a state that is gone: current() takes in what the stream delivered."""
    final = {"status": "final", "version": "1", "participants": [0]}
    feed, conn = _feed(final)
    assert feed.current(FOREVER).state == final
    assert len(conn.streams) == 1  # opened from now, before the read
    conn.streams[0].delivered.append(_change(None, 11))
    assert feed.current(FOREVER).state is None
    assert feed.current(FOREVER).index == 11
    assert conn.reads == 1


def test_a_change_delivered_before_the_wait_counts_as_one() -> None:
    feed, conn = _feed(joinable(1))
    feed.current(FOREVER)
    feed.wait(0.0, FOREVER)
    conn.streams[0].delivered.append(_change(joinable(2), 11))
    assert feed.wait(0.0, FOREVER) is True
    assert feed.current(FOREVER).state == joinable(2)
    assert feed.wait(0.0, FOREVER) is False


def test_the_feed_decodes_only_the_newest_of_a_burst() -> None:
    parsed: list[int] = []
    conn = _Conn(joinable(1))

    def parse(node: Node) -> dict[str, Any]:
        parsed.append(node.modified_index)
        return dict(json.loads(node.value or ""))

    feed = StateFeed(conn, LAYOUT.state_key, parse)  # type: ignore[arg-type]
    feed.current(FOREVER)
    feed.wait(0.0, FOREVER)
    conn.streams[0].delivered.extend(_change(joinable(n), 10 + n) for n in range(2, 6))
    assert feed.wait(0.0, FOREVER) is True
    assert feed.current(FOREVER).state == joinable(5)
    assert parsed == [10, 15]


# -- the feed following the progress hint ---------------------------------------------------

_HINT_KEY = LAYOUT.progress_key("1")


class _HintConn(_Conn):
    """A transport with the state key and the version's progress key."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__(state)
        self.hint: Node | None = None

    def try_get(self, key: str, *, deadline: Deadline) -> Node | None:
        assert key == _HINT_KEY
        return self.hint


def _hint_write(value: str, index: int, action: str = "set") -> Node:
    return Node(_HINT_KEY, value, index, 1, index, None, False, (), action)


def _following(state: dict[str, Any]) -> tuple[StateFeed, _HintConn]:
    conn = _HintConn(state)
    feed = StateFeed(conn, LAYOUT.state_key, lambda node: json.loads(node.value or ""))  # type: ignore[arg-type]
    feed.current(FOREVER)
    feed.follow_hints(_HINT_KEY, FOREVER)
    return feed, conn


def test_a_worker_following_the_hint_reads_the_state_only_when_told() -> None:
    feed, conn = _following(joinable(1))
    hints = conn.streams[-1]
    hints.delivered.append(_hint_write(describe(joinable(2), 12, 11).encode(), 13))
    assert feed.wait(0.0, FOREVER) is True
    assert feed.news == describe(joinable(2), 12, 11)
    assert feed.current(FOREVER).state == joinable(1)  # not read: a hint is not the state
    assert conn.reads == 1
    conn.node = _change(joinable(2), 12)
    conn.node = Node(LAYOUT.state_key, conn.node.value, 12, 1, 14, None, False, (), "get")
    assert feed.refresh(FOREVER).state == joinable(2)
    assert feed.news is None
    assert conn.reads == 2


def test_a_hint_is_never_trusted_over_the_state() -> None:
    """A hint that claims a state newer than etcd holds is news once: after a read made
    later than the hint, the state is what counts, and the hint is dropped."""
    feed, conn = _following(joinable(1))
    conn.streams[-1].delivered.append(_hint_write(describe(joinable(9), 999, 999).encode(), 13))
    assert feed.wait(0.0, FOREVER) is True
    assert feed.news is not None
    conn.node = Node(LAYOUT.state_key, json.dumps(joinable(1)), 10, 1, 14, None, False, (), "get")
    assert feed.refresh(FOREVER).state == joinable(1)
    assert feed.news is None
    assert feed.hint is None


@pytest.mark.parametrize(
    "event",
    [
        _hint_write("{not json", 13),
        _hint_write('{"index": "12"}', 13),
        _hint_write("", 13, action="delete"),
    ],
    ids=["garbage", "wrong-fields", "deleted"],
)
def test_a_broken_hint_is_ignored(event: Node) -> None:
    feed, conn = _following(joinable(1))
    conn.streams[-1].delivered.append(event)
    assert feed.wait(0.0, FOREVER) is False
    assert feed.news is None


def test_silence_doubles_after_reads_that_find_nothing_and_resets_on_news() -> None:
    feed, conn = _following(joinable(1))
    assert SILENCE <= feed.silence <= 1.25 * SILENCE
    feed.refresh(FOREVER)
    assert 2 * SILENCE <= feed.silence <= 1.25 * min(2 * SILENCE, SILENCE_MAX)
    feed.refresh(FOREVER)
    assert min(4 * SILENCE, SILENCE_MAX) <= feed.silence <= 1.25 * min(4 * SILENCE, SILENCE_MAX)
    for _ in range(5):
        feed.refresh(FOREVER)
    assert SILENCE_MAX <= feed.silence <= 1.25 * SILENCE_MAX
    conn.node = Node(LAYOUT.state_key, json.dumps(joinable(2)), 20, 1, 20, None, False, (), "get")
    feed.refresh(FOREVER)
    assert SILENCE <= feed.silence <= 1.25 * SILENCE


def test_a_frozen_state_is_read_within_half_its_ttl_however_long_the_quiet() -> None:
    """A state frozen by PyTorch's worker (no hint) lapses CONST_ETCD_FROZEN_TTL after its
    last write unless our members confirm. However long the state stayed quiet before
    (the silence backs off), the next read comes within half that TTL, jitter included,
    leaving the other half for the read, the hint and the confirming write."""
    feed, _ = _following(joinable(1))
    for _ in range(20):
        feed.refresh(FOREVER)  # nothing new, again and again
    longest = max(feed.silence for _ in range(2000))
    assert longest <= CONST_ETCD_FROZEN_TTL / 2


def test_a_hint_round_trips_and_rejects_what_is_not_one() -> None:
    written = describe({**joinable(3), "num_workers_waiting": 2}, 42, 40)
    assert written == Hint(42, "joinable", "1", 40, count=3, waiting=2)
    assert Hint.decode(written.encode()) == written
    assert Hint.decode(None) is None
    assert Hint.decode("[]") is None
    assert Hint.decode(written.encode().replace("42", "true")) is None


def test_a_decided_worker_reads_when_it_may_be_the_last_call_worker_or_after_a_silence() -> None:
    """A hint that decided our key leads to a read only once min_workers joined (our rank
    may be min_workers - 1) or after a silence; until then, one read at the end does."""
    decided = hint(60, 103)  # count 2
    now = observed(joinable(), 50)
    assert admission_step(now, decided, 0, "1", C, 0.0, min_workers=2) == Read()
    assert admission_step(now, decided, 0, "1", C, 0.0, min_workers=3, unheard=1.5) == Wait(1.5)
    assert admission_step(now, decided, 0, "1", C, 0.0, min_workers=3, unheard=0.0) == Read(
        silence=True
    )


# -- reports of a write refused for its size --------------------------------------------------


def report(
    index: int,
    *,
    status: str = "joinable",
    decided: int = 100,
    upto: int = 103,
    count: int = 4,
    completing: bool = False,
    version: str = "1",
) -> Hint:
    """A hint of the state of ``index`` reporting that etcd refused a write on it of
    ``count`` participants, made from a listing at ``upto``."""
    refusal = Refusal(
        upto, count, completing, "the worker with member key x", "/state", 5000, "e", "a", "v3"
    )
    return Hint(index, status, version, decided, 2, 0, refused=refusal)


#: The report was written at index 110: A (101), B (102), C (103) announced before it,
#: D (140) after.
_WRITTEN = 110
_D_LATE = entry(4, created=140)


@pytest.mark.parametrize(
    ("the_report", "state", "me", "min_workers", "expected"),
    [
        pytest.param(
            report(50), joinable(2, {A.name: 0}), B, 4, Verdict.FAIL, id="cannot-complete"
        ),
        pytest.param(
            report(50), joinable(2, {A.name: 0}), A, 4, Verdict.FAIL, id="admitted-cannot-complete"
        ),
        pytest.param(
            report(50), joinable(2, {A.name: 0}), _D_LATE, 4, Verdict.VERIFY, id="late-checks-etcd"
        ),
        pytest.param(
            report(50), joinable(2, {A.name: 0}), C, 3, Verdict.FAIL, id="in-the-refused-write"
        ),
        pytest.param(
            report(50, decided=101),
            joinable(2, {A.name: 0}),
            A,
            3,
            Verdict.IGNORE,
            id="decided-and-the-version-can-complete",
        ),
        pytest.param(
            report(50, upto=102),
            joinable(2, {A.name: 0}),
            C,
            3,
            Verdict.IGNORE,
            id="not-in-the-refused-write-and-the-version-can-complete",
        ),
        pytest.param(
            report(50, completing=True),
            joinable(2, {A.name: 0}),
            A,
            1,
            Verdict.FAIL,
            id="a-refused-freeze-ends-the-version",
        ),
        pytest.param(
            report(50, version="2"), joinable(2), B, 4, Verdict.IGNORE, id="another-version"
        ),
        pytest.param(
            report(40),
            frozen([], {A.name: 0, B.name: 1}, 2),
            B,
            4,
            Verdict.IGNORE,
            id="the-version-moved-on-since",
        ),
        pytest.param(
            report(40),
            joinable(3, {A.name: 0, B.name: 1, C.name: 2}),
            C,
            3,
            Verdict.IGNORE,
            id="admitted-since-by-a-smaller-write",
        ),
        pytest.param(
            report(40),
            joinable(3, {A.name: 0}),
            B,
            4,
            Verdict.FAIL,
            id="an-older-report-of-the-same-version-that-cannot-complete",
        ),
        pytest.param(
            Hint(50, "joinable", "1", 100, 2, 0), joinable(2), A, 4, Verdict.IGNORE, id="no-report"
        ),
    ],
)
def test_refusal_verdict(
    the_report: Hint,
    state: dict[str, Any],
    me: Announced,
    min_workers: int,
    expected: Verdict,
) -> None:
    """What a worker of version 1 holding ``state`` (index 50) does about a report of a
    refused write (of 4 participants, listed up to C's key) written at index 110."""
    verdict = refusal_verdict(
        the_report, _WRITTEN, observed(state, 50), "1", me, min_workers=min_workers
    )
    assert verdict is expected


@pytest.mark.parametrize(
    "garbage",
    [
        "not json",
        {"upto": -1},
        {"upto": 5, "count": 2, "completing": "yes", "by": "", "key": "", "size": 1},
        {"upto": True, "count": 2, "completing": False, "by": "", "key": "", "size": 1},
        [1, 2],
    ],
)
def test_a_garbled_report_leaves_the_hint_without_one(garbage: Any) -> None:
    plain = hint(60, 101)
    value = json.loads(plain.encode())
    value["refused"] = garbage
    assert Hint.decode(json.dumps(value)) == plain
    assert Refusal.decode(garbage) is None


def test_a_report_reads_back_as_written_and_comes_after_its_state_s_hint() -> None:
    marked = report(60)
    assert Hint.decode(marked.encode()) == marked
    plain = hint(60, 100)
    assert plain.newness < marked.newness < hint(61, 0).newness
    # A second refusal on the same state, from a later listing, is reported too.
    assert marked.newness < report(60, upto=120).newness
    error = marked.refused.error("The worker with member key k") if marked.refused else None
    assert isinstance(error, RequestTooLargeError)
    assert "--max-request-bytes" in str(error)
    assert (error.key, error.size, error.api) == ("/state", 5000, "v3")


def test_the_progress_line_of_a_worker_in_a_final_version_says_nothing() -> None:
    """A final version with this worker in it is its call returning, not a version
    "complete without us"; one without it is. The final state is the one our
    confirmation writes, after a PyTorch worker's."""
    torch_key = LAYOUT.keep_alive_key("1", 0)
    frozen_state = frozen([torch_key], {A.name: 2, B.name: 1}, 3)
    write = plan_confirmation(frozen_state, [A, B], min_workers=1)
    assert write is not None
    assert write.state["status"] == "final"
    final = write.state
    assert progress_line(final, A.key, "r", (2, 3), 9.0) is None
    assert progress_line(final, B.key.lstrip("/"), "r", (2, 3), 9.0) is None  # (as spelled)
    assert "complete with 3 workers without us" in (
        progress_line(final, C.key, "r", (2, 3), 9.0) or ""
    )
    assert "without us" in (progress_line(final, None, "r", (2, 3), 9.0) or "")
    joinable = {"status": "joinable", "version": "2", "participants": [0]}
    assert progress_line(joinable, A.key, "r", (2, 3), 9.4) == (
        "Rendezvous of run 'r': 1 of 2 workers joined version 2 (max 3), "
        "waiting for 1 more; 9 s left"
    )
