"""The wire level of the v3 transport: JSON over HTTP to etcd's gRPC gateway.

What etcd's gateway does that this module absorbs (see ``docs/etcd-v3.rst``):

* keys and values are base64; int64 fields arrive as JSON strings; fields holding their
  default value are omitted (a failed txn has no ``succeeded``, an empty range no
  ``kvs``, a PUT watch event no ``type``);
* errors come as ``{"error", "message", "code"}`` (3.4, 3.5) or ``{"code", "message",
  "details"}`` (3.6), with an HTTP status that follows the gRPC code, and inside a watch
  stream as ``{"error": {"grpc_code", "http_code", "message"}}``;
* a watch answers with a chunked stream of JSON objects (parsed by
  :func:`~etcd_rendezvous._transport.stream.iter_objects`, as v2's are).

It also builds the transactions the transport sends and turns the answers into
:class:`~etcd_rendezvous._transport.interface.Node` values. Nothing here sends a request or
retries; :mod:`etcd_rendezvous._transport.v3` does.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from .interface import CompareFailedError, KeyNotFoundError, Node

__all__ = [
    "GrpcError",
    "ReauthError",
    "b64",
    "compare_failure",
    "create_txn",
    "directory",
    "guarded_txn",
    "kv_node",
    "kvs",
    "norm",
    "parse_error",
    "prefix_end",
    "request_size",
    "revision",
    "unb64",
    "written",
]


class ReauthError(Exception):
    """A request (or a watch) was refused for want of a valid auth token: authenticate
    again and send it once more."""


# gRPC status codes the transport acts on.
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
UNAVAILABLE = 14
UNAUTHENTICATED = 16

#: Codes of failures worth retrying (elections, overload, a proposal that timed out):
#: the request may or may not have been applied.
TRANSIENT_CODES = frozenset({DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNAVAILABLE})

#: Messages that mean "authenticate again", whatever the code (etcd's
#: ``ErrInvalidAuthToken``, ``ErrUserEmpty``, ``ErrAuthOldRevision``).
_REAUTH_MESSAGES = ("invalid auth token", "user name is empty", "auth revision is old")
#: Messages of transient failures, for answers without a usable code.
_TRANSIENT_MESSAGES = (
    "request timed out",
    "leader changed",
    "no leader",
    "not leader",
    "too many requests",
    "server is unavailable",
    "proposal dropped",
    "server stopped",
    "unhealthy cluster",
)


@dataclass(frozen=True)
class GrpcError:
    """An error answer of the gateway, in either of its shapes."""

    #: The gRPC status code (0 when the answer had none).
    code: int
    message: str
    #: The HTTP status of the answer (0 inside a watch stream when not reported).
    http_status: int

    @property
    def needs_reauth(self) -> bool:
        """The auth token is missing, expired or stale: authenticate again and retry."""
        lowered = self.message.lower()
        return self.code == UNAUTHENTICATED or any(m in lowered for m in _REAUTH_MESSAGES)

    @property
    def transient(self) -> bool:
        """A failure worth retrying, of unknown outcome."""
        if self.code in TRANSIENT_CODES:
            return True
        lowered = self.message.lower()
        if any(m in lowered for m in _TRANSIENT_MESSAGES):
            return True
        return self.code == 0 and self.http_status >= 500

    @property
    def lease_not_found(self) -> bool:
        """The lease named in the request does not exist (expired or revoked)."""
        return self.code == NOT_FOUND and "lease" in self.message.lower()

    def __str__(self) -> str:
        return f"{self.message} (gRPC code {self.code}, HTTP {self.http_status})"


def parse_error(status: int, body: bytes) -> GrpcError:
    """Read an error answer of either shape; a body that is not JSON is kept as text."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        text = body.decode("utf-8", errors="replace").strip()
        return GrpcError(0, text[:300] or f"HTTP {status}", status)
    return _error_from_dict(data, status)


def stream_error(message: dict[str, Any]) -> GrpcError | None:
    """The error carried by one watch-stream object, if it is one."""
    error = message.get("error")
    if not isinstance(error, dict):
        return None
    status = _int(error.get("http_code"))
    code = _int(error.get("grpc_code", error.get("code")))
    return GrpcError(code, str(error.get("message") or error.get("error") or ""), status)


