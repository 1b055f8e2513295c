"""``--etcd-api``: every command speaks the API it is told to, workers included."""

from __future__ import annotations

import uuid

import pytest

from etcd_rendezvous._transport.v3 import EtcdV3Connection
from etcd_rendezvous.etcd_server import EtcdServer
from support.cli import run_cli


@pytest.mark.slow
@pytest.mark.v2_only(reason="needs a server serving both APIs, to tell them apart")
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_demo_workers_speak_the_api_they_are_told(
    etcd_server: EtcdServer, etcd_prefix: str, backend: str
) -> None:
    """On a server with both APIs, ``auto`` would pick v2: ``--etcd-api v3`` must reach
    the workers, so the run's keys are in the v3 store (v2 and v3 keys are separate)."""
    run_id = f"api-{uuid.uuid4().hex[:8]}"
    prefix = ["--prefix", etcd_prefix] if backend == "etcd" else []
    result = run_cli(
        "demo", "--nodes", "2", "--backend", backend, "--etcd-api", "v3",
        "--endpoint", etcd_server.get_endpoint(), "--run-id", run_id, *prefix,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    key = (
        f"{etcd_prefix}/run_{run_id}/rdzv/active_version"
        if backend == "etcd"
        else f"/torch/elastic/rendezvous/{run_id}"
    )
    with EtcdV3Connection([(etcd_server.get_host(), etcd_server.get_port())]) as v3:
        assert v3.try_get(key) is not None, f"{key} is not in the v3 store"

    status = run_cli(
        "status", "--backend", backend, "--etcd-api", "v3", "--run-id", run_id,
        "--endpoint", etcd_server.get_endpoint(), *prefix,
    )  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    v2_status = run_cli(
        "status", "--backend", backend, "--etcd-api", "v2", "--run-id", run_id,
        "--endpoint", etcd_server.get_endpoint(), *prefix,
    )  # fmt: skip
    assert v2_status.returncode != 0  # not in the v2 store
    assert run_id in v2_status.stderr
