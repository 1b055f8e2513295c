"""A waiting ``next_rendezvous()`` logs its progress at INFO (both backends): how many
are in, what it waits for, and how long is left; the logging ends with the call."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_rendezvous import _progress_log
from etcd_rendezvous.api import RendezvousHandler, RendezvousParameters
from etcd_rendezvous.dynamic_rendezvous import create_handler
from etcd_rendezvous.etcd_rendezvous import create_rdzv_handler
from etcd_rendezvous.etcd_rendezvous_backend import create_backend
from etcd_rendezvous.etcd_server import EtcdServer
from support.wait import wait_until

_LINES = {
    "etcd": r"Rendezvous of run '{run}': 1 of 2 workers joined version \d+ \(max 2\), "
    r"waiting for 1 more; (\d+) s left",
    "etcd-v2": r"Rendezvous '{run}' round 0: [01] of 2 nodes joined \(max 2\), "
    r"waiting for [12] more; (\d+) s left",
}


def _handler(backend: str, endpoint: str, prefix: str, run_id: str) -> RendezvousHandler:
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        timeout=60,
        join_timeout=60,
        last_call_timeout=1,
        read_timeout=10,
        **({"etcd_prefix": prefix} if backend == "etcd" else {}),
    )
    if backend == "etcd":
        return create_rdzv_handler(params)
    store_backend, store = create_backend(params)
    return create_handler(store, store_backend, params)


def _progress_threads(run_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"etcd-rendezvous-progress-{run_id}"]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_waiting_rendezvous_logs_its_progress(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    backend: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_progress_log, "PROGRESS_INTERVAL_BOUNDS", (0.3, 0.3))
    caplog.set_level(logging.INFO, logger="etcd_rendezvous")
    run_id = f"progress-{uuid.uuid4().hex[:8]}"
    line = re.compile(_LINES[backend].format(run=re.escape(run_id)))
    endpoint = etcd_server.get_endpoint()
    first = _handler(backend, endpoint, etcd_prefix, run_id)
    second = _handler(backend, endpoint, etcd_prefix, run_id)

    def progress_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if line.fullmatch(r.getMessage())]

    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(first.next_rendezvous)
        # Alone, the first worker waits: its progress is logged at INFO, at a steady pace.
        wait_until(lambda: len(progress_lines()) >= 2, timeout=30, what="two progress lines")
        records = progress_lines()
        assert all(r.levelno == logging.INFO for r in records)
        lefts = [int(line.fullmatch(r.getMessage())[1]) for r in records]  # type: ignore[index]
        assert all(0 < left <= 60 for left in lefts), lefts
        assert lefts == sorted(lefts, reverse=True), lefts
        assert len(_progress_threads(run_id)) == 1
        # The second one comes: both complete, and the progress logging ends.
        second.next_rendezvous()
        waiting.result(timeout=60)
    assert _progress_threads(run_id) == []
    count = len(progress_lines())
    for handler in (first, second):
        handler.shutdown()
    assert len(progress_lines()) == count