def _error_from_dict(data: dict[str, Any], status: int) -> GrpcError:
    code = _int(data.get("code"))
    message = data.get("message") or data.get("error") or ""
    return GrpcError(code, str(message), status)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def b64(text: str) -> str:
    """``text`` (UTF-8) in base64, as the gateway wants keys and values."""
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def unb64(data: str | None) -> str:
    """The text behind a base64 field (``""`` for an omitted one)."""
    if not data:
        return ""
    return base64.b64decode(data).decode("utf-8", errors="replace")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` (base64) that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8"))
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return base64.b64encode(bytes(raw)).decode("ascii")
        raw.pop()
    # Only 0xff bytes: every key from the prefix on.
    return base64.b64encode(b"\0").decode("ascii")


# -- building requests and reading answers ------------------------------------------------


def below_only(key: str) -> bool:
    """Whether directory ``key`` is given with its trailing ``/`` (and is not the root):
    a recursive watch or a listing of it then covers the keys below it, not ``key``
    itself, which a user granted ``--prefix key/`` may not read."""
    return key.endswith("/") and bool(key.strip("/"))


def watched_range(key: str, recursive: bool) -> tuple[str, str | None]:
    """The first key and the ``range_end`` (base64; ``None``: the one key) of a watch of
    ``key``: the key itself, or, ``recursive``, it and every key starting with it (or,
    see :func:`below_only`, the keys below it)."""
    if not recursive:
        return norm(key), None
    if below_only(key):
        return norm(key) + "/", prefix_end(norm(key) + "/")
    return norm(key), prefix_end(norm(key))


def norm(key: str) -> str:
    """``key`` without a trailing ``/``: v2 ignores it, and v3 directories are prefixes."""
    stripped = key.rstrip("/")
    return stripped or key


def prefix_below(key: str) -> str:
    """The prefix of the keys below directory ``key``: ``key/``, and ``/`` for the root
    (whose keys are ``/a``, not ``//a``)."""
    return norm(key).rstrip("/") + "/"


def create_txn(key: str, value: str, lease: int) -> dict[str, Any]:
    """Put ``value`` if ``key`` does not exist; else read it."""
    txn = _put_if_created(key, value, lease, "EQUAL")
    txn["failure"] = [{"request_range": {"key": b64(key)}}]
    return txn


def update_txn(key: str, value: str, lease: int) -> dict[str, Any]:
    """Put ``value`` if ``key`` exists (a put keeps the key's creation revision)."""
    return _put_if_created(key, value, lease, "GREATER")


def _put_if_created(key: str, value: str, lease: int, result: str) -> dict[str, Any]:
    """A transaction putting ``value`` (with ``lease``) if ``key``'s creation revision
    compares to 0 as ``result`` says (``EQUAL``: absent; ``GREATER``: present)."""
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {
        "compare": [
            {"target": "CREATE", "result": result, "key": b64(key), "create_revision": "0"}
        ],
        "success": [{"request_put": put}],
    }


def guarded_txn(key: str, mod_revision: int, op: dict[str, Any]) -> dict[str, Any]:
    return {
        "compare": [
            {
                "target": "MOD",
                "result": "EQUAL",
                "key": b64(key),
                "mod_revision": str(mod_revision),
            }
        ],
        "success": [op],
        "failure": [{"request_range": {"key": b64(key)}}],
    }


#: The fields of a request that carry keys and values (base64), which etcd's request
#: limit counts.
_BYTES_FIELDS = frozenset({"key", "value", "range_end"})


def request_size(body: Any) -> tuple[str, int]:
    """The key a request body is about (its first ``key``) and the bytes of the keys and
    values it carries, decoded: about what etcd counts against ``--max-request-bytes``
    (its own encoding adds some 50 bytes)."""
    key, size = "", 0
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            for name, value in item.items():
                if name in _BYTES_FIELDS and isinstance(value, str):
                    size += len(value) * 3 // 4 - value.count("=", -2)
                    if name == "key" and not key:
                        key = unb64(value)
                else:
                    stack.append(value)
    return key, size


def compare_failure(key: str, data: dict[str, Any], revision: int) -> Exception:
    current = kvs((data.get("responses") or [{}])[0])
    if not current:
        return KeyNotFoundError(key, revision)
    return CompareFailedError(key, revision)


def revision(data: dict[str, Any]) -> int:
    header = data.get("header")
    if not isinstance(header, dict):
        result = data.get("result")
        header = result.get("header") if isinstance(result, dict) else None
    return int(header.get("revision", 0)) if isinstance(header, dict) else 0


def kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    kvs = response.get("response_range", response).get("kvs")
    return kvs if isinstance(kvs, list) else []


def kv_node(kv: dict[str, Any], revision: int, action: str = "get") -> Node:
    return Node(
        key=unb64(kv.get("key")),
        value=unb64(kv.get("value")),
        modified_index=int(kv.get("mod_revision", 0)),
        created_index=int(kv.get("create_revision", 0)),
        etcd_index=revision,
        ttl=None,
        is_dir=False,
        children=(),
        action=action,
        lease=int(kv.get("lease", 0)),
    )


def written(
    key: str, value: str | None, revision: int, created: int, action: str, lease: int
) -> Node:
    return Node(
        key=key,
        value=value,
        modified_index=revision,
        created_index=created,
        etcd_index=revision,
        ttl=None,
        is_dir=False,
        children=(),
        action=action,
        lease=lease,
    )


def directory(
    key: str, marker: Node | None, below: list[dict[str, Any]], revision: int, recursive: bool
) -> Node:
    """Directory ``key`` as v2 shows it, from the keys below it (and its marker, if any)."""
    # name -> Node (a value) or dict (a directory); a directory wins over its marker.
    root: dict[str, Any] = {}
    for kv in below:
        node = kv_node(kv, revision)
        parts = node.key[len(prefix_below(key)) :].split("/")
        level = root
        for part in parts[:-1]:
            entry = level.get(part)
            if not isinstance(entry, dict):
                entry = level[part] = {}
            level = entry
        if not isinstance(level.get(parts[-1]), dict):
            level[parts[-1]] = node

    def build(path: str, tree: dict[str, Any], depth: int) -> tuple[Node, ...]:
        children: list[Node] = []
        for name, entry in sorted(tree.items()):
            child_key = prefix_below(path) + name
            if isinstance(entry, Node):
                children.append(entry)
                continue
            grandchildren = build(child_key, entry, depth + 1) if recursive else ()
            children.append(dir_node(child_key, None, grandchildren, revision))
        return tuple(children)

    return dir_node(key, marker, build(key, root, 0), revision)


def dir_node(key: str, marker: Node | None, children: tuple[Node, ...], revision: int) -> Node:
    return Node(
        key=key,
        value=None,
        modified_index=marker.modified_index if marker else 0,
        created_index=marker.created_index if marker else 0,
        etcd_index=revision,
        ttl=None,
        is_dir=True,
        children=children,
        action="get",
        lease=marker.lease if marker else 0,
    )
