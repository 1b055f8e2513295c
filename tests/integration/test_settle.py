"""A conditional write whose answer was lost, settled on a real server, at or after the
caller's deadline: the fault proxy drops the answer to the first copy and holds the
connection open, so that the client learns nothing until its wait for an answer ends;
a deadline shorter than that wait has passed by then. The transport sends one more copy
past the deadline so that the write's fate can be found out, and then looks up the
key's history, which tells whether the lost copy was applied.

The cases where the history is gone are in ``test_client.py``; the decision itself,
as a table, in ``tests/unit/test_settle.py``.
"""

from __future__ import annotations

import pytest

from etcd_rendezvous._transport.interface import CompareFailedError, Transport
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.etcd_server import EtcdServer
from support.faultproxy import FaultProxy
from support.transports import Connect

#: Seconds a request waits for its answer: what the dropped answer costs the client.
REQUEST_TIMEOUT = 1.0

pytestmark = pytest.mark.connect_defaults(read_timeout=5.0, request_timeout=REQUEST_TIMEOUT)

#: The caller's deadline: passed while the first answer is awaited, or far away.
DEADLINES = {"deadline-passed": 0.2, "deadline-ahead": 30.0}


@pytest.fixture
def direct(etcd_server: EtcdServer, connect: Connect) -> Transport:
    """A connection straight to ``etcd_server``: "another writer", and the test's eyes."""
    return connect((etcd_server.get_host(), etcd_server.get_port()))


@pytest.mark.parametrize("seconds", DEADLINES.values(), ids=DEADLINES.keys())
def test_an_applied_swap_is_recognised_even_past_the_callers_deadline(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str, seconds: float
) -> None:
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "old")
    etcd_proxy.clear_stats()
    etcd_proxy.drop_responses(count=1)  # applied, and the client is held in the dark
    deadline = Deadline(seconds)

    node = conn.compare_and_swap(key, "ours-tag123", prev, deadline=deadline)

    assert etcd_proxy.dropped_responses == 1
    assert (node.value, node.modified_index) == ("ours-tag123", direct.get(key).modified_index)
    if seconds < REQUEST_TIMEOUT:
        assert deadline.expired()  # settled after the deadline


@pytest.mark.parametrize("seconds", DEADLINES.values(), ids=DEADLINES.keys())
def test_an_applied_create_is_recognised_even_past_the_callers_deadline(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str, seconds: float
) -> None:
    """The key changed again before the copy sent after the lost answer: the write that
    created it (at its creation index) is looked up."""
    conn = connect(etcd_proxy.endpoint)

    def another_writer_builds_on_it() -> None:
        direct.compare_and_swap(key, "later", direct.get(key))

    etcd_proxy.drop_responses(count=1, on_drop=another_writer_builds_on_it)
    deadline = Deadline(seconds)

    node = conn.create(key, "ours-tag456", deadline=deadline)

    assert etcd_proxy.hook_errors == []
    current = direct.get(key)
    assert current.value == "later"
    assert (node.value, node.modified_index) == ("ours-tag456", current.created_index)
    if seconds < REQUEST_TIMEOUT:
        assert deadline.expired()


@pytest.mark.parametrize("seconds", DEADLINES.values(), ids=DEADLINES.keys())
def test_a_swap_refused_for_another_writer_is_known_not_applied_even_past_the_deadline(
    etcd_proxy: FaultProxy, connect: Connect, direct: Transport, key: str, seconds: float
) -> None:
    """Another writer came first: the lost answer was a refusal too, which the history
    tells; the caller may decide again on what it reads."""
    conn = connect(etcd_proxy.endpoint)
    prev = conn.set(key, "old")
    direct.set(key, "theirs")  # the first change after prev is not ours
    etcd_proxy.drop_responses(count=1)
    deadline = Deadline(seconds)

    with pytest.raises(CompareFailedError) as excinfo:
        conn.compare_and_swap(key, "ours-tag789", prev, deadline=deadline)

    assert etcd_proxy.dropped_responses == 1
    assert not excinfo.value.outcome_unknown  # the history was read: not ours
    assert direct.get(key).value == "theirs"
    if seconds < REQUEST_TIMEOUT:
        assert deadline.expired()
