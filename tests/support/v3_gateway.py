"""Just enough of etcd's v3 JSON gateway for the server and cluster tests.

Writes and reads one key over ``POST /v3/kv/put`` and ``POST /v3/kv/range`` with plain
urllib3, so that the tests of a v2-less etcd need no client library.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import urllib3

_POOL = urllib3.PoolManager(retries=False)


def b64(data: str | bytes) -> str:
    """The base64 of ``data`` (UTF-8 if text), as the v3 gateway carries keys and values."""
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def call(url: str, path: str, body: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """POST ``body`` to ``url + path``; return the JSON answer, failing on a non-200."""
    response = _POOL.request(
        "POST", url + path, body=json.dumps(body).encode(), timeout=urllib3.Timeout(timeout)
    )
    if response.status != 200:
        raise AssertionError(f"POST {url}{path}: HTTP {response.status}: {response.data[:200]!r}")
    answer: dict[str, Any] = json.loads(response.data)
    return answer


def put(url: str, key: str, value: str, timeout: float = 5.0) -> None:
    """Write ``key`` = ``value`` through the etcd member at ``url``."""
    call(url, "/v3/kv/put", {"key": b64(key), "value": b64(value)}, timeout)


def get(url: str, key: str, timeout: float = 5.0, serializable: bool = False) -> str | None:
    """Read ``key`` through the member at ``url`` (a linearizable read unless
    ``serializable``); ``None`` if it does not exist."""
    body: dict[str, Any] = {"key": b64(key), "serializable": serializable}
    kvs = call(url, "/v3/kv/range", body, timeout).get("kvs")
    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None


def status_of(url: str, path: str, method: str = "GET", timeout: float = 5.0) -> int:
    """The HTTP status ``url + path`` answers."""
    return _POOL.request(method, url + path, timeout=urllib3.Timeout(timeout)).status
