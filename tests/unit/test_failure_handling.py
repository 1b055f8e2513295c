"""How failures are classified and how deadlines are shared, without a server.

The end-to-end behaviour (a real cluster losing its leader, real servers killed or
suspended) is tested in ``tests/integration/test_failover.py`` and
``tests/integration/test_deadlines.py``; these cases pin down the rules those tests depend on.
"""

from __future__ import annotations

import json
import threading
import time
from base64 import b64decode
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from etcd_rendezvous._dynamic.periodic import _PeriodicTimer
from etcd_rendezvous._transport import v3_wire as wire
from etcd_rendezvous._transport.attempt import (
    AmbiguousError,
    Outcome,
    UnsentError,
    transient_answer,
    try_once,
)
from etcd_rendezvous._transport.endpoints import Endpoints, Timeouts
from etcd_rendezvous._transport.interface import (
    CompareFailedError,
    KeyExistsError,
    Node,
    WatchStream,
)
from etcd_rendezvous._transport.v2_session import ErrorAnswer, transient
from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.api import Deadline, RendezvousConnectionError
from etcd_rendezvous.etcd_store import EtcdStore, _tagged

# -- what an election answers ------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        "etcdserver: no leader",
        "raft proposal dropped",
        "etcdserver: not leader",
        "etcdserver: too many requests",
    ],
)
def test_refusals_before_the_proposal_are_unsent(answer: str) -> None:
    assert isinstance(transient_answer("http://e:1", answer), UnsentError)


@pytest.mark.parametrize(
    "answer",
    [
        "etcdserver: request timed out",
        "etcdserver: request timed out, possibly due to previous leader failure",
        "etcdserver: leader changed",
        "etcdserver: server stopped",
    ],
)
def test_answers_after_the_proposal_have_an_unknown_outcome(answer: str) -> None:
    error = transient_answer("http://e:1", answer)
    assert isinstance(error, AmbiguousError)
    assert "http://e:1" in str(error)


def _v2_error(cause: str) -> ErrorAnswer:
    """etcd's v2 answer of errorCode 300 with ``cause``, as it comes on the wire."""
    payload = {"errorCode": 300, "message": "Raft Internal Error", "cause": cause, "index": 0}
    return ErrorAnswer.read(500, json.dumps(payload).encode())


@pytest.mark.parametrize(
    "cause",
    [
        "etcdserver: request timed out",
        "etcdserver: request timed out, possibly due to previous leader failure",
        "raft proposal dropped",
        "etcdserver: leader changed",
        "etcdserver: server stopped",
    ],
)
def test_v2_election_answers_are_transient(cause: str) -> None:
    assert transient(_v2_error(cause))


def test_v2_genuine_refusal_stays_an_error() -> None:
    # etcd 3.5 answers code 300 "Not a file" to refreshing a directory's TTL.
    assert not transient(_v2_error("Not a file"))


@pytest.mark.parametrize(
    ("status", "body", "code", "retried"),
    [
        # The status decides over the errorCode where python-etcd's reading does.
        (404, {"errorCode": 100, "message": "Key not found", "index": 7}, 100, False),
        (404, {"message": "no code"}, 100, False),
        (401, {"message": "Insufficient credentials"}, 110, False),
        (
            403,
            {"errorCode": 110, "message": "The request requires user authentication"},
            110,
            False,
        ),
        (400, {"errorCode": 301, "message": "Leader Election in progress"}, 301, True),
        (400, {"errorCode": 400, "message": "watcher is cleared due to etcd recovery"}, 400, True),
        (403, {"errorCode": 102, "message": "Not a file"}, 102, False),
        (500, {"message": "etcdserver: request timed out"}, None, True),  # a 5xx without code
        (400, {"errorCode": 209, "message": "Invalid field"}, 209, False),
        (503, "service unavailable", None, False),  # not JSON: no status, never retried
        (404, "404 page not found\n", None, False),  # no v2 API
    ],
)
def test_v2_error_answers_are_read_as_python_etcd_reads_them(
    status: int, body: dict[str, object] | str, code: int | None, retried: bool
) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    answer = ErrorAnswer.read(status, raw.encode())
    assert (answer.code, transient(answer)) == (code, retried)
    if isinstance(body, str):
        assert (answer.status, answer.text) == (None, f"Bad response : {body}")
    else:
        assert answer.text == f"{body.get('message')} : {body.get('cause')}"
        assert answer.index == body.get("index")


