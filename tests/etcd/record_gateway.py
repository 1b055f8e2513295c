"""Record what etcd's v3 JSON gateway answers, for the replayed tests in tests/unit.

    .venv/bin/python tests/etcd/record_gateway.py ETCD_BINARY tests/unit/recorded/gateway-X.Y.Z.json

Starts the binary without the v2 API (``EtcdServer(enable_v2=False)``), sends a fixed
list of requests (keys, transactions, leases, errors, watch streams, auth refusals) and
writes each answer as ``{"name", "path", "request", "status", "body"}``; a watch's
answer is its HTTP status line and the JSON objects of its stream (``"stream"``), read
for one second. ``tests/unit/test_v3_recorded.py`` replays them.
"""

import base64
import json
import socket
import sys
import time

import urllib3

from etcd_rendezvous.etcd_server import EtcdServer


def b64(s):
    return base64.b64encode(s.encode()).decode()


class Recorder:
    """Sends requests to one etcd server and keeps each answer, in order."""

    def __init__(self, server: EtcdServer) -> None:
        self.pool = urllib3.PoolManager()
        self.base = server.client_url
        self.port = server.get_port()
        self.answers: list[dict] = []

    def call(self, name, path, body, headers=None, method="POST", keep_request=True):
        """One request to the gateway; its JSON answer (or text) is kept and returned
        (with the request, unless not to ``keep_request``: a large one is described)."""
        r = self.pool.request(
            method,
            self.base + path,
            body=None if body is None else json.dumps(body).encode(),
            headers=headers or {},
            timeout=5,
            retries=False,
        )
        try:
            decoded = json.loads(r.data)
        except ValueError:
            decoded = r.data.decode(errors="replace")
        request = body if keep_request else f"<{len(json.dumps(body))} bytes of JSON>"
        self.answers.append(
            {"name": name, "path": path, "request": request, "status": r.status, "body": decoded}
        )
        return decoded

    def watch(self, name, body, then=None, headers=None, seconds=1.0):
        """A watch stream read for ``seconds`` (``then()`` runs 0.3 s in); its status line
        and the JSON objects it sent are kept."""
        s = socket.create_connection(("127.0.0.1", self.port))
        data = json.dumps(body).encode()
        hdr = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        s.sendall(
            f"POST /v3/watch HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{hdr}\r\n".encode()
            + data
        )
        s.settimeout(0.2)
        raw = b""
        t0 = time.monotonic()
        fired = False
        while time.monotonic() - t0 < seconds:
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                raw += chunk
            except TimeoutError:
                pass
            if then and not fired and time.monotonic() - t0 > 0.3:
                then()
                fired = True
        s.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        stream = []
        if b"chunked" in head.lower():
            while rest:
                size_text, _, rest = rest.partition(b"\r\n")
                size = int(size_text or b"0", 16)
                if size == 0:
                    break
                stream.append(rest[:size].decode())
                rest = rest[size + 2 :]
        else:
            stream.append(rest.decode(errors="replace"))
        self.answers.append(
            {
                "name": name,
                "path": "/v3/watch",
                "request": body,
                "status_line": status_line,
                "stream": stream,
            }
        )


def _txn(key, target, field, value):
    """A compare-and-put of ``key`` that reads it on failure, as the v3 transport sends."""
    return {
        "compare": [{"target": target, "result": "EQUAL", "key": b64(key), field: value}],
        "success": [{"request_put": {"key": b64(key), "value": b64("x")}}],
        "failure": [{"request_range": {"key": b64(key)}}],
    }


#: The ``--max-request-bytes`` of the server that records the refusals of requests too
#: large (:func:`record_limits`).
LIMIT = 4096


def record_limits(binary):
    """The answers of a server started with ``--max-request-bytes`` :data:`LIMIT` to
    requests over it: a put, a compare-and-swap (as the v3 transport sends it), and a put
    over gRPC's own limit (the limit plus 512 KiB)."""
    args = ["--max-request-bytes", str(LIMIT)]
    with EtcdServer(etcd_binary=binary, enable_v2=False, extra_args=args) as srv:
        rec = Recorder(srv)
        big = "x" * (LIMIT + 100)
        put = {"key": b64("/big"), "value": b64(big)}
        rec.call("put_too_large", "/v3/kv/put", put, keep_request=False)
        cas = _txn("/big", "MOD", "mod_revision", "3")
        cas["success"][0]["request_put"]["value"] = b64(big)
        rec.call("txn_too_large", "/v3/kv/txn", cas, keep_request=False)
        huge = {"key": b64("/big"), "value": b64("x" * (LIMIT + 512 * 1024 + 100))}
        rec.call("put_over_grpc_limit", "/v3/kv/put", huge, keep_request=False)
    return rec.answers


