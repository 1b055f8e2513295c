"""``etcd-rendezvous dashboard``: a live web page of every run, and a Prometheus
endpoint.

The server follows etcd with watch streams (:mod:`~etcd_rendezvous.cli._dashboard.follow`)
and keeps every run of both backends in memory; its pages and ``/metrics`` read that
memory (:mod:`~etcd_rendezvous.cli._dashboard.web`). Read-only; bound to loopback
unless ``--listen`` says otherwise. Needs the ``[dashboard]`` extra (waitress and
prometheus_client). What it shows: :doc:`dashboard`.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
from typing import TextIO

from ._common import CliError, UsageError, open_connection
from ._dashboard.follow import Follower, Source
from ._dashboard.web import App, missing_extra, serve
from .list_runs import add_selection

__all__ = ["DEFAULT_LISTEN", "DESCRIPTION", "HELP", "add_arguments", "parse_listen", "run"]

HELP = "serve a live web page of every run, and /metrics for Prometheus"
DESCRIPTION = (
    "Serve a read-only web page of every rendezvous run of both backends, live (the "
    "server follows etcd with watch streams), a page per run (phase, round, members, who "
    "is missing, the rounds seen) and /metrics in Prometheus' format. Listens on "
    "loopback unless --listen names another address. Needs the [dashboard] extra."
)
#: Where the dashboard listens by default: loopback only.
DEFAULT_LISTEN = "127.0.0.1:8379"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``dashboard`` (the connection options come from a parent)."""
    add_selection(parser)
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="address and port to serve on (default: %(default)s; port 0: any free port; "
        "0.0.0.0 or [::] serves other machines too)",
    )


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT`` for an IPv6 address) as a host and a port.

    Raises:
        UsageError: not of that form, or a port outside 0-65535.
    """
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen must be HOST:PORT (e.g. {DEFAULT_LISTEN}), got {text!r}")
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the dashboard until Ctrl-C or SIGTERM; exit 0 when stopped that way.

    Raises:
        CliError: the extra is not installed, or the address cannot be listened on.
    """
    missing = missing_extra()
    if missing:
        raise CliError(
            f"the dashboard needs {' and '.join(missing)}: pip install 'etcd-rendezvous[dashboard]'"
        )
    host, port = parse_listen(args.listen)
    if args.prefix is not None and args.backend is None:
        raise UsageError("--prefix needs --backend: the two backends use different prefixes")
    backends = [args.backend] if args.backend else ["etcd", "etcd-v2"]
    sources = tuple(Source.default(backend, args.prefix) for backend in backends)
    conn = open_connection(args)
    follower = Follower(conn, sources)
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)

    def announce(url: str) -> None:
        print(f"dashboard: {url} (etcd at {args.endpoint}; metrics: {url}metrics)", file=out)
        if not _is_loopback(host):
            print(
                f"note: listening on {host}, not loopback: anyone who can reach it sees "
                "the run ids and hosts (the pages change nothing)",
                file=out,
            )
        print("Press Ctrl-C to stop.", file=out, flush=True)

    try:
        follower.start()
        serve(App(follower.snapshot), host, port, announce)
    except OSError as exc:
        raise CliError(f"cannot listen on {args.listen}: {exc}") from None
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        follower.close()
        conn.close()
    return 0
