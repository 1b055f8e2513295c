"""What a conditional write whose answer was lost became, decided from the first change
etcd's history holds after the state every copy compared against
(:func:`~etcd_rendezvous._transport.attempt.settled`), as a table. Finding that change
on real servers, through lost answers, past the caller's deadline and after etcd forgot
its history, is in ``tests/integration/test_settle.py`` and
``tests/integration/test_client.py``."""

from __future__ import annotations

import pytest

from etcd_rendezvous._transport.attempt import settled
from etcd_rendezvous._transport.interface import CompareFailedError, KeyExistsError, Node
from etcd_rendezvous.api import RequestTooLargeError


def _node(value: str, index: int, action: str = "compareAndSwap") -> Node:
    return Node("/k", value, index, 1, index, None, False, (), action)


_LOST = "etcd no longer holds the history that tells whether it was applied"


@pytest.mark.parametrize(
    ("change", "applied", "unknown"),
    [
        (_node("ours", 6), True, False),  # our lost copy was the first change
        (_node("ours", 6, "create"), True, False),  # (a create's)
        (_node("theirs", 6), False, False),  # another write came first: not ours
        (_node("ours", 6, "expire"), False, False),  # the key expired: not a write
        (None, False, True),  # the history could not tell
    ],
    ids=["ours", "our-create", "theirs", "expired", "unknown"],
)
@pytest.mark.parametrize("refusal", [CompareFailedError, KeyExistsError])
def test_a_refused_copy_after_a_lost_answer_is_settled_by_the_first_change(
    refusal: type[CompareFailedError | KeyExistsError],
    change: Node | None,
    applied: bool,
    unknown: bool,
) -> None:
    error = refusal("/k", 9)
    if applied:
        assert settled(error, "ours", change, _LOST) is change
        return
    with pytest.raises(refusal) as excinfo:
        settled(error, "ours", change, _LOST)
    assert excinfo.value is error
    assert excinfo.value.outcome_unknown is unknown
    assert excinfo.value.unknown_because == (_LOST if unknown else "")


@pytest.mark.parametrize("change", [_node("ours", 6), _node("theirs", 6), None])
def test_a_copy_refused_for_its_size_after_a_lost_answer_is_settled_too(
    change: Node | None,
) -> None:
    """A member with a larger --max-request-bytes (during a rolling change of the flag)
    may have applied the copy whose answer was lost before another refused the next one
    for its size: the key's history tells; if it cannot, the refusal stands, unmarked."""
    too_large = RequestTooLargeError("too large: --max-request-bytes", key="/k", size=9000)
    if change is not None and change.value == "ours":
        assert settled(too_large, "ours", change, _LOST) is change
        return
    with pytest.raises(RequestTooLargeError) as excinfo:
        settled(too_large, "ours", change, _LOST)
    assert excinfo.value is too_large
