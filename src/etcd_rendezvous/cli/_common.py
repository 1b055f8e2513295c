"""What the ``etcd-rendezvous`` commands share.

The program's name and exit status, the errors reported as one line, the connection
options of the commands that talk to a running job, and the etcd connection those
options describe. This is the CLI's only door to the connection layer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator

from .._params import create_etcd_connection
from .._transport import KeyNotFoundError, Node, Transport
from ..api import RendezvousConnectionError, RendezvousParameters
from ..dynamic_rendezvous import RendezvousState, decode_state
from ..etcd_rendezvous_backend import EtcdRendezvousBackend
from ..etcd_server import BINARY_PATH_ENV, TORCHELASTIC_BINARY_PATH_ENV
from ..layout import DEFAULT_PREFIX, ETCD_V2_STATE_PREFIX, normalize_key

__all__ = [
    "BINARY_ENV_VARS",
    "EXIT_FAILED",
    "PROG",
    "CliError",
    "Node",
    "Transport",
    "UsageError",
    "add_run_options",
    "connection_options",
    "etcd_errors",
    "non_negative_seconds",
    "open_connection",
    "read_dir",
    "v2_backend",
    "v2_state",
    "with_ttl",
]

PROG = "etcd-rendezvous"
#: Environment variables naming the etcd binary (ours, then PyTorch's).
BINARY_ENV_VARS = (BINARY_PATH_ENV, TORCHELASTIC_BINARY_PATH_ENV)
#: Exit status for a run that failed or whose workers disagree.
EXIT_FAILED = 1


class CliError(Exception):
    """A failure already described for the user in one line."""


class UsageError(CliError):
    """A bad option value, reported like argparse's own errors (exit status 2)."""


def non_negative_seconds(text: str) -> float:
    """The argparse type of a duration option: a number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def connection_options() -> argparse.ArgumentParser:
    """The parent parser of the connection options every etcd command shares
    (``--endpoint`` is each command's own: optional for ``demo``, required elsewhere)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("etcd connection")
    group.add_argument(
        "--prefix",
        help=f"etcd key prefix (default: {DEFAULT_PREFIX} for etcd, "
        f"{ETCD_V2_STATE_PREFIX} for etcd-v2)",
    )
    group.add_argument(
        "--etcd-api",
        choices=("auto", "v2", "v3"),
        help="etcd API to speak (default: auto: v2 where the server serves it, else v3)",
    )
    group.add_argument("--protocol", choices=("http", "https"), help="default: http")
    group.add_argument("--cacert", metavar="FILE", help="CA bundle that verifies the server")
    group.add_argument("--cert", metavar="FILE", help="client certificate (https)")
    group.add_argument("--key", metavar="FILE", help="private key of --cert")
    group.add_argument("--username", help="etcd user name")
    group.add_argument("--password", help="etcd password")
    group.add_argument(
        "--read-timeout",
        type=non_negative_seconds,
        default=5.0,
        metavar="S",
        help="seconds per etcd request, and how long an unreachable etcd is retried "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--connect-timeout",
        type=non_negative_seconds,
        metavar="S",
        help="seconds to connect (default: 5)",
    )
    return parent


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--endpoint`` (required), ``--run-id`` and ``--backend`` of ``status``/``close``."""
    parser.add_argument(
        "--endpoint",
        metavar="HOST:PORT",
        required=True,
        help="etcd endpoint(s), comma-separated (HOST[:PORT][,HOST[:PORT]...])",
    )
    parser.add_argument("--run-id", metavar="R", required=True, help="the job's run id")
    parser.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        default="etcd",
        help="rendezvous backend of the run (default: %(default)s)",
    )


def open_connection(args: argparse.Namespace) -> Transport:
    """The etcd connection described by the command's connection options."""
    if not args.run_id or "/" in args.run_id:
        raise UsageError(f"--run-id must be a non-empty string without '/', got {args.run_id!r}")
    options = {
        "etcd_api": args.etcd_api,
        "protocol": args.protocol,
        "cert": args.cert,
        "key": args.key,
        "cacert": args.cacert,
        "username": args.username,
        "password": args.password,
        "read_timeout": args.read_timeout,
        "connect_timeout": args.connect_timeout,
    }
    params = RendezvousParameters(
        backend=args.backend,
        endpoint=args.endpoint,
        run_id=args.run_id,
        min_nodes=1,
        max_nodes=1,
        **{name: value for name, value in options.items() if value is not None},
    )
    try:
        return create_etcd_connection(params)
    except ValueError as exc:
        raise UsageError(f"invalid connection option: {exc}") from None


@contextlib.contextmanager
def etcd_errors(endpoint: str) -> Iterator[None]:
    """Turn a connection failure into one line that names the endpoint."""
    try:
        yield
    except RendezvousConnectionError as exc:
        raise CliError(f"cannot use etcd at {endpoint}: {exc}") from None


def v2_backend(args: argparse.Namespace, conn: Transport) -> EtcdRendezvousBackend:
    """The ``etcd-v2`` backend of ``--run-id`` (its state key below ``--prefix``)."""
    prefix = normalize_key(args.prefix or ETCD_V2_STATE_PREFIX).rstrip("/")
    return EtcdRendezvousBackend(conn, args.run_id, key_prefix=prefix or None)


def v2_state(backend: EtcdRendezvousBackend) -> RendezvousState | None:
    """The decoded state (by the dynamic rendezvous's safe decoder, never ``pickle.loads``).

    Raises:
        RendezvousStateError: the key does not hold a rendezvous state.
    """
    current = backend.get_state()
    if current is None:
        return None
    return decode_state(current[0], f"etcd-v2 key {backend.key!r}")


def with_ttl(conn: Transport, node: Node | None) -> Node | None:
    """``node`` with its remaining TTL filled in (v3 keeps TTLs in leases, not keys)."""
    if node is None or node.ttl is not None:
        return node
    return dataclasses.replace(node, ttl=conn.time_to_live(node))


def read_dir(conn: Transport, key: str) -> Node | None:
    """Directory ``key`` with its children's TTLs, or ``None`` if nothing is there."""
    try:
        directory = conn.list_dir(key)
    except KeyNotFoundError:
        return None
    children = tuple(with_ttl(conn, child) or child for child in directory.children)
    return dataclasses.replace(directory, children=children)
