"""One request and what became of it: the :class:`Outcome` and :class:`Attempt` that the
failover loop (:meth:`~etcd_rendezvous._transport.endpoints.Endpoints.operate`) reads,
:func:`try_once`, which makes them, the classification of etcd's transient answers, and
:func:`settled`, what a conditional write whose answer was lost became.
See docs/etcd-v3.rst, section "Inside the transport".
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..api import RequestTooLargeError
from .interface import ConditionError, Node

__all__ = [
    "ELECTION_MARKERS",
    "AmbiguousError",
    "Attempt",
    "Outcome",
    "UnsentError",
    "dropped_during_tls",
    "settled",
    "transient_answer",
    "try_once",
]

_T = TypeVar("_T")


class AmbiguousError(Exception):
    """Raised by one request: it was sent but its outcome is unknown (lost answer,
    election timeout). :func:`try_once` makes it an :attr:`Outcome.UNKNOWN` attempt."""


class UnsentError(Exception):
    """Raised by one request: it never reached the server (or was refused before being
    processed). :func:`try_once` makes it an :attr:`Outcome.UNSENT` attempt."""


class Outcome(enum.Enum):
    """What became of one request (its value is the ``outcome`` label of the
    ``transport.retries`` metric)."""

    #: etcd answered and did it.
    APPLIED = "applied"
    #: etcd answered that a condition on the key failed, or that the request is larger than
    #: it accepts (not a failure of the transport, and not sent again).
    REFUSED = "refused"
    #: It never reached a member, or a member refused it before proposing it: not
    #: applied, and safe to send again anywhere.
    UNSENT = "unsent"
    #: It was sent but its answer was lost: it may have been applied.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Attempt(Generic[_T]):
    """One request's :class:`Outcome`, with the answer (applied), the refusal (refused)
    or what went wrong (``"<endpoint>: <failure>"``, for unsent and unknown)."""

    outcome: Outcome
    result: _T | None = None
    refusal: ConditionError | RequestTooLargeError | None = None
    failure: str = ""
    #: Set by the retry loop on its final attempt: an earlier copy's answer was lost.
    after_unknown: bool = False

    def unwrap(self) -> _T:
        """The answer of an applied attempt; raises the refusal of a refused one."""
        if self.outcome is Outcome.APPLIED:
            return self.result  # type: ignore[return-value]
        raise self.unwrap_refusal()

    def unwrap_refusal(self) -> ConditionError | RequestTooLargeError:
        """The refusal of a refused attempt."""
        if self.refusal is None:
            raise RuntimeError(f"an attempt with outcome {self.outcome.value} has no refusal")
        return self.refusal


def try_once(
    send: Callable[[int, float | None], _T], endpoint: int, cap: float | None
) -> Attempt[_T]:
    """Run ``send(endpoint, cap)`` (one request) and return its :class:`Attempt`.

    ``send`` raises a condition error or a
    :class:`~etcd_rendezvous.api.RequestTooLargeError` for a refusal, :class:`UnsentError`
    or :class:`AmbiguousError` for failures worth retrying, and a library error for
    permanent failures (which propagate).
    """
    try:
        return Attempt(Outcome.APPLIED, result=send(endpoint, cap))
    except (ConditionError, RequestTooLargeError) as exc:
        return Attempt(Outcome.REFUSED, refusal=exc)
    except UnsentError as exc:
        return Attempt(Outcome.UNSENT, failure=str(exc))
    except AmbiguousError as exc:
        return Attempt(Outcome.UNKNOWN, failure=str(exc))


#: Transient answers of a member that refused a request before proposing it to raft
#: (no leader yet, not the leader, proposal dropped, overloaded): it was not applied.
_REJECTED_MARKERS = (
    "no leader",
    "not leader",
    "proposal dropped",
    "too many requests",
    "unhealthy cluster",
)
#: Every answer that an election (or an overloaded or stopping member) produces:
#: besides the refusals, "request timed out" (possibly due to previous leader failure)
#: and "leader changed", after which the request may still be applied.
ELECTION_MARKERS = (
    *_REJECTED_MARKERS,
    "timed out",
    "leader changed",
    "server stopped",
    "unavailable",
)


def transient_answer(endpoint: str, text: str) -> Exception:
    """The retry loop's error for a transient error answer ``text`` of ``endpoint``.

    A refusal before the proposal (no leader, proposal dropped) is an
    :class:`UnsentError`, sent again anywhere; anything else ("request timed out",
    "leader changed") an :class:`AmbiguousError`: the write may still be applied, and
    a conditional write is resolved from the key's history.
    """
    if any(marker in text.lower() for marker in _REJECTED_MARKERS):
        return UnsentError(f"{endpoint}: {text}")
    return AmbiguousError(f"{endpoint}: {text}")


def dropped_during_tls(exc: BaseException) -> bool:
    """Whether the TLS failure ``exc`` (urllib3's ``SSLError`` or :mod:`ssl`'s) is the
    peer closing the connection mid-handshake, without a TLS alert: what a member going
    down, or a TCP load balancer whose backend is down, does -- and a plain-http etcd
    too. The caller retries it (on the next endpoint) where an endpoint of the cluster
    answered over TLS before; otherwise it is the protocol that is wrong."""
    causes = [exc, *exc.args, exc.__cause__, exc.__context__]
    return any(isinstance(c, (ssl.SSLEOFError, ssl.SSLZeroReturnError)) for c in causes)


def settled(
    refusal: ConditionError | RequestTooLargeError, value: str, change: Node | None, lost: str
) -> Node:
    """What became of a conditional write of ``value`` whose answer was lost and whose
    last copy etcd refused (``refusal``), given ``change``: the first change after the
    state every copy compared against, as etcd's history tells (``None``: it could not
    tell, for the reason ``lost``, a clause).

    Returns ``change`` if it is the lost copy: it carries ``value`` (callers make a
    conditional write's value its own, a tag, or one that means the same whoever wrote
    it) and is a write, not an expiry. Otherwise raises ``refusal``: the write was not
    applied, or, if nothing was found, it is marked ``outcome_unknown`` with ``lost``
    as :attr:`~etcd_rendezvous._transport.interface.ConditionError.unknown_because` (a
    refusal for the request's size carries no such flags).
    """
    if change is not None and change.value == value and change.action != "expire":
        return change
    if change is None and isinstance(refusal, ConditionError):
        refusal.outcome_unknown = True
        refusal.unknown_because = lost
    raise refusal
