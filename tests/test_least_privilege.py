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
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import urllib3

from etcd_rendezvous._connect import open_transport
from etcd_rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
)
from etcd_rendezvous.cli import main
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    etcd_v2_state_key,
)
from etcd_rendezvous.registry import get_rendezvous_handler

ROOT_PASSWORD = "root-secret"
JOB_PASSWORD = "job-secret"
#: What a refused call may take: the refusal is final, so it is not retried.
REFUSAL_BOUND = 1.0

_POOL = urllib3.PoolManager()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


class Gateway:
    """Raw requests to one etcd's gateway as ``root``."""

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

    def login(self) -> None:
        answer = self.call("/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})
        self.token = answer["token"]

    def user_with_grants(self, grants: list[tuple[str, bool]]) -> str:
        """A new user whose one role grants read-write on each ``(key, is_prefix)``."""
        name = f"job-{uuid.uuid4().hex[:8]}"
        self.call("/v3/auth/role/add", {"name": name})
        for key, is_prefix in grants:
            perm: dict[str, Any] = {"permType": "READWRITE", "key": _b64(key)}
            if is_prefix:
                perm["range_end"] = _prefix_end(key)
            self.call("/v3/auth/role/grant", {"name": name, "perm": perm})
        self.call("/v3/auth/user/add", {"name": name, "password": JOB_PASSWORD})
        self.call("/v3/auth/user/grant", {"user": name, "role": name})
        return name

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

    def keys_below(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix``."""
        answer = self.call(
            "/v3/kv/range",
            {"key": _b64(prefix), "range_end": _prefix_end(prefix), "keys_only": True},
        )
        return [base64.b64decode(kv["key"]).decode() for kv in answer.get("kvs", [])]


@pytest.fixture(scope="module")
def auth_server(etcd_server: EtcdServer) -> Iterator[EtcdServer]:
    """An etcd (the binary under test) without the v2 API, with auth enabled and user
    ``root``."""
    with EtcdServer(etcd_binary=etcd_server.binary, enable_v2=False) as server:
        gateway = Gateway(server)
        try:
            gateway.call("/v3/auth/role/add", {"name": "root"})
        except AssertionError as exc:
            pytest.skip(f"etcd {server.version} has no v3 auth: {exc}")
        gateway.call("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD})
        gateway.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        gateway.call("/v3/auth/enable", {})
        yield server


@pytest.fixture
def root(auth_server: EtcdServer) -> Gateway:
    gateway = Gateway(auth_server)
    gateway.login()
    return gateway


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


def _rendezvous(handlers: list[RendezvousHandler]) -> list[int]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    return sorted(info.rank for info in infos)


def _join_once(params: RendezvousParameters) -> None:
    """Create a handler and join (the error may come from either)."""
    handler = get_rendezvous_handler(params)
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
    backend: str, auth_server: EtcdServer, root: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = f"lp-{uuid.uuid4().hex[:8]}"
    grants = legacy_grants(run_id) if backend == "etcd" else dynamic_grants(run_id)
    user = root.user_with_grants(grants)
    handlers = [get_rendezvous_handler(_params(auth_server, backend, run_id, user)) for _ in "ab"]
    try:
        assert _rendezvous(handlers) == [0, 1]
        assert handlers[0].num_nodes_waiting() == 0
        connection = [
            "--endpoint", auth_server.get_endpoint(), "--run-id", run_id, "--backend", backend,
            "--username", user, "--password", JOB_PASSWORD,
        ]  # fmt: skip
        code, out, err = _cli(capsys, "status", *connection, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert len(report["participants"]) == 2, report
        code, out, err = _cli(capsys, "close", *connection)
        assert code == 0, err
        assert handlers[1].is_closed()
    finally:
        for handler in handlers:
            handler.close()


def test_a_user_limited_to_the_store_prefix_uses_the_store(
    auth_server: EtcdServer, root: Gateway
) -> None:
    prefix = f"/lp-store-{uuid.uuid4().hex[:8]}"
    user = root.user_with_grants([(prefix, True)])
    endpoint = (auth_server.get_host(), auth_server.get_port())
    # etcd_api=v3 checks the gateway with a request that needs no permission on a key.
    with open_transport([endpoint], etcd_api="v3", username=user, password=JOB_PASSWORD):
        pass
    with open_transport([endpoint], username=user, password=JOB_PASSWORD) as conn:
        assert conn.api == "v3"
        store = EtcdStore(conn, prefix, timeout=timedelta(seconds=10))
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2
        assert store.compare_set("a", b"1", b"2") == b"2"
        assert store.check(["a", "n"])
        assert store.num_keys() == 2
        assert store.delete_key("a")


# -- one permission missing: a clear error at once, nothing written ----------------------


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_missing_permission_is_named_at_once_and_nothing_is_written(
    backend: str, auth_server: EtcdServer, root: Gateway
) -> None:
    run_id = f"lp-{uuid.uuid4().hex[:8]}"
    grants = legacy_grants(run_id) if backend == "etcd" else dynamic_grants(run_id)
    # etcd: the run directory (its only grant); etcd-v2: the state key.
    missing, *kept = grants
    user = root.user_with_grants(kept)
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        _join_once(_params(auth_server, backend, run_id, user))
    took = time.monotonic() - started
    message = str(info.value)
    assert isinstance(info.value, RendezvousConnectionError), message
    assert repr(missing[0]) in message, message
    assert re.search(r"\b(read|write|readwrite) permission\b", message), message
    assert user in message, message
    assert took < REFUSAL_BOUND, f"{took:.2f} s: {message}"
    assert root.run_keys(run_id) == []


def test_a_store_without_write_permission_says_so_and_writes_nothing(
    auth_server: EtcdServer, root: Gateway
) -> None:
    prefix = f"/lp-store-{uuid.uuid4().hex[:8]}"
    name = f"job-{uuid.uuid4().hex[:8]}"
    root.call("/v3/auth/role/add", {"name": name})
    perm = {"permType": "READ", "key": _b64(prefix), "range_end": _prefix_end(prefix)}
    root.call("/v3/auth/role/grant", {"name": name, "perm": perm})
    root.call("/v3/auth/user/add", {"name": name, "password": JOB_PASSWORD})
    root.call("/v3/auth/user/grant", {"user": name, "role": name})
    endpoint = (auth_server.get_host(), auth_server.get_port())
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
