"""A conditional write whose answer was lost, settled on a real server after the
caller's deadline passed: the transport sends copies past the deadline so that the
write's fate can be found out, and then looks it up (``Connection._settle``)."""

from __future__ import annotations

import pytest

from etcd_rendezvous._transport.attempt import Attempt, Outcome
from etcd_rendezvous._transport.interface import CompareFailedError, KeyExistsError, Node
from etcd_rendezvous._transport.retry import Deadline
from support.transports import Connect


def _refused_after_unknown(error: CompareFailedError | KeyExistsError) -> Attempt[Node]:
    """What the retry loop returns when a copy's answer was lost and the last copy was
    refused (here: refused because the lost copy was applied)."""
    return Attempt[Node](Outcome.REFUSED, refusal=error, after_unknown=True)


@pytest.mark.parametrize("deadline_passed", [False, True])
def test_an_applied_swap_is_recognised_even_past_the_callers_deadline(
    connect: Connect, key: str, deadline_passed: bool
) -> None:
    conn = connect()
    prev = conn.set(key, "old")
    ours = conn.compare_and_swap(key, "ours-tag123", prev)  # the copy whose answer was lost
    refused = _refused_after_unknown(CompareFailedError(key, None))
    with conn.bounded_by(Deadline(0.0 if deadline_passed else 30.0)):
        settled = conn._settle("compare-and-swap", key, "ours-tag123", prev.modified_index, refused)
    assert (settled.value, settled.modified_index) == ("ours-tag123", ours.modified_index)


@pytest.mark.parametrize("deadline_passed", [False, True])
def test_an_applied_create_is_recognised_even_past_the_callers_deadline(
    connect: Connect, key: str, deadline_passed: bool
) -> None:
    conn = connect()
    created = conn.create(key, "ours-tag456")
    # Changed since (keeping its creation index): the creating write is looked up.
    conn.compare_and_swap(key, "later", created)
    refused = _refused_after_unknown(KeyExistsError(key, None))
    with conn.bounded_by(Deadline(0.0 if deadline_passed else 30.0)):
        settled = conn._settle("create", key, "ours-tag456", None, refused)
    assert (settled.value, settled.modified_index) == ("ours-tag456", created.modified_index)


def test_a_swap_refused_for_another_writer_past_the_deadline_is_known_not_applied(
    connect: Connect, key: str
) -> None:
    conn = connect()
    prev = conn.set(key, "old")
    conn.set(key, "theirs")
    refused = _refused_after_unknown(CompareFailedError(key, None))
    with conn.bounded_by(Deadline(0.0)), pytest.raises(CompareFailedError) as excinfo:
        conn._settle("compare-and-swap", key, "ours-tag789", prev.modified_index, refused)
    assert not excinfo.value.outcome_unknown  # the history was read: not ours
