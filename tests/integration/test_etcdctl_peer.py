"""etcd's own ``etcdctl`` as an independent peer of the v3 API.

What ``etcd-rendezvous status`` and the docs (``docs/etcd-v3.rst``, "How the layout
maps"; ``docs/operations.rst``) promise an operator sees with ``etcdctl get --prefix``
is checked with a real etcdctl: the same keys, and the same values as ``status``
reports. ``etcdctl del`` of a running job's state is handled as the docs say: the
workers start a new rendezvous version.

etcdctl is ``$ETCDCTL_BINARY_PATH`` (CI points it at the etcdctl built with
``tests/etcd/build.py``), else ``etcdctl`` next to the etcd binary under test, else
on ``PATH``. These tests need the v3 API under test (``ETCD_RENDEZVOUS_ETCD_API=v3``):
with v2, the workers' keys are in the v2 store, which etcdctl 3.6 cannot read.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess

import pytest

from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.pytest_plugin import etcd_api_under_test
from support.cli import run_cli
from support.rdzv import Worker, expect_joined, join_all
from support.wait import wait_until

ETCDCTL_ENV = "ETCDCTL_BINARY_PATH"

pytestmark = pytest.mark.skipif(
    etcd_api_under_test() != "v3",
    reason="etcdctl reads the v3 store; ETCD_RENDEZVOUS_ETCD_API=v3 makes the workers use it",
)


@pytest.fixture(scope="module")
def etcdctl(etcd_server: EtcdServer) -> str:
    explicit = os.environ.get(ETCDCTL_ENV)
    if explicit:
        assert os.access(explicit, os.X_OK), f"${ETCDCTL_ENV}={explicit} is not executable"
        return explicit
    beside = os.path.join(os.path.dirname(etcd_server.binary), "etcdctl")
    found = beside if os.access(beside, os.X_OK) else shutil.which("etcdctl")
    if found is None:
        pytest.skip(f"no etcdctl (set ${ETCDCTL_ENV}; tests/etcd/build.py builds one)")
    return found


def run_etcdctl(etcdctl: str, server: EtcdServer, *args: str) -> str:
    result = subprocess.run(
        [etcdctl, f"--endpoints={server.client_url}", "--dial-timeout=5s", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=dict(os.environ, ETCDCTL_API="3"),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def listing(etcdctl: str, server: EtcdServer, prefix: str) -> dict[str, str]:
    """``etcdctl get --prefix -w json`` of ``prefix``: key to value."""
    out = json.loads(run_etcdctl(etcdctl, server, "get", "--prefix", "-w", "json", prefix))
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
        for kv in out.get("kvs", [])
    }


def status_json(server: EtcdServer, run_id: str, prefix: str) -> dict:
    result = run_cli(
        "status", "--json", "--etcd-api", "v3", "--endpoint", server.get_endpoint(),
        "--run-id", run_id, "--prefix", prefix, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def _start(server: EtcdServer, run_id: str, prefix: str, n: int, lo: int, hi: int) -> list:
    group = [
        Worker(server.get_endpoint(), run_id, lo, hi, prefix=prefix, last_call=1) for _ in range(n)
    ]
    for worker in group:
        worker.wait_ready()
    return group


def test_etcdctl_sees_the_documented_keys_and_the_state_status_reports(
    etcd_server: EtcdServer, etcdctl: str, etcd_prefix: str, run_id: str, workers: list
) -> None:
    version = run_etcdctl(etcdctl, etcd_server, "version")
    assert re.search(r"etcdctl version: 3\.\d+\.\d+", version), version
    group = _start(etcd_server, run_id, etcd_prefix, 2, 2, 2)
    workers.extend(group)
    joined = join_all(group)
    for rank in (0, 1):
        worker = next(w for w, j in zip(group, joined) if j["rank"] == rank)
        assert worker.request(f"set key{rank} value{rank}")["event"] == "ok"

    run_dir = f"{etcd_prefix}/run_{run_id}"
    keys = listing(etcdctl, etcd_server, run_dir)
    # docs/etcd-v3.rst: the directory markers (empty values), the state, the version
    # counter, a keep-alive key per member, the version's progress key and the store's
    # base64 keys.
    for marker in (run_dir, f"{run_dir}/rdzv", f"{run_dir}/rdzv/v_1", f"{run_dir}/rdzv/v_1/kv"):
        assert keys.get(marker) == "", (marker, sorted(keys))
    assert f"{run_dir}/rdzv/version_counter" in keys
    documented = re.compile(
        rf"{re.escape(run_dir)}(/rdzv(/active_version|/version_counter|/v_1"
        r"(/kv(/[A-Za-z0-9+/=]+)?|/node_[0-9a-f]+|/progress)?)?)?"
    )
    assert [key for key in keys if not documented.fullmatch(key)] == []
    assert len([key for key in keys if "/node_" in key]) == 2
    assert len([key for key in keys if "/kv/" in key]) >= 2

    # The state etcdctl shows is the one status reports.
    state = json.loads(keys[f"{run_dir}/rdzv/active_version"])
    status = status_json(etcd_server, run_id, etcd_prefix)
    assert state["status"] == "final"
    assert status["status"] == "final"
    assert str(status["version"]) == state["version"] == "1"
    assert status["key"] == f"{run_dir}/rdzv/active_version"
    assert sorted(status["participants"]) == sorted(state["participants"]) == [0, 1]
    assert len(state["keep_alives"]) == 2
    assert {key for key in state["keep_alives"]} <= set(keys)


def test_etcdctl_del_of_a_running_jobs_state_starts_a_new_version(
    etcd_server: EtcdServer, etcdctl: str, etcd_prefix: str, run_id: str, workers: list
) -> None:
    """docs/operations.rst: deleting the state key lets the workers start a new version;
    the members of the old one see a waiting worker and re-rendezvous into it."""
    group = _start(etcd_server, run_id, etcd_prefix, 2, 2, 3)
    workers.extend(group)
    first = join_all(group)
    assert {j["version"] for j in first} == {"1"}
    state_key = f"{etcd_prefix}/run_{run_id}/rdzv/active_version"

    late = _start(etcd_server, run_id, etcd_prefix, 1, 2, 3)[0]
    workers.append(late)
    late.send("join")
    wait_until(
        lambda: group[0].request("waiting")["n"] > 0,
        what="the members to see the late worker waiting",
    )
    deleted = run_etcdctl(etcdctl, etcd_server, "del", state_key)
    assert deleted.strip() == "1"
    # The members re-rendezvous (as an agent does when num_nodes_waiting() > 0).
    for worker in group:
        worker.send("join")
    second = [expect_joined(worker.next_event(), worker) for worker in [*group, late]]
    assert sorted(j["rank"] for j in second) == [0, 1, 2]
    assert {j["world_size"] for j in second} == {3}
    assert {j["version"] for j in second} == {"2"}
    state = json.loads(listing(etcdctl, etcd_server, state_key)[state_key])
    assert (state["status"], state["version"]) == ("final", "2")