def main() -> None:
    """Record every answer of the binary ``argv[1]`` into ``argv[2]``."""
    binary, dest = sys.argv[1], sys.argv[2]
    with EtcdServer(etcd_binary=binary, enable_v2=False) as srv:
        rec = Recorder(srv)
        rec.call("version", "/version", None, method="GET")
        rec.call("v2_keys", "/v2/keys/", None, method="GET")
        rec.call("unknown_path", "/v3/kv/nosuch", {})
        rec.call("range_missing", "/v3/kv/range", {"key": b64("/missing")})
        rec.call(
            "range_missing_count_only", "/v3/kv/range", {"key": b64("/missing"), "count_only": True}
        )
        rec.call("put", "/v3/kv/put", {"key": b64("/k"), "value": b64("v1")})
        rec.call(
            "put_prev_kv", "/v3/kv/put", {"key": b64("/k"), "value": b64("v2"), "prev_kv": True}
        )
        rec.call("put_empty_value", "/v3/kv/put", {"key": b64("/empty"), "value": ""})
        rec.call("range_empty_value", "/v3/kv/range", {"key": b64("/empty")})
        rec.call("range_one", "/v3/kv/range", {"key": b64("/k")})
        rec.call("range_prefix", "/v3/kv/range", {"key": b64("/"), "range_end": b64("0")})
        rec.call("put_no_key", "/v3/kv/put", {"key": "", "value": b64("x")})
        rec.call("put_bad_json", "/v3/kv/put", "not an object")
        rec.call("txn_create_exists", "/v3/kv/txn", _txn("/k", "CREATE", "create_revision", "0"))
        rec.call("txn_create_new", "/v3/kv/txn", _txn("/new", "CREATE", "create_revision", "0"))
        rec.call("txn_cas_missing", "/v3/kv/txn", _txn("/gone", "MOD", "mod_revision", "3"))
        rec.call(
            "txn_bad_enum",
            "/v3/kv/txn",
            {"compare": [{"target": "NOPE", "result": "EQUAL", "key": b64("/k")}], "success": []},
        )
        rec.call("delete_missing", "/v3/kv/deleterange", {"key": b64("/missing")})
        rec.call("delete_one_prev_kv", "/v3/kv/deleterange", {"key": b64("/new"), "prev_kv": True})
        lease = rec.call("lease_grant", "/v3/lease/grant", {"TTL": 10})
        rec.call("lease_grant_zero", "/v3/lease/grant", {"TTL": 0})
        lid = lease["ID"]
        rec.call(
            "put_with_lease", "/v3/kv/put", {"key": b64("/leased"), "value": b64("v"), "lease": lid}
        )
        rec.call("range_leased", "/v3/kv/range", {"key": b64("/leased")})
        rec.call(
            "put_missing_lease",
            "/v3/kv/put",
            {"key": b64("/x"), "value": b64("v"), "lease": "12345"},
        )
        rec.call("keepalive", "/v3/lease/keepalive", {"ID": lid})
        rec.call("timetolive", "/v3/lease/timetolive", {"ID": lid, "keys": True})
        rec.call("leases", "/v3/lease/leases", {})
        rec.call("revoke", "/v3/lease/revoke", {"ID": lid})
        rec.call("keepalive_revoked", "/v3/lease/keepalive", {"ID": lid})
        rec.call("timetolive_revoked", "/v3/lease/timetolive", {"ID": lid})
        rec.call("revoke_revoked", "/v3/lease/revoke", {"ID": lid})
        rec.call("status", "/v3/maintenance/status", {})
        rec.call("member_list", "/v3/cluster/member/list", {})
        for i in range(3):
            rec.call(f"put_c{i}", "/v3/kv/put", {"key": b64("/c"), "value": b64(str(i))})
        rev = int(rec.call("range_c", "/v3/kv/range", {"key": b64("/c")})["header"]["revision"])
        rec.call("compaction", "/v3/kv/compaction", {"revision": str(rev - 1)})
        rec.call("range_compacted", "/v3/kv/range", {"key": b64("/c"), "revision": "2"})
        rec.call("range_future", "/v3/kv/range", {"key": b64("/c"), "revision": str(rev + 100)})

        # watch streams
        def writes():
            rec.call("w_put", "/v3/kv/put", {"key": b64("/w/a"), "value": b64("1")})
            rec.call("w_del", "/v3/kv/deleterange", {"key": b64("/w/a")})

        rec.watch(
            "watch_events",
            {
                "create_request": {
                    "key": b64("/w/"),
                    "range_end": b64("/w0"),
                    "prev_kv": True,
                    "progress_notify": True,
                }
            },
            then=writes,
        )
        rec.watch("watch_compacted", {"create_request": {"key": b64("/c"), "start_revision": "2"}})
        rec.watch(
            "watch_future", {"create_request": {"key": b64("/c"), "start_revision": str(rev + 100)}}
        )
        rec.watch("watch_progress_only", {"progress_request": {}})
        rec.watch("watch_bad_json", "garbage")
        # auth
        rec.call("role_add", "/v3/auth/role/add", {"name": "root"})
        rec.call("user_add", "/v3/auth/user/add", {"name": "root", "password": "secret"})
        rec.call("user_grant", "/v3/auth/user/grant", {"user": "root", "role": "root"})
        rec.call("role_add_job", "/v3/auth/role/add", {"name": "job"})
        rec.call(
            "role_grant_job",
            "/v3/auth/role/grant",
            {
                "name": "job",
                "perm": {"permType": "READWRITE", "key": b64("/job/"), "range_end": b64("/job0")},
            },
        )
        rec.call("user_add_alice", "/v3/auth/user/add", {"name": "alice", "password": "pw"})
        rec.call("user_grant_alice", "/v3/auth/user/grant", {"user": "alice", "role": "job"})
        rec.call("auth_enable", "/v3/auth/enable", {})
        rec.call(
            "auth_wrong_password", "/v3/auth/authenticate", {"name": "root", "password": "wrong"}
        )
        rec.call("auth_no_user", "/v3/auth/authenticate", {"name": "nobody", "password": "x"})
        rec.call("range_no_token", "/v3/kv/range", {"key": b64("/k")})
        rec.call(
            "range_bad_token",
            "/v3/kv/range",
            {"key": b64("/k")},
            headers={"Authorization": "bogus"},
        )
        rec.call(
            "range_bearer_token",
            "/v3/kv/range",
            {"key": b64("/k")},
            headers={"Authorization": "Bearer bogus"},
        )
        tok = rec.call("auth_alice", "/v3/auth/authenticate", {"name": "alice", "password": "pw"})[
            "token"
        ]
        h = {"Authorization": tok}
        rec.call(
            "alice_put_allowed", "/v3/kv/put", {"key": b64("/job/a"), "value": b64("1")}, headers=h
        )
        rec.call(
            "alice_put_denied", "/v3/kv/put", {"key": b64("/other"), "value": b64("1")}, headers=h
        )
        rec.call("alice_range_denied", "/v3/kv/range", {"key": b64("/other")}, headers=h)
        rec.call("alice_lease_grant", "/v3/lease/grant", {"TTL": 10}, headers=h)
        rec.call("alice_status", "/v3/maintenance/status", {}, headers=h)
        rec.call(
            "alice_txn_denied",
            "/v3/kv/txn",
            {
                "compare": [],
                "success": [{"request_put": {"key": b64("/other"), "value": b64("x")}}],
            },
            headers=h,
        )
        rec.watch("alice_watch_denied", {"create_request": {"key": b64("/other")}}, headers=h)
        rec.watch("watch_no_token", {"create_request": {"key": b64("/job/a")}})
        rec.watch(
            "watch_bad_token",
            {"create_request": {"key": b64("/job/a")}},
            headers={"Authorization": "bogus"},
        )
        rec.call("version_auth", "/version", None, method="GET")
    answers = rec.answers + record_limits(binary)
    with open(dest, "w") as fh:
        json.dump({"etcd": srv.version, "answers": answers}, fh, indent=1)
        fh.write("\n")
    print(dest, len(rec.answers))


if __name__ == "__main__":
    main()
