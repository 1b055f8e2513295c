"""The runner's own look at etcd, over plain HTTP (v2 keys API, v3 JSON gateway).

The harness observes etcd without the library under test where it can: the keys of a
run (to pick one for garbage, with its TTL or lease so that the garbage keeps it), the
leases left behind, compaction and the v2 history. Each call tries the members in
turn, so a member that is down or frozen costs ``timeout`` at most.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

__all__ = ["EtcdView", "KeyInfo"]

_POOL = urllib3.PoolManager(retries=False, maxsize=4)


@dataclass(frozen=True)
class KeyInfo:
    """A key as the runner found it."""

    key: str
    value: bytes
    ttl: int | None  # v2: seconds left; v3: the lease's TTL left
    lease: int  # v3: its lease (0: none)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


class EtcdView:
    def __init__(self, client_urls: list[str], api: str, timeout: float = 2.0) -> None:
        self.urls = client_urls
        self.api = api
        self.timeout = timeout

    # -- transport ---------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, fields: Any = None) -> Any:
        last: Exception | None = None
        for url in self.urls:
            try:
                if fields is not None:
                    response = _POOL.request(
                        method,
                        url + path,
                        body=urlencode(fields),
                        headers={"Content-Type": "application/x-www-form-urlencoded"},
                        timeout=urllib3.Timeout(self.timeout),
                    )
                else:
                    response = _POOL.request(
                        method,
                        url + path,
                        body=None if body is None else json.dumps(body).encode(),
                        timeout=urllib3.Timeout(self.timeout),
                    )
            except urllib3.exceptions.HTTPError as exc:
                last = exc
                continue
            if response.status >= 500:
                last = RuntimeError(f"{url}{path}: HTTP {response.status}")
                continue
            return response.status, json.loads(response.data or b"{}")
        raise RuntimeError(f"no etcd member answered {path}: {last}")

    def _v3(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, answer = self._request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {answer}")
        return answer  # type: ignore[no-any-return]

    # -- keys --------------------------------------------------------------------------

    def keys_below(self, prefix: str) -> list[KeyInfo]:
        """Every key (not directory) under ``prefix`` (and ``prefix`` itself on v3)."""
        if self.api == "v3":
            raw = prefix.encode()
            answer = self._v3(
                "/v3/kv/range", {"key": _b64(raw), "range_end": _b64(_prefix_end(raw))}
            )
            found = []
            for kv in answer.get("kvs", []):
                lease = int(kv.get("lease", 0))
                found.append(
                    KeyInfo(
                        base64.b64decode(kv["key"]).decode(errors="replace"),
                        base64.b64decode(kv.get("value", "")),
                        self.lease_ttl(lease) if lease else None,
                        lease,
                    )
                )
            return found
        status, answer = self._request("GET", f"/v2/keys{quote(prefix)}?recursive=true")
        if status != 200:
            return []
        leaves: list[KeyInfo] = []

        def walk(node: dict[str, Any]) -> None:
            if node.get("dir"):
                for child in node.get("nodes", []):
                    walk(child)
            else:
                leaves.append(
                    KeyInfo(node["key"], node.get("value", "").encode(), node.get("ttl"), 0)
                )

        walk(answer["node"])
        return leaves

    def put(self, key: str, value: bytes, ttl: int | None, lease: int) -> None:
        """Write ``key`` keeping its lifetime: its v3 lease, or its v2 TTL."""
        if self.api == "v3":
            body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                body["lease"] = str(lease)
            self._v3("/v3/kv/put", body)
            return
        fields = {"value": value.decode("latin-1")}
        if ttl:
            fields["ttl"] = str(ttl)
        status, answer = self._request("PUT", f"/v2/keys{quote(key)}", fields=fields)
        if status not in (200, 201):
            raise RuntimeError(f"PUT {key}: HTTP {status}: {answer}")

    def get(self, key: str) -> KeyInfo | None:
        found = [k for k in self.keys_below(key) if k.key == key]
        return found[0] if found else None

    # -- history -----------------------------------------------------------------------

    def compact(self) -> int:
        """Compact the v3 history at the current revision; return it."""
        header = self._v3("/v3/kv/range", {"key": _b64("/"), "limit": "1"})["header"]
        revision = int(header["revision"])
        self._v3("/v3/kv/compaction", {"revision": str(revision)})
        return revision

    def flood_history(self, key: str, writes: int = 1050) -> None:
        """Make v2 forget its event history (it keeps 1000 events)."""
        for i in range(writes):
            self._request("PUT", f"/v2/keys{quote(key)}", fields={"value": str(i)})

    # -- leases ------------------------------------------------------------------------

    def lease_ttl(self, lease: int) -> int | None:
        answer = self._v3("/v3/lease/timetolive", {"ID": str(lease)})
        ttl = int(answer.get("TTL", -1))
        return None if ttl < 0 else ttl

    def leases(self) -> list[dict[str, Any]]:
        """Every lease: ``id``, ``ttl`` (left), ``keys``."""
        found = []
        for entry in self._v3("/v3/lease/leases", {}).get("leases", []):
            lease = int(entry["ID"])
            answer = self._v3("/v3/lease/timetolive", {"ID": str(lease), "keys": True})
            keys = [base64.b64decode(k).decode(errors="replace") for k in answer.get("keys", [])]
            found.append({"id": lease, "ttl": int(answer.get("TTL", -1)), "keys": keys})
        return found
