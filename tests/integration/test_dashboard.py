"""``etcd-rendezvous dashboard`` in a real headless browser (Debian's Chromium) and
scraped by a real Prometheus server, against real worker processes.

The browser test follows a rendezvous as it forms, a worker as it is killed, and etcd
as it stops; it takes the screenshots of docs/dashboard.rst. To regenerate those::

    ETCD_RENDEZVOUS_SCREENSHOTS=docs/_static pytest -n 0 -m dashboard \
        tests/integration/test_dashboard.py -k browser

The Prometheus test scrapes the dashboard and a worker that serves its own metrics
(``ETCD_RENDEZVOUS_METRICS_PORT``), queries them through Prometheus' HTTP API, and
waits for docs/dashboard-alerts.yml's rule on a waiting rendezvous to fire (its
threshold and ``for:`` shortened).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_rendezvous.etcd_server import EtcdServer
from support.browser import Browser, chromium_binary
from support.dashboard import dashboard, png_size
from support.net import closed_port as free_port
from support.rdzv import Worker, started
from support.tools import missing_tool, require_command
from support.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.dashboard]

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Where to copy the screenshots for the docs (unset: they stay in the test's tmp dir).
SCREENSHOTS_ENV = "ETCD_RENDEZVOUS_SCREENSHOTS"
WIDTH, HEIGHT = 1280, 800


@pytest.fixture
def browser() -> Iterator[Browser]:
    binary = chromium_binary()
    if binary is None:
        missing_tool("no Chromium on PATH (apt-get install chromium)")
        return
    with Browser(binary, WIDTH, HEIGHT) as opened:
        yield opened


def _shot(browser: Browser, tmp_path: Path, name: str) -> Path:
    """A screenshot of the page as ``name``: checked (a PNG of the window's width, at
    least its height, not blank), and copied to ``$ETCD_RENDEZVOUS_SCREENSHOTS``."""
    path = browser.screenshot(tmp_path / name)
    width, height = png_size(path)
    assert width == WIDTH, (name, width)
    assert height >= HEIGHT, (name, height)
    assert browser.colours(path) > 20, f"{name} looks blank"
    target = os.environ.get(SCREENSHOTS_ENV)
    if target:
        shutil.copy(path, Path(target) / name)
    return path


def _legacy_worker(endpoint: str, run_id: str) -> Worker:
    # max 3 and a long last call: the round forms as the third worker arrives.
    return Worker(endpoint, run_id, 3, 3, last_call=1, timeout=120)


def test_browser_follows_a_rendezvous_a_dead_worker_and_a_lost_etcd(
    private_etcd_server: EtcdServer,
    browser: Browser,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    endpoint = private_etcd_server.get_endpoint()
    run_id = f"train-{uuid.uuid4().hex[:6]}"
    row = f"document.querySelector('tr[data-run=\"etcd/{run_id}\"]')"
    with dashboard(endpoint, "--read-timeout", "2") as url:
        browser.goto(url)
        browser.wait_for(
            "document.body.dataset.etcd === 'ok' && document.body.dataset.runs === '0'"
        )
        assert browser.value("document.getElementById('empty').hidden") is False

        # Two of three workers: the version is joinable, both wait.
        first = started(workers, [_legacy_worker(endpoint, run_id) for _ in range(2)])
        for worker in first:
            worker.send("join")
        browser.wait_for(f"{row} && {row}.dataset.phase === 'joinable'")
        other = f"v2-{uuid.uuid4().hex[:6]}"
        v2 = started(
            workers,
            [
                Worker(endpoint, other, 2, 2, last_call=1, extra_args=["--backend=etcd-v2"])
                for _ in range(2)
            ],
        )
        for worker in v2:
            worker.send("join")
        browser.wait_for(
            f'document.querySelector(\'tr[data-run="etcd-v2/{other}"][data-phase="complete"]\')'
        )
        for worker in v2:
            assert worker.next_event()["event"] == "joined"
        browser.wait_for(f"{row}.cells[6].textContent === '2'")  # waiting
        _shot(browser, tmp_path, "dashboard-runs.png")

        query = urllib.parse.urlencode({"backend": "etcd", "run_id": run_id})
        browser.goto(f"{url}run?{query}")
        browser.wait_for("document.body.dataset.phase === 'joinable'")
        assert browser.value("document.querySelectorAll('#members tbody tr').length") == 2
        _shot(browser, tmp_path, "dashboard-run-forming.png")

        # The third arrives: the page shows the version final, in its timeline, 3 live.
        (third,) = started(workers, [_legacy_worker(endpoint, run_id)])
        third.send("join")
        group = [*first, third]
        joined = [worker.next_event() for worker in group]
        assert sorted(event["rank"] for event in joined) == [0, 1, 2], joined
        browser.wait_for("document.body.dataset.phase === 'final'")
        browser.wait_for(
            "document.querySelectorAll('#members tbody tr[data-state=\"live\"]').length === 3"
        )
        version = str(joined[0]["version"])
        browser.wait_for(f"document.querySelector('#timeline li[data-round=\"{version}\"]')")

        # A worker killed: its keep-alive lapses (a TTL of 10 s) and the page says so.
        victim = group[1]
        victim.kill()
        browser.wait_for("document.body.dataset.missing === '1'", timeout=40)
        lapsed = browser.value(
            "Array.from(document.querySelectorAll('#members tbody tr[data-state=\"lapsed\"]'))"
            ".map(tr => Number(tr.cells[0].textContent))"
        )
        assert lapsed == [joined[1]["rank"]], lapsed
        browser.value("document.getElementById('problems').click()")
        browser.wait_for("document.querySelectorAll('#members tbody tr').length === 1")
        browser.value("document.getElementById('problems').click()")
        browser.wait_for("document.querySelectorAll('#members tbody tr').length === 3")
        _shot(browser, tmp_path, "dashboard-dead-node.png")

        # etcd stops: the page says etcd is unreachable and keeps what it saw.
        private_etcd_server.stop()
        browser.wait_for("document.body.dataset.etcd === 'error'", timeout=40)
        banner = browser.value("document.getElementById('etcd').textContent")
        assert "etcd is unreachable" in banner, banner
        assert endpoint in banner, banner
        assert browser.value("document.body.dataset.phase") == "final"
        _shot(browser, tmp_path, "dashboard-etcd-down.png")


# ---- Prometheus ------------------------------------------------------------------------


def _prometheus_binary() -> str:
    return require_command("prometheus", "apt-get install prometheus")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _alert_rules(threshold: str, hold: str) -> str:
    """The documented alert rules, with the waiting threshold and every ``for:`` made
    short enough for a test."""
    rules = (DOCS / "dashboard-alerts.yml").read_text()
    rules = re.sub(
        r"etcd_rendezvous_run_waiting_seconds > \d+",
        f"etcd_rendezvous_run_waiting_seconds > {threshold}",
        rules,
    )
    return re.sub(r"for: \S+", f"for: {hold}", rules)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    """``start(targets)``: a Prometheus on loopback scraping ``targets`` every second,
    with the documented alert rules; returns its URL. Stopped at teardown."""
    binary = _prometheus_binary()
    processes: list[subprocess.Popen[bytes]] = []

    def start(targets: list[str]) -> str:
        port = free_port()
        (tmp_path / "rules.yml").write_text(_alert_rules("2", "1s"))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "scrape_configs": [{"job_name": "rdzv", "static_configs": [{"targets": targets}]}],
        }
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        log = (tmp_path / "prometheus.log").open("wb")
        processes.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url), 60, "Prometheus to answer")
        return url

    yield start
    for process in processes:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _query(url: str, expression: str) -> list[dict[str, Any]]:
    answer = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expression}))
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_prometheus_scrapes_the_dashboard_and_a_worker_and_the_alert_fires(
    private_etcd_server: EtcdServer,
    prometheus: Any,
    workers: list[Worker],
) -> None:
    endpoint = private_etcd_server.get_endpoint()
    run_id = f"wait-{uuid.uuid4().hex[:6]}"
    # One worker of two: it waits in the rendezvous and serves its own metrics.
    worker_port = free_port()
    os.environ["ETCD_RENDEZVOUS_METRICS_PORT"] = str(worker_port)
    os.environ["ETCD_RENDEZVOUS_METRICS_ADDR"] = "127.0.0.1"
    try:
        (waiting,) = started(workers, [Worker(endpoint, run_id, 2, 2, timeout=120)])
    finally:
        del os.environ["ETCD_RENDEZVOUS_METRICS_PORT"], os.environ["ETCD_RENDEZVOUS_METRICS_ADDR"]
    waiting.send("join")
    with dashboard(endpoint) as url:
        target = urllib.parse.urlsplit(url).netloc
        server = prometheus([target, f"127.0.0.1:{worker_port}"])
        labels = f'run_id="{run_id}",backend="etcd"'

        def scraped(expression: str) -> list[dict[str, Any]]:
            found: list[list[dict[str, Any]]] = []
            wait_until(
                lambda: bool(found.append(_query(server, expression)) or found[-1]), 60, expression
            )
            return found[-1]

        (participants,) = scraped(f"etcd_rendezvous_run_participants{{{labels}}}")
        assert participants["value"][1] == "1"
        (phase,) = scraped(f'etcd_rendezvous_run_phase{{{labels},phase="joinable"}} == 1')
        assert phase["metric"]["prefix"] == "/torchelastic/p2p"
        assert scraped("etcd_rendezvous_dashboard_etcd_up == 1")
        # The worker's own metrics: the requests its rendezvous sent to etcd.
        requests = scraped('sum(etcd_rendezvous_transport_requests_total{job="rdzv"})')
        assert float(requests[0]["value"][1]) > 0

        # The documented rule on a rendezvous that waits (here for more than 2 s).
        def firing() -> list[dict[str, Any]]:
            alerts = _get(f"{server}/api/v1/alerts")["data"]["alerts"]
            return [
                a
                for a in alerts
                if a["state"] == "firing" and a["labels"].get("alertname") == "RendezvousWaiting"
            ]

        wait_until(lambda: bool(firing()), 60, "the RendezvousWaiting alert to fire")
        (alert,) = firing()
        assert alert["labels"]["run_id"] == run_id
