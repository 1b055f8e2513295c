"""etcd's limit on the size of a request: recognising etcd's answer to a write larger
than it accepts, the :class:`~etcd_rendezvous.api.RequestTooLargeError` that names the
limit and the flag that raises it, and the :class:`Refusal` a rendezvous passes on to the
nodes that wait for the refused write.

What etcd answers (3.4, 3.5, 3.6 and 3.7 alike), none of it applied:

* v3 API, a request over the member's ``--max-request-bytes`` (default 1572864): HTTP
  400, gRPC code 3, "etcdserver: request is too large"; over that limit plus 512 KiB
  (the gRPC server's own, which the gateway meets first): HTTP 429, gRPC code 8,
  "grpc: received message larger than max (<sent> vs. <limit + 524288>)". The second
  is not an overload: it is never retried either.
* v2 API: ``--max-request-bytes`` does not apply. A write whose form (the value,
  percent-encoded) is over 10 MiB, the most Go's HTTP server parses, is refused with
  errorCode 210, "Invalid POST form", cause "http: POST too large"; no flag raises it.

Reads and watch events are not limited this way (a read of a 4.5 MB value and a listing
of 11 MB are answered in full). See the documentation, "etcd's limits".
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

from ..api import RequestTooLargeError

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "RECOMMENDED_MAX_REQUEST_BYTES",
    "V2_FORM_LIMIT",
    "Refusal",
    "Verdict",
    "advice",
    "refused_for_size",
    "v2_too_large",
    "v3_too_large",
]

#: etcd's default ``--max-request-bytes`` (1.5 MiB).
DEFAULT_MAX_REQUEST_BYTES = 1_572_864
#: The ``--max-request-bytes`` above which etcd warns at start-up (10 MiB).
RECOMMENDED_MAX_REQUEST_BYTES = 10 * 1024 * 1024
#: The most a v2 write's form may hold: Go's ``ParseForm`` limit, not configurable.
V2_FORM_LIMIT = 10 * 1024 * 1024
#: What etcd's gRPC server accepts beyond ``--max-request-bytes`` (its error names the sum).
_GRPC_OVERHEAD = 512 * 1024

#: The v3 answers to a request over the limit (see the module's docs).
_V3_MARKERS = ("request is too large", "received message larger than max")
#: "grpc: received message larger than max (2000008 vs. 528384)": sent vs. allowed.
_GRPC_SIZES = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")
#: The v2 answer's errorCode (etcd's ``EcodeInvalidForm``) and cause.
_V2_INVALID_FORM = 210
_V2_MARKER = "too large"

#: How much of etcd's answer (and of each text) a report passes on.
_ANSWER_CHARS = 300


def v3_too_large(message: str) -> bool:
    """Whether the gateway's error ``message`` refuses the request for its size."""
    lowered = message.lower()
    return any(marker in lowered for marker in _V3_MARKERS)


def v2_too_large(payload: Any) -> bool:
    """Whether a v2 error answer (python-etcd's ``payload``) refuses the request for its
    size (its form over :data:`V2_FORM_LIMIT`)."""
    if not isinstance(payload, dict) or payload.get("errorCode") != _V2_INVALID_FORM:
        return False
    return _V2_MARKER in str(payload.get("cause", "")).lower()


def refused_for_size(
    api: str, endpoint: str, where: str, key: str, size: int, answer: str
) -> RequestTooLargeError:
    """The error for endpoint ``endpoint``'s refusal, ``answer``, of a request to
    ``where`` (``"compare-and-swap '/k'"``) on ``key`` over the ``api`` (``v2``, ``v3``),
    of ``size`` bytes (v3: its keys and values; v2: its form as sent)."""
    what = "of form, the value percent-encoded" if api == "v2" else "of keys and values"
    message = (
        f"etcd endpoint {endpoint} refused to {where}: the request ({size} bytes {what}) "
        f"is larger than etcd accepts ({answer}). {advice(api, answer)}"
    )
    return RequestTooLargeError(
        message, key=key, size=size, endpoint=endpoint, answer=answer, api=api
    )