@pytest.mark.parametrize("message", ["raft proposal dropped", "etcdserver: unhealthy cluster"])
def test_v3_election_answers_without_a_transient_code_are_transient(message: str) -> None:
    # etcd maps an error it has no gRPC code for to Unknown (2), HTTP 500.
    assert wire.GrpcError(2, message, 500).transient


# -- deadlines ---------------------------------------------------------------------------


@pytest.fixture
def conn() -> Iterator[Any]:
    """A v3 connection to a port nothing listens on (never contacted by these tests)."""
    connection = EtcdV3Connection([("127.0.0.1", 9)], read_timeout=60, sleep=lambda _: None)
    yield connection
    connection.close()


class _Clock:
    """A monotonic clock that moves only when slept on: the deadlines' clock and the
    failover loop's sleep."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _endpoints(count: int, sleep: Any = lambda _: None) -> Endpoints:
    """The endpoints of a connection to ``count`` ports nothing listens on (read_timeout
    60 s, request_timeout 3 s)."""
    addresses = [("127.0.0.1", 9 + i) for i in range(count)]
    return Endpoints(addresses, "http", "v3", Timeouts(60, 5, 3, 10), sleep)


def test_an_operation_retries_until_its_deadline_not_read_timeout() -> None:
    clock = _Clock()
    endpoints = _endpoints(1, clock.sleep)
    tried: list[float] = []

    def send(_endpoint: int, _cap: float | None) -> None:
        tried.append(clock.now)
        raise UnsentError("http://127.0.0.1:9: refused")

    with pytest.raises(RendezvousConnectionError):
        endpoints.operate("read", "/k", send, deadline=Deadline(5.0, clock=clock))
    assert 5.0 <= clock.now < 6.0  # the caller's deadline, far short of read_timeout
    assert len(tried) > 2  # retried until then
    assert tried[-1] >= 5.0  # and once past it


def test_an_operation_given_no_deadline_has_read_timeout() -> None:
    assert 59 < _endpoints(1).deadline(None).remaining() <= 60
    own = Deadline(300)
    assert _endpoints(1).deadline(own) is own


@pytest.mark.parametrize(("endpoints", "share"), [(1, 0.5), (2, 1 / 3), (3, 0.25), (7, 0.25)])
def test_attempts_past_the_deadline_share_about_a_second(endpoints: int, share: float) -> None:
    caps: list[float | None] = []
    tried: list[int] = []

    def send(endpoint: int, cap: float | None) -> None:
        tried.append(endpoint)
        caps.append(cap)
        raise AmbiguousError("lost")

    with pytest.raises(RendezvousConnectionError):
        _endpoints(endpoints).operate("write", "/k", send, deadline=Deadline(0))
    # One attempt per endpoint and one more, each waiting at most its share.
    assert caps == [pytest.approx(share)] * (endpoints + 1)
    assert tried == [i % endpoints for i in range(endpoints + 1)]  # failing over in order


# -- one attempt, one outcome -------------------------------------------------------------


def _raising(error: BaseException) -> Any:
    def send(_endpoint: int, _cap: float | None) -> None:
        raise error

    return send


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (CompareFailedError("/k", 7), Outcome.REFUSED),
        (KeyExistsError("/k", 7), Outcome.REFUSED),
        (UnsentError("http://e:1: refused"), Outcome.UNSENT),
        (AmbiguousError("http://e:1: reset"), Outcome.UNKNOWN),
    ],
)
def test_one_request_becomes_one_outcome(error: Exception, outcome: Outcome) -> None:
    attempt = try_once(_raising(error), 0, 1.0)
    assert attempt.outcome is outcome
    if outcome is Outcome.REFUSED:
        assert attempt.refusal is error
        with pytest.raises(type(error)):
            attempt.unwrap()
    else:
        assert attempt.failure == str(error)


def test_an_applied_request_carries_its_answer_and_a_permanent_failure_propagates() -> None:
    assert try_once(lambda endpoint, cap: (endpoint, cap), 2, 0.5).unwrap() == (2, 0.5)
    with pytest.raises(RendezvousConnectionError):
        try_once(_raising(RendezvousConnectionError("no permission")), 0, None)


def test_a_refusal_after_a_lost_answer_is_marked_and_the_loop_fails_over() -> None:
    tried: list[int] = []
    answers: list[BaseException] = [AmbiguousError("lost"), CompareFailedError("/k", 8)]

    def send(endpoint: int, _cap: float | None) -> None:
        tried.append(endpoint)
        raise answers.pop(0)

    done = _endpoints(2).operate("compare-and-swap", "/k", send, deadline=Deadline(60))
    assert (done.outcome, done.after_unknown, tried) == (Outcome.REFUSED, True, [0, 1])


def _node(value: str, index: int, action: str = "compareAndSwap") -> Node:
    return Node("/k", value, index, 1, index, None, False, (), action)


def test_the_store_does_not_write_again_when_its_write_may_have_applied(
    conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = EtcdStore(conn, "/p")
    current = _node(_tagged(b"1"), 5, "get")
    monkeypatch.setattr(conn, "get", lambda _key, **_kw: current)
    unknown = CompareFailedError("/k", 9)
    unknown.outcome_unknown = True
    unknown.unknown_because = "etcd no longer holds the history that tells whether it was applied"
    writes: list[str] = []

    def compare_and_swap(_key: str, value: str, _prev: Node, **_kw: Any) -> Node:
        writes.append(value)
        raise unknown

    monkeypatch.setattr(conn, "compare_and_swap", compare_and_swap)
    with pytest.raises(RendezvousConnectionError) as excinfo:
        store.add("counter", 1)
    assert str(excinfo.value).endswith(
        "etcd lost the answer to a write and etcd no longer holds the history that tells "
        "whether it was applied; the update may or may not have been applied."
    )
    assert len(writes) == 1  # not sent again: it could be applied twice


class _Listener(WatchStream):
    woken = 0

    def next(self, deadline: Deadline) -> Node | None:
        return None

    def wake(self) -> None:
        self.woken += 1


def test_moving_to_the_next_endpoint_wakes_the_watch_streams() -> None:
    endpoints = _endpoints(2)
    stream = _Listener("/k", 1, False)
    assert endpoints.adopt(stream)
    endpoints.rotate(1)  # not the current endpoint: nothing moves, no one is woken
    assert stream.woken == 0
    endpoints.rotate(0)
    assert (endpoints.pick(), stream.woken) == (1, 1)


# -- store write tags --------------------------------------------------------------------


def test_tagged_values_read_the_same_for_pytorch_and_us(conn: Any) -> None:
    data = b"17"
    first, second = _tagged(data), _tagged(data)
    assert first != second  # each write's value is its own
    assert first.startswith("MTc=~")
    # PyTorch's EtcdStore decodes with the non-strict b64decode, which skips the tag.
    assert b64decode(first) == b64decode(first.encode()) == data
    assert int(b64decode(first)) == 17
    node = Node("/p/aw==", first, 5, 5, 5, None, False, (), "get")
    assert EtcdStore(conn, "/p")._decode(node, "k") == data


# -- stopping the heartbeat timer --------------------------------------------------------


def test_timer_cancel_waits_no_longer_than_asked() -> None:
    running, release = threading.Event(), threading.Event()

    def beat() -> None:
        running.set()
        release.wait(30)

    timer = _PeriodicTimer(timedelta(seconds=0.01), beat)
    timer.start()
    assert running.wait(10)
    started = time.monotonic()
    timer.cancel(0.2)
    assert time.monotonic() - started < 5  # returned at about 0.2 s, not after 30
    assert timer.thread is not None
    assert timer.thread.is_alive()  # the beat in progress ends on its own
    release.set()
    timer.thread.join(10)
    assert not timer.thread.is_alive()
    timer.cancel()  # idempotent


def test_a_timer_run_may_ask_for_the_next_run_sooner_than_the_interval() -> None:
    starts: list[float] = []
    second = threading.Event()

    def beat() -> float | None:
        starts.append(time.monotonic())
        if len(starts) == 2:
            second.set()
        return 0.0 if len(starts) == 1 else None  # once at once, then the interval

    timer = _PeriodicTimer(timedelta(seconds=60), beat)
    timer.start(first=0.0)  # the first run at once too, not after the interval
    try:
        assert second.wait(30)  # long before the interval
    finally:
        timer.cancel()
    assert len(starts) == 2
