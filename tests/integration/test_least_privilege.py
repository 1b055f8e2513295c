"""Least privilege: a job's etcd user whose role covers the run's keys and nothing else.

etcd runs with auth enabled (its v3 auth, which is what etcd 3.6 has; the server is
started without the v2 API, so ``etcd_api=auto`` picks v3). Each test makes a user
whose role grants read-write on exactly the prefixes that ``docs/operations.rst`` lists
for the backend, and runs the backend, the store and ``etcd-rendezvous status``/``close``
as that user: everything works, ``etcd_api=auto`` included. With one permission
missing, the first call fails at once with an error naming the key and the permission,
and nothing is written.

The users and roles are set up through etcd's gateway as ``root`` (test set-up, outside
the code under test). The binary is the one under test (``ETCD_BINARY_PATH``).
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import urllib3

from etcd_rendezvous._transport.connect import open_transport
from etcd_rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
)
from etcd_rendezvous.cli import main
from etcd_rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from etcd_rendezvous.etcd_rendezvous import EtcdRendezvousHandler
from etcd_rendezvous.etcd_server import EtcdBinaryNotFoundError, EtcdServer, find_etcd_binary
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    etcd_v2_state_key,
)
from etcd_rendezvous.registry import get_rendezvous_handler
from support.tools import tools_required
from support.v3_gateway import b64
from support.wait import wait_until

ROOT_PASSWORD = "root-secret"
JOB_PASSWORD = "job-secret"
#: What a refused call may take: the refusal is final, so it is not retried.
REFUSAL_BOUND = 1.0

_POOL = urllib3.PoolManager()


def _prefix_end(prefix: str) -> str:
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


class Admin:
    """Users, roles and keys of one etcd with auth on, managed as ``root`` (test set-up)."""

    def user_with_grants(
        self, grants: list[tuple[str, bool]], permission: str = "readwrite"
    ) -> str:
        """A new user whose one role grants ``permission`` on each ``(key, is_prefix)``."""
        raise NotImplementedError

    def keys_below(self, prefix: str) -> list[str]:
        """Every key at or below ``prefix``."""
        raise NotImplementedError

    def run_keys(self, run_id: str) -> list[str]:
        """Every key of run ``run_id``, of either backend (the ``etcd-v2`` store keys
        that every run shares: those whose name decodes to one of this run's)."""
        keys = self.keys_below(LegacyLayout(DEFAULT_PREFIX, run_id).run_dir)
        keys += self.keys_below(etcd_v2_state_key(run_id))
        keys += self.keys_below(EtcdV2NodesLayout(run_id).nodes_dir)
        for key in self.keys_below(ETCD_V2_STORE_PREFIX + "/"):
            name = key.rsplit("/", 1)[-1]
            decoded = base64.b64decode(name + "=" * (-len(name) % 4), altchars=b"+/")
            if run_id.encode() in decoded:
                keys.append(key)
        return keys


class V3Admin(Admin):
    """etcd's v3 auth, through the gateway."""

    def __init__(self, server: EtcdServer) -> None:
        self.url = server.client_url
        self.token = ""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Authorization": self.token} if self.token else {}
        response = _POOL.request(
            "POST", self.url + path, body=json.dumps(body).encode(), headers=headers, timeout=5.0
        )
        assert response.status == 200, (path, response.status, response.data[:300])
        answer: dict[str, Any] = json.loads(response.data)
        return answer

    def enable(self) -> None:
        self.call("/v3/auth/role/add", {"name": "root"})
        self.call("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.call("/v3/auth/enable", {})

    def login(self) -> None:
        answer = self.call("/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})
        self.token = answer["token"]

    def user_with_grants(
        self, grants: list[tuple[str, bool]], permission: str = "readwrite"
    ) -> str:
        name = f"job-{uuid.uuid4().hex[:8]}"
        self.call("/v3/auth/role/add", {"name": name})
        for key, is_prefix in grants:
            perm: dict[str, Any] = {"permType": permission.upper(), "key": b64(key)}
            if is_prefix:
                perm["range_end"] = _prefix_end(key)
            self.call("/v3/auth/role/grant", {"name": name, "perm": perm})
        self.call("/v3/auth/user/add", {"name": name, "password": JOB_PASSWORD})
        self.call("/v3/auth/user/grant", {"user": name, "role": name})
        return name

    def keys_below(self, prefix: str) -> list[str]:
        answer = self.call(
            "/v3/kv/range",
            {"key": b64(prefix), "range_end": _prefix_end(prefix), "keys_only": True},
        )
        return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]


class V2Admin(Admin):
    """etcd's v2 auth (etcd 3.4/3.5 with ``--enable-v2``): roles of key patterns."""

    def __init__(self, server: EtcdServer) -> None:
        self.url = server.client_url

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = urllib3.make_headers(basic_auth=f"root:{ROOT_PASSWORD}")
        data = None if body is None else json.dumps(body).encode()
        response = _POOL.request(method, self.url + path, body=data, headers=headers, timeout=5.0)
        if method == "GET" and response.status == 404:
            return None
        assert response.status in (200, 201), (path, response.status, response.data[:300])
        return json.loads(response.data) if response.data else None

    def enable(self) -> None:
        self.call("PUT", "/v2/auth/users/root", {"user": "root", "password": ROOT_PASSWORD})
        self.call("PUT", "/v2/auth/enable")
        # The guest role (anyone without credentials) may do anything until told not to.
        everything = {"read": ["/*"], "write": ["/*"]}
        self.call("PUT", "/v2/auth/roles/guest", {"role": "guest", "revoke": {"kv": everything}})

    def user_with_grants(
        self, grants: list[tuple[str, bool]], permission: str = "readwrite"
    ) -> str:
        name = f"job-{uuid.uuid4().hex[:8]}"
        patterns = [key + "*" if is_prefix else key for key, is_prefix in grants]
        kv = {kind: patterns if kind in permission else [] for kind in ("read", "write")}
        self.call("PUT", f"/v2/auth/roles/{name}", {"role": name, "permissions": {"kv": kv}})
        user = {"user": name, "password": JOB_PASSWORD, "roles": [name]}
        self.call("PUT", f"/v2/auth/users/{name}", user)
        return name

    def keys_below(self, prefix: str) -> list[str]:
        answer = self.call("GET", f"/v2/keys{prefix}?recursive=true")
        if answer is None:
            return []
        found: list[str] = []

        def walk(node: dict[str, Any]) -> None:
            if not node.get("dir"):
                found.append(node["key"])
            for child in node.get("nodes", []):
                walk(child)

        walk(answer["node"])
        return found


def _serves_v2(binary: str) -> bool:
    """Whether etcd ``binary`` can serve the v2 API (3.4 and 3.5 can; 3.6 cannot)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"etcd Version: (\d+)\.(\d+)", out.stdout)
    return match is not None and (int(match[1]), int(match[2])) < (3, 6)


@pytest.fixture(scope="module")
def binary() -> str:
    """The etcd binary under test (``ETCD_BINARY_PATH``, else the one found); whichever
    API the session's server serves, so that this runs on etcd 3.6 in any pass."""
    try:
        return find_etcd_binary()
    except EtcdBinaryNotFoundError as exc:
        if tools_required():
            raise
        pytest.skip(f"no etcd binary: {exc}")


@pytest.fixture(scope="module", params=["v3", "v2"])
def auth_server(request: pytest.FixtureRequest, binary: str) -> Iterator[tuple[EtcdServer, str]]:
    """An etcd (the binary under test) with auth on and user ``root``, and the API the
    job speaks to it (``etcd_api=auto`` picks it): v3 (a server without v2, as etcd 3.6
    is, and etcd's v3 auth), or v2 (``--enable-v2`` and etcd's v2 auth; etcd 3.4/3.5)."""
    api: str = request.param
    if api == "v2" and not _serves_v2(binary):
        pytest.skip(f"{binary} has no v2 API")
    with EtcdServer(etcd_binary=binary, enable_v2=api == "v2") as server:
        admin = V3Admin(server) if api == "v3" else V2Admin(server)
        admin.enable()
        yield server, api


@pytest.fixture
def root(auth_server: tuple[EtcdServer, str]) -> Admin:
    server, api = auth_server
    if api == "v2":
        return V2Admin(server)
    admin = V3Admin(server)
    admin.login()
    return admin


# -- the grants of each backend (as docs/operations.rst lists them) ----------------------


def legacy_grants(run_id: str, prefix: str = DEFAULT_PREFIX) -> list[tuple[str, bool]]:
    """The ``etcd`` backend: the run directory's key and everything below it."""
    return [(LegacyLayout(prefix, run_id).run_dir, True)]


def dynamic_grants(run_id: str) -> list[tuple[str, bool]]:
    """The ``etcd-v2`` backend: the state key, the run's node keys, and the store that
    every run shares (PyTorch's layout)."""
    return [
        (etcd_v2_state_key(run_id), False),
        (EtcdV2NodesLayout(run_id).nodes_dir, True),
        (ETCD_V2_STORE_PREFIX + "/", True),
    ]


def _params(server: EtcdServer, backend: str, run_id: str, user: str) -> RendezvousParameters:
    config: dict[str, Any] = (
        {"timeout": 60, "last_call_timeout": 1}
        if backend == "etcd"
        else {"join_timeout": 60, "last_call_timeout": 1}
    )
    return RendezvousParameters(
        backend=backend,
        endpoint=server.get_endpoint(),
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        torch_store="false",
        username=user,
        password=JOB_PASSWORD,
        **config,
    )


def _rendezvous(handlers: list[Handler]) -> list[int]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    return sorted(info.rank for info in infos)


Handler = EtcdRendezvousHandler | DynamicRendezvousHandler


def _handler(params: RendezvousParameters) -> Handler:
    """The registry's handler for ``params`` (one of ours, which can be closed)."""
    handler = get_rendezvous_handler(params)
    if not isinstance(handler, (EtcdRendezvousHandler, DynamicRendezvousHandler)):
        raise TypeError(f"backend {params.backend!r} made a {type(handler).__name__}")
    return handler


def _join_once(params: RendezvousParameters) -> None:
    """Create a handler and join (the error may come from either)."""
    handler = _handler(params)
    try:
        handler.next_rendezvous()
    finally:
        handler.close()


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# -- everything works with the run's prefixes ---------------------------------------------


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_user_limited_to_the_runs_prefixes_runs_the_backend_status_and_close(
    backend: str,
    auth_server: tuple[EtcdServer, str],
    root: Admin,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, _ = auth_server
    run_id = f"lp-{uuid.uuid4().hex[:8]}"
    grants = legacy_grants(run_id) if backend == "etcd" else dynamic_grants(run_id)
    user = root.user_with_grants(grants)
    handlers = [_handler(_params(server, backend, run_id, user)) for _ in "ab"]
    try:
        assert _rendezvous(handlers) == [0, 1]
        assert handlers[0].num_nodes_waiting() == 0
        connection = [
            "--endpoint", server.get_endpoint(), "--run-id", run_id, "--backend", backend,
            "--username", user, "--password", JOB_PASSWORD,
        ]  # fmt: skip
        code, out, err = _cli(capsys, "status", *connection, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert len(report["participants"]) == 2, report
        code, out, err = _cli(capsys, "close", *connection)
        assert code == 0, err
        # A handler may learn of it from its watch a moment later.
        wait_until(handlers[1].is_closed, timeout=10, what="the handler to see the close")
    finally:
        for handler in handlers:
            handler.close()


def test_a_user_limited_to_the_store_prefix_uses_the_store(
    auth_server: tuple[EtcdServer, str], root: Admin
) -> None:
    server, api = auth_server
    prefix = f"/lp-store-{uuid.uuid4().hex[:8]}"
    user = root.user_with_grants([(prefix, True)])
    endpoint = (server.get_host(), server.get_port())
    # etcd_api=v3 checks the gateway with a request that needs no permission on a key.
    with open_transport([endpoint], etcd_api=api, username=user, password=JOB_PASSWORD):
        pass
    with open_transport([endpoint], username=user, password=JOB_PASSWORD) as conn:
        assert conn.api == api
        store = EtcdStore(conn, prefix, timeout=timedelta(seconds=10))
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2
        assert store.compare_set("a", b"1", b"2") == b"2"
        assert store.check(["a", "n"])
        assert store.num_keys() == 2
        assert store.delete_key("a")


# -- one permission missing: a clear error at once, nothing written ----------------------


@pytest.mark.parametrize(
    ("backend", "missing"),
    [("etcd", 0), ("etcd-v2", 0), ("etcd-v2", 1), ("etcd-v2", 2)],
    ids=["etcd-run-dir", "etcd-v2-state", "etcd-v2-nodes", "etcd-v2-store"],
)
def test_a_missing_permission_is_named_at_once_and_nothing_is_written(
    backend: str, missing: int, auth_server: tuple[EtcdServer, str], root: Admin
) -> None:
    server, _ = auth_server
    run_id = f"lp-{uuid.uuid4().hex[:8]}"
    grants = legacy_grants(run_id) if backend == "etcd" else dynamic_grants(run_id)
    key = grants[missing][0].rstrip("/")
    kept = [grant for i, grant in enumerate(grants) if i != missing]
    user = root.user_with_grants(kept)
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        _join_once(_params(server, backend, run_id, user))
    took = time.monotonic() - started
    message = str(info.value)
    assert isinstance(info.value, RendezvousConnectionError), message
    assert f"'{key}" in message, message  # (v2 spells a directory with a "/")
    assert re.search(r"\b(read|write|readwrite) permission\b", message), message
    assert user in message, message
    assert took < REFUSAL_BOUND, f"{took:.2f} s: {message}"
    assert root.run_keys(run_id) == []


def test_a_store_without_write_permission_says_so_and_writes_nothing(
    auth_server: tuple[EtcdServer, str], root: Admin
) -> None:
    server, _ = auth_server
    prefix = f"/lp-store-{uuid.uuid4().hex[:8]}"
    name = root.user_with_grants([(prefix, True)], permission="read")
    endpoint = (server.get_host(), server.get_port())
    with open_transport([endpoint], username=name, password=JOB_PASSWORD) as conn:
        store = EtcdStore(conn, prefix, timeout=timedelta(seconds=10))
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError) as info:
            store.set("a", b"1")
        took = time.monotonic() - started
    message = str(info.value)
    assert "write permission" in message, message
    assert prefix in message, message
    assert took < REFUSAL_BOUND, f"{took:.2f} s: {message}"
    assert root.keys_below(prefix) == []


def test_the_etcd_v2_backends_store_works_with_its_documented_grant(
    auth_server: tuple[EtcdServer, str], root: Admin
) -> None:
    # The etcd-v2 backend's store is shared by every run (PyTorch's layout): its grant
    # is the store directory's keys, ``--prefix /torch/elastic/store/``, with the ``/``
    # (docs/operations.rst). torchrun's agent of rank 0 waits for the other agents' keys
    # with multi_get (several missing keys: one watch of the store directory) and
    # counts keys with num_keys.
    server, _ = auth_server
    user = root.user_with_grants([(ETCD_V2_STORE_PREFIX + "/", True)])
    endpoint = (server.get_host(), server.get_port())
    run = uuid.uuid4().hex[:8]
    keys = [f"torch.rendezvous.{run}.0/torchelastic/role_info/{i}" for i in range(3)]
    with open_transport([endpoint], username=user, password=JOB_PASSWORD) as conn:
        store = EtcdStore(conn, ETCD_V2_STORE_PREFIX, timeout=timedelta(seconds=20))
        store.set(keys[0], b"0")
        with pytest.raises(LookupError, match=r"not set within 0\.5 s"):
            store.wait(keys, timedelta(seconds=0.5))  # two missing: the directory's watch
        store.set(keys[1], b"1")
        store.set(keys[2], b"2")
        assert store.multi_get(keys) == [b"0", b"1", b"2"]
        assert store.num_keys() >= 3