def advice(api: str, answer: str) -> str:
    """What to do about a refusal, ``answer``, of a request too large over ``api``: the
    limit (the member's own, when the answer gives it) and the flag that raises it."""
    if api == "v2":
        return (
            f"A v2 write holds at most {V2_FORM_LIMIT} bytes (10 MiB) of form, and no flag "
            "raises that: --max-request-bytes applies to the v3 API only. Use the v3 API "
            "(etcd_api=v3, etcd 3.4 or later) with a large enough --max-request-bytes, or "
            "fewer nodes."
        )
    sizes = _GRPC_SIZES.search(answer)
    if sizes is not None and int(sizes.group(2)) > _GRPC_OVERHEAD:
        limit = f"this member's is {int(sizes.group(2)) - _GRPC_OVERHEAD} bytes"
    else:
        limit = f"the default is {DEFAULT_MAX_REQUEST_BYTES} bytes, 1.5 MiB"
    return (
        f"etcd takes requests of up to --max-request-bytes ({limit}): start every member "
        f"with a larger --max-request-bytes (etcd warns above {RECOMMENDED_MAX_REQUEST_BYTES}, "
        "10 MiB), or use fewer nodes. A rendezvous state grows with its nodes: see "
        '"etcd\'s limits" in the documentation.'
    )


class Verdict(enum.Enum):
    """What a node waiting in a rendezvous does about a :class:`Refusal` reported to it."""

    IGNORE = "ignore"
    """It does not concern the node, or is stale."""
    FAIL = "fail"
    """The node raises the reported error."""
    VERIFY = "verify"
    """It would fail the node, which arrived after it was written (perhaps after etcd's
    limit was raised): ask etcd first (:meth:`Transport.check_size
    <etcd_rendezvous._transport.interface.Transport.check_size>`)."""


@dataclass(frozen=True)
class Refusal:
    """A write of the rendezvous state that etcd refused for its size, as the node that
    made it reports it to the nodes that wait for it (in the progress key, next to the
    summary of the state that write would have replaced): a few hundred bytes.

    A report, not the authority: which nodes act on it, and how, the backends' progress
    keys say (``_dynamic/progress.py``, ``_legacy/admission.py``).
    """

    #: Every node (member) key created at or before this etcd index was in the write.
    upto: int
    #: How many participants the write would have had.
    count: int
    #: Whether the write would have completed the round (fixed its participants).
    completing: bool
    #: Who made the write (a node, or a worker's member key).
    by: str
    #: The error's :class:`~etcd_rendezvous.api.RequestTooLargeError` fields.
    key: str
    size: int
    endpoint: str
    answer: str
    api: str

    @classmethod
    def of(
        cls, error: RequestTooLargeError, upto: int, count: int, completing: bool, by: str
    ) -> Refusal:
        """The report of ``error``, the refusal of a write deciding the keys up to ``upto``
        into a state of ``count`` participants (``completing`` the round, or not), made
        by ``by``."""
        answer = error.answer[:_ANSWER_CHARS]
        return cls(
            upto, count, completing, by, error.key, error.size, error.endpoint, answer, error.api
        )

    def encode(self) -> dict[str, Any]:
        """The report as a JSON object (a field of the progress key's value)."""
        return dataclasses.asdict(self)

    @classmethod
    def decode(cls, fields: Any) -> Refusal | None:
        """The report in ``fields``; ``None`` for anything else (garbage is ignored)."""
        if not isinstance(fields, dict):
            return None
        upto, count, size = (_positive(fields.get(name)) for name in ("upto", "count", "size"))
        completing = fields.get("completing")
        texts = [fields.get(name) for name in ("by", "key", "endpoint", "answer", "api")]
        if upto is None or count is None or size is None or type(completing) is not bool:
            return None
        if not all(isinstance(text, str) for text in texts):
            return None
        by, key, endpoint, answer, api = (str(text)[:_ANSWER_CHARS] for text in texts)
        return cls(upto, count, completing, by, key, size, endpoint, answer, api)

    def error(self, whom: str) -> RequestTooLargeError:
        """The error of ``whom`` (``"The node 'x'"``), which waited for the refused write."""
        message = (
            f"{whom} gives up: etcd endpoint {self.endpoint} refused the write of the "
            f"rendezvous state it waited for ({self.size} bytes to {self.key!r}, made by "
            f"{self.by}) as larger than etcd accepts ({self.answer}). "
            f"{advice(self.api, self.answer)}"
        )
        return RequestTooLargeError(
            message,
            key=self.key,
            size=self.size,
            endpoint=self.endpoint,
            answer=self.answer,
            api=self.api,
        )


def _positive(value: Any) -> int | None:
    """``value`` if it is a positive integer (not a bool), else ``None``."""
    return value if type(value) is int and value > 0 else None
