"""The dashboard's web server: a read-only WSGI application served by waitress.

Pages (``/`` the run list, ``/run?backend=B&run_id=R`` one run) are static HTML whose
script asks the JSON API (``/api/runs``, ``/api/run``) every second; the API answers
from the follower's memory, never from etcd, so a page costs etcd nothing.
``/metrics`` is the same memory in Prometheus' text format, through
``prometheus_client``. Only ``GET`` and ``HEAD`` are served.

waitress and prometheus_client are the ``[dashboard]`` extra: imported when the server
starts or ``/metrics`` is asked for, so that the rest of the command line works without
them (:func:`missing_extra` says which is missing).
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from .follow import Snapshot
from .views import DEFAULT_PAGE, RUN_LABELS, gauges, phases, run_view, runs_view

__all__ = ["EXTRA_MODULES", "App", "missing_extra", "serve"]

#: The modules of the ``[dashboard]`` extra.
EXTRA_MODULES = ("waitress", "prometheus_client")

_StartResponse = Callable[[str, list[tuple[str, str]]], Any]
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/run": ("run.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}


def missing_extra() -> list[str]:
    """The modules of the ``[dashboard]`` extra that are not installed."""
    return [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static").joinpath(name).read_bytes()


def _int(params: dict[str, list[str]], name: str, default: int) -> int:
    try:
        return int(params.get(name, [str(default)])[0])
    except ValueError:
        return default


class App:
    """The WSGI application over ``snapshot`` (the follower's), with ``clock`` the
    follower's monotonic clock."""

    def __init__(
        self, snapshot: Callable[[], Snapshot], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock

    def __call__(self, environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/") or "/"
        if method not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", b"read-only\n", "text/plain")
        params = parse_qs(environ.get("QUERY_STRING", ""))
        if path in _STATIC:
            name, content_type = _STATIC[path]
            return _answer(start_response, "200 OK", _static(name), content_type)
        if path == "/api/runs":
            return _json(start_response, runs_view(self._snapshot(), self._clock()))
        if path == "/api/run":
            view = run_view(
                self._snapshot(),
                params.get("backend", [""])[0],
                params.get("run_id", [""])[0],
                self._clock(),
                offset=_int(params, "offset", 0),
                limit=_int(params, "limit", DEFAULT_PAGE),
                query=params.get("q", [""])[0],
                problems=params.get("problems", [""])[0] in ("1", "true", "on"),
            )
            if view is None:
                return _json(start_response, {"error": "no such run"}, "404 Not Found")
            return _json(start_response, view)
        if path == "/metrics":
            body, content_type = metrics_text(self._snapshot(), self._clock())
            return _answer(start_response, "200 OK", body, content_type)
        return _answer(start_response, "404 Not Found", b"not found\n", "text/plain")


def _answer(
    start_response: _StartResponse, status: str, body: bytes, content_type: str
) -> list[bytes]:
    start_response(
        status,
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
        ],
    )
    return [body]


def _json(start_response: _StartResponse, data: object, status: str = "200 OK") -> list[bytes]:
    return _answer(start_response, status, json.dumps(data).encode(), "application/json")


def metrics_text(snapshot: Snapshot, now: float) -> tuple[bytes, str]:
    """``/metrics``: the per-run gauges and whether etcd is followed, in Prometheus'
    text format, and its content type."""
    # The [dashboard] extra (optional dependencies):
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415
    from prometheus_client.core import GaugeMetricFamily, Metric  # noqa: PLC0415
    from prometheus_client.exposition import CONTENT_TYPE_LATEST  # noqa: PLC0415

    class _Collector:
        def collect(self) -> Iterator[Metric]:
            for gauge in gauges(snapshot, now):
                family = GaugeMetricFamily(gauge.name, gauge.help, labels=RUN_LABELS)
                for labels, value in gauge.samples:
                    family.add_metric(list(labels), value)
                yield family
            phase = GaugeMetricFamily(
                "etcd_rendezvous_run_phase",
                "1 for the run's phase, 0 for its backend's other phases (etcd: its status; "
                "etcd-v2: empty, joining, complete, closed; invalid: a corrupt state).",
                labels=(*RUN_LABELS, "phase"),
            )
            for labels, current, every in phases(snapshot):
                for name in every:
                    phase.add_metric([*labels, name], 1.0 if name == current else 0.0)
            yield phase
            up = snapshot.error is None and snapshot.synced is not None
            yield GaugeMetricFamily(
                "etcd_rendezvous_dashboard_etcd_up",
                "1 while the dashboard follows etcd, 0 while it cannot (the run gauges then "
                "hold what it last saw).",
                value=1.0 if up else 0.0,
            )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve(app: App, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve ``app`` on ``host:port`` (port 0: any free port) until interrupted;
    ``announce`` gets the URL once the server listens."""
    from waitress import create_server  # noqa: PLC0415  (the [dashboard] extra)

    server = create_server(app, host=host, port=port, threads=4, ident="etcd-rendezvous")
    try:
        bound = server.effective_host, server.effective_port
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
        announce(f"http://{shown}:{bound[1]}/")
        server.run()
    finally:
        server.close()
