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


out = []


def call(pool, base, path, body, name, headers=None, method="POST"):
    r = pool.request(
        method,
        base + path,
        body=None if body is None else json.dumps(body).encode(),
        headers=headers or {},
        timeout=5,
        retries=False,
    )
    try:
        decoded = json.loads(r.data)
    except ValueError:
        decoded = r.data.decode(errors="replace")
    out.append({"name": name, "path": path, "request": body, "status": r.status, "body": decoded})
    return decoded


def watch(base_port, body, name, then=None, headers=None, seconds=1.0):
    s = socket.create_connection(("127.0.0.1", base_port))
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
    out.append(
        {
            "name": name,
            "path": "/v3/watch",
            "request": body,
            "status_line": status_line,
            "stream": stream,
        }
    )


def main() -> None:
    """Record every answer of the binary ``argv[1]`` into ``argv[2]``."""
    binary, dest = sys.argv[1], sys.argv[2]
    pool = urllib3.PoolManager()
    with EtcdServer(etcd_binary=binary, enable_v2=False) as srv:
        base = srv.client_url
        port = srv.get_port()
        call(pool, base, "/version", None, "version", method="GET")
        call(pool, base, "/v2/keys/", None, "v2_keys", method="GET")
        call(pool, base, "/v3/kv/nosuch", {}, "unknown_path")
        call(pool, base, "/v3/kv/range", {"key": b64("/missing")}, "range_missing")
        call(
            pool,
            base,
            "/v3/kv/range",
            {"key": b64("/missing"), "count_only": True},
            "range_missing_count_only",
        )
        call(pool, base, "/v3/kv/put", {"key": b64("/k"), "value": b64("v1")}, "put")
        call(
            pool,
            base,
            "/v3/kv/put",
            {"key": b64("/k"), "value": b64("v2"), "prev_kv": True},
            "put_prev_kv",
        )
        call(pool, base, "/v3/kv/put", {"key": b64("/empty"), "value": ""}, "put_empty_value")
        call(pool, base, "/v3/kv/range", {"key": b64("/empty")}, "range_empty_value")
        call(pool, base, "/v3/kv/range", {"key": b64("/k")}, "range_one")
        call(pool, base, "/v3/kv/range", {"key": b64("/"), "range_end": b64("0")}, "range_prefix")
        call(pool, base, "/v3/kv/put", {"key": "", "value": b64("x")}, "put_no_key")
        call(pool, base, "/v3/kv/put", "not an object", "put_bad_json")
        call(
            pool,
            base,
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "target": "CREATE",
                        "result": "EQUAL",
                        "key": b64("/k"),
                        "create_revision": "0",
                    }
                ],
                "success": [{"request_put": {"key": b64("/k"), "value": b64("x")}}],
                "failure": [{"request_range": {"key": b64("/k")}}],
            },
            "txn_create_exists",
        )
        call(
            pool,
            base,
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "target": "CREATE",
                        "result": "EQUAL",
                        "key": b64("/new"),
                        "create_revision": "0",
                    }
                ],
                "success": [{"request_put": {"key": b64("/new"), "value": b64("x")}}],
                "failure": [{"request_range": {"key": b64("/new")}}],
            },
            "txn_create_new",
        )
        call(
            pool,
            base,
            "/v3/kv/txn",
            {
                "compare": [
                    {"target": "MOD", "result": "EQUAL", "key": b64("/gone"), "mod_revision": "3"}
                ],
                "success": [{"request_put": {"key": b64("/gone"), "value": b64("x")}}],
                "failure": [{"request_range": {"key": b64("/gone")}}],
            },
            "txn_cas_missing",
        )
        call(
            pool,
            base,
            "/v3/kv/txn",
            {"compare": [{"target": "NOPE", "result": "EQUAL", "key": b64("/k")}], "success": []},
            "txn_bad_enum",
        )
        call(pool, base, "/v3/kv/deleterange", {"key": b64("/missing")}, "delete_missing")
        call(
            pool,
            base,
            "/v3/kv/deleterange",
            {"key": b64("/new"), "prev_kv": True},
            "delete_one_prev_kv",
        )
        lease = call(pool, base, "/v3/lease/grant", {"TTL": 10}, "lease_grant")
        call(pool, base, "/v3/lease/grant", {"TTL": 0}, "lease_grant_zero")
        lid = lease["ID"]
        call(
            pool,
            base,
            "/v3/kv/put",
            {"key": b64("/leased"), "value": b64("v"), "lease": lid},
            "put_with_lease",
        )
        call(pool, base, "/v3/kv/range", {"key": b64("/leased")}, "range_leased")
        call(
            pool,
            base,
            "/v3/kv/put",
            {"key": b64("/x"), "value": b64("v"), "lease": "12345"},
            "put_missing_lease",
        )
        call(pool, base, "/v3/lease/keepalive", {"ID": lid}, "keepalive")
        call(pool, base, "/v3/lease/timetolive", {"ID": lid, "keys": True}, "timetolive")
        call(pool, base, "/v3/lease/leases", {}, "leases")
        call(pool, base, "/v3/lease/revoke", {"ID": lid}, "revoke")
        call(pool, base, "/v3/lease/keepalive", {"ID": lid}, "keepalive_revoked")
        call(pool, base, "/v3/lease/timetolive", {"ID": lid}, "timetolive_revoked")
        call(pool, base, "/v3/lease/revoke", {"ID": lid}, "revoke_revoked")
        call(pool, base, "/v3/maintenance/status", {}, "status")
        call(pool, base, "/v3/cluster/member/list", {}, "member_list")
        for i in range(3):
            call(pool, base, "/v3/kv/put", {"key": b64("/c"), "value": b64(str(i))}, f"put_c{i}")
        rev = int(
            call(pool, base, "/v3/kv/range", {"key": b64("/c")}, "range_c")["header"]["revision"]
        )
        call(pool, base, "/v3/kv/compaction", {"revision": str(rev - 1)}, "compaction")
        call(pool, base, "/v3/kv/range", {"key": b64("/c"), "revision": "2"}, "range_compacted")
        call(
            pool,
            base,
            "/v3/kv/range",
            {"key": b64("/c"), "revision": str(rev + 100)},
            "range_future",
        )

        # watch streams
        def writes():
            p2 = urllib3.PoolManager()
            call(p2, base, "/v3/kv/put", {"key": b64("/w/a"), "value": b64("1")}, "w_put")
            call(p2, base, "/v3/kv/deleterange", {"key": b64("/w/a")}, "w_del")

        watch(
            port,
            {
                "create_request": {
                    "key": b64("/w/"),
                    "range_end": b64("/w0"),
                    "prev_kv": True,
                    "progress_notify": True,
                }
            },
            "watch_events",
            then=writes,
        )
        watch(
            port, {"create_request": {"key": b64("/c"), "start_revision": "2"}}, "watch_compacted"
        )
        watch(
            port,
            {"create_request": {"key": b64("/c"), "start_revision": str(rev + 100)}},
            "watch_future",
        )
        watch(port, {"progress_request": {}}, "watch_progress_only")
        watch(port, "garbage", "watch_bad_json")
        # auth
        call(pool, base, "/v3/auth/role/add", {"name": "root"}, "role_add")
        call(pool, base, "/v3/auth/user/add", {"name": "root", "password": "secret"}, "user_add")
        call(pool, base, "/v3/auth/user/grant", {"user": "root", "role": "root"}, "user_grant")
        call(pool, base, "/v3/auth/role/add", {"name": "job"}, "role_add_job")
        call(
            pool,
            base,
            "/v3/auth/role/grant",
            {
                "name": "job",
                "perm": {"permType": "READWRITE", "key": b64("/job/"), "range_end": b64("/job0")},
            },
            "role_grant_job",
        )
        call(pool, base, "/v3/auth/user/add", {"name": "alice", "password": "pw"}, "user_add_alice")
        call(
            pool, base, "/v3/auth/user/grant", {"user": "alice", "role": "job"}, "user_grant_alice"
        )
        call(pool, base, "/v3/auth/enable", {}, "auth_enable")
        call(
            pool,
            base,
            "/v3/auth/authenticate",
            {"name": "root", "password": "wrong"},
            "auth_wrong_password",
        )
        call(
            pool, base, "/v3/auth/authenticate", {"name": "nobody", "password": "x"}, "auth_no_user"
        )
        call(pool, base, "/v3/kv/range", {"key": b64("/k")}, "range_no_token")
        call(
            pool,
            base,
            "/v3/kv/range",
            {"key": b64("/k")},
            "range_bad_token",
            headers={"Authorization": "bogus"},
        )
        call(
            pool,
            base,
            "/v3/kv/range",
            {"key": b64("/k")},
            "range_bearer_token",
            headers={"Authorization": "Bearer bogus"},
        )
        tok = call(
            pool, base, "/v3/auth/authenticate", {"name": "alice", "password": "pw"}, "auth_alice"
        )["token"]
        h = {"Authorization": tok}
        call(
            pool,
            base,
            "/v3/kv/put",
            {"key": b64("/job/a"), "value": b64("1")},
            "alice_put_allowed",
            headers=h,
        )
        call(
            pool,
            base,
            "/v3/kv/put",
            {"key": b64("/other"), "value": b64("1")},
            "alice_put_denied",
            headers=h,
        )
        call(pool, base, "/v3/kv/range", {"key": b64("/other")}, "alice_range_denied", headers=h)
        call(pool, base, "/v3/lease/grant", {"TTL": 10}, "alice_lease_grant", headers=h)
        call(pool, base, "/v3/maintenance/status", {}, "alice_status", headers=h)
        call(
            pool,
            base,
            "/v3/kv/txn",
            {
                "compare": [],
                "success": [{"request_put": {"key": b64("/other"), "value": b64("x")}}],
            },
            "alice_txn_denied",
            headers=h,
        )
        watch(port, {"create_request": {"key": b64("/other")}}, "alice_watch_denied", headers=h)
        watch(port, {"create_request": {"key": b64("/job/a")}}, "watch_no_token")
        watch(
            port,
            {"create_request": {"key": b64("/job/a")}},
            "watch_bad_token",
            headers={"Authorization": "bogus"},
        )
        call(pool, base, "/version", None, "version_auth", method="GET")
    with open(dest, "w") as fh:
        json.dump({"etcd": srv.version, "answers": out}, fh, indent=1)
        fh.write("\n")
    print(dest, len(out))


if __name__ == "__main__":
    main()
