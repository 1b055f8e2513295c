"""What the ``etcd-rendezvous`` commands share.

The program's name and exit status, the errors reported as one line, the connection
options of the commands that talk to a running job, and the etcd connection those
options describe. This is the CLI's only door to the connection layer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping

from .._transport.interface import (
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Node,
    Transport,
    WatchStream,
)
from .._transport.options import create_etcd_connection
from .._transport.v2_session import key_path
from ..api import RendezvousConnectionError, RendezvousParameters
from ..dynamic_rendezvous import RendezvousState, decode_state
from ..etcd_rendezvous_backend import EtcdRendezvousBackend
from ..etcd_server import BINARY_PATH_ENV, TORCHELASTIC_BINARY_PATH_ENV
from ..layout import DEFAULT_PREFIX, ETCD_V2_STATE_PREFIX, LegacyLayout, normalize_key

__all__ = [
    "BINARY_ENV_VARS",
    "ETCDCTL_ENV",
    "EXIT_FAILED",
    "PROG",
    "CliError",
    "CompareFailedError",
    "KeyExistsError",
    "KeyNotFoundError",
    "Node",
    "Transport",
    "UsageError",
    "WatchStream",
    "add_endpoint_option",
    "add_lifetime_option",
    "add_run_options",
    "choose_backend",
    "confirm",
    "connection_options",
    "etcd_errors",
    "non_negative_seconds",
    "open_connection",
    "positive_seconds",
    "read_dir",
    "resolve_connection",
    "run_backends",
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


def positive_seconds(text: str) -> float:
    """The argparse type of a lifetime option: a finite number of seconds, more than 0."""
    value = non_negative_seconds(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number more than 0, got {text}")
    return value


#: The ``etcdctl`` environment variables the commands read when a flag is absent, and
#: the option each stands for (``ETCDCTL_USER`` may be ``user:password``, as for etcdctl).
ETCDCTL_ENV = {
    "endpoint": "ETCDCTL_ENDPOINTS",
    "cacert": "ETCDCTL_CACERT",
    "cert": "ETCDCTL_CERT",
    "key": "ETCDCTL_KEY",
    "username": "ETCDCTL_USER",
    "password": "ETCDCTL_PASSWORD",
}
_SCHEMES = ("http://", "https://")


def connection_options() -> argparse.ArgumentParser:
    """The parent parser of the connection options every etcd command shares
    (``--endpoint`` is each command's own: optional for ``demo``, where it means "no
    embedded etcd", and taken from ``ETCDCTL_ENDPOINTS`` elsewhere when absent)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(
        "etcd connection",
        "Absent flags are taken from ETCDCTL_ENDPOINTS, ETCDCTL_CACERT, ETCDCTL_CERT, "
        "ETCDCTL_KEY, ETCDCTL_USER (user or user:password) and ETCDCTL_PASSWORD, as etcdctl "
        "reads them.",
    )
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
    group.add_argument("--username", "--user", help="etcd user name (or user:password)")
    group.add_argument("--password", help="etcd password")
    group.add_argument(
        "--password-prompt",
        action="store_true",
        help="ask for the password on the terminal (also done when a user name is given "
        "without a password and stdin is a terminal)",
    )
    group.add_argument(
        "--read-timeout",
        type=non_negative_seconds,
        default=5.0,
        metavar="S",
        help="seconds per etcd request, and how long an unreachable etcd is retried "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout",
        type=non_negative_seconds,
        metavar="S",
        help="seconds one etcd request waits for an answer before the next endpoint is "
        "tried, at most --read-timeout (default: --read-timeout; a large store read in "
        "one request by list, delete and gc may need more than the library's 3 s)",
    )
    group.add_argument(
        "--connect-timeout",
        type=non_negative_seconds,
        metavar="S",
        help="seconds to connect (default: 5)",
    )
    return parent


def add_endpoint_option(parser: argparse.ArgumentParser) -> None:
    """``--endpoint`` of the commands that read or change a running job's keys."""
    parser.add_argument(
        "--endpoint",
        "--endpoints",
        metavar="HOST:PORT",
        help="etcd endpoint(s), comma-separated (HOST[:PORT][,HOST[:PORT]...], an "
        "http:// or https:// scheme allowed); default: $ETCDCTL_ENDPOINTS",
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """``--endpoint``, ``--run-id`` (required) and ``--backend`` of the commands that act
    on one run."""
    add_endpoint_option(parser)
    parser.add_argument("--run-id", metavar="R", required=True, help="the job's run id")
    parser.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        help="rendezvous backend of the run (default: the one that holds a run of this "
        "id; refused if both do)",
    )


def add_lifetime_option(parser: argparse.ArgumentParser) -> None:
    """``--heartbeat-lifetime`` of the commands that judge whether a run is finished."""
    parser.add_argument(
        "--heartbeat-lifetime",
        type=positive_seconds,
        metavar="S",
        help="etcd-v2: how long the run's nodes may stay silent before they count as dead "
        "(keep_alive_interval x keep_alive_max_attempt), for PyTorch's nodes configured "
        "otherwise than its defaults (15 s); never shorter than what the run's nodes of "
        "this package publish",
    )


def resolve_connection(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    ask: Callable[[str], str] = getpass.getpass,
) -> None:
    """Fill the connection options left unset on the command line from the ``ETCDCTL_*``
    variables of ``environ`` (``os.environ`` by default), split ``user:password``, strip
    the endpoints' ``http://``/``https://`` (an ``https`` scheme sets ``--protocol``),
    and ask for the password with ``ask`` when ``--password-prompt`` is given, or when a
    user name comes without a password and stdin is a terminal.

    Raises:
        UsageError: no endpoint anywhere, or endpoints mixing schemes.
    """
    env = os.environ if environ is None else environ
    for option, variable in ETCDCTL_ENV.items():
        if getattr(args, option, None) is None and env.get(variable):
            setattr(args, option, env[variable])
    if not args.endpoint:
        raise UsageError("no etcd endpoint: pass --endpoint HOST:PORT or set ETCDCTL_ENDPOINTS")
    schemes = set()
    endpoints = []
    for given in args.endpoint.split(","):
        endpoint = given.strip()
        for scheme in _SCHEMES:
            if endpoint.startswith(scheme):
                schemes.add(scheme[: -len("://")])
                endpoint = endpoint[len(scheme) :]
        endpoints.append(endpoint.rstrip("/"))
    if len(schemes) > 1:
        raise UsageError(f"--endpoint mixes http:// and https://: {args.endpoint!r}")
    if schemes and args.protocol is None:
        args.protocol = schemes.pop()
    args.endpoint = ",".join(endpoints)
    if args.username is not None and ":" in args.username and args.password is None:
        args.username, args.password = args.username.split(":", 1)
    wants_prompt = args.password_prompt or (
        args.username is not None and args.password is None and sys.stdin.isatty()
    )
    if wants_prompt and args.password is None:
        if args.username is None:
            raise UsageError("--password-prompt needs a user name (--user or ETCDCTL_USER)")
        args.password = ask(f"Password for etcd user {args.username}: ")


def open_connection(args: argparse.Namespace) -> Transport:
    """The etcd connection described by the command's connection options (after
    :func:`resolve_connection`)."""
    run_id = getattr(args, "run_id", None)
    if run_id is not None and (not run_id or "/" in run_id):
        raise UsageError(f"--run-id must be a non-empty string without '/', got {run_id!r}")
    resolve_connection(args)
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
        # The library's 3 s per request suits a rendezvous's small reads; the commands
        # read a whole prefix (and the shared store) in one request.
        "request_timeout": args.request_timeout or args.read_timeout or None,
    }
    params = RendezvousParameters(
        backend=getattr(args, "backend", None) or "etcd",
        endpoint=args.endpoint,
        run_id=run_id or "etcd-rendezvous-cli",
        min_nodes=1,
        max_nodes=1,
        **{name: value for name, value in options.items() if value is not None},
    )
    try:
        # The commands decide from what they read (whether a run is finished, what to
        # delete): no member behind the others may answer them.
        conn = create_etcd_connection(params, quorum_reads=True)
    except ValueError as exc:
        raise UsageError(f"invalid connection option: {exc}") from None
    if conn.api == "v2":
        named = {"--run-id": run_id, "--prefix": getattr(args, "prefix", None)}
        for option, value in named.items():
            try:
                if value:
                    key_path(value)
            except ValueError as exc:
                conn.close()
                raise UsageError(f"{option} {value!r}: {exc}") from None
    return conn


@contextlib.contextmanager
def etcd_errors(endpoint: str) -> Iterator[None]:
    """Turn a connection failure into one line that names the endpoint."""
    try:
        yield
    except RendezvousConnectionError as exc:
        raise CliError(f"cannot use etcd at {endpoint}: {exc}") from None


def v2_backend(
    args: argparse.Namespace, conn: Transport, run_id: str | None = None
) -> EtcdRendezvousBackend:
    """The ``etcd-v2`` backend of ``run_id`` (default ``--run-id``), its state key below
    ``--prefix``."""
    prefix = normalize_key(args.prefix or ETCD_V2_STATE_PREFIX).rstrip("/")
    return EtcdRendezvousBackend(conn, run_id or args.run_id, key_prefix=prefix or None)


def run_backends(args: argparse.Namespace, conn: Transport) -> list[str]:
    """The backends under which etcd holds a key of run ``--run-id`` below ``--prefix``
    (each backend's default prefix when absent): ``etcd``, its run directory or state;
    ``etcd-v2``, its state key or a key in its nodes directory."""
    found = []
    layout = LegacyLayout(args.prefix or DEFAULT_PREFIX, args.run_id)
    if conn.try_get(layout.run_dir) is not None or conn.try_get(layout.state_key) is not None:
        found.append("etcd")
    backend = v2_backend(args, conn)
    try:
        nodes = conn.list_dir(backend.nodes_layout.nodes_dir).children
    except KeyNotFoundError:
        nodes = ()
    if conn.try_get(backend.key) is not None or nodes:
        found.append("etcd-v2")
    return found


def choose_backend(args: argparse.Namespace, conn: Transport) -> None:
    """Set ``--backend``, when absent, to the backend that holds the run.

    Raises:
        CliError: both backends hold a run of this id (which one is meant cannot be
            told), or neither does; ``UsageError`` for ``close --create`` of a run that
            does not exist (which backend's keys to create cannot be told).
    """
    if args.backend is not None:
        return
    found = run_backends(args, conn)
    if len(found) == 1:
        args.backend = found[0]
        return
    legacy = LegacyLayout(args.prefix or DEFAULT_PREFIX, args.run_id).run_dir
    v2_key = v2_backend(args, conn).key
    where = f"the etcd backend's {legacy} and the etcd-v2 backend's key {v2_key}"
    if found:
        raise CliError(
            f"run {args.run_id!r} exists under both backends ({where}): pass --backend etcd "
            "or --backend etcd-v2"
        )
    if getattr(args, "create", False):
        raise UsageError(
            f"no run {args.run_id!r} exists: --create needs --backend etcd or --backend etcd-v2"
        )
    raise CliError(
        f"no run {args.run_id!r}: etcd holds neither {where} (check --run-id and --prefix)"
    )


def confirm(question: str, args: argparse.Namespace) -> bool:
    """Whether the user agrees to ``question``: ``--yes`` agrees, otherwise the answer
    typed on the terminal (``y``/``yes``).

    Raises:
        UsageError: neither ``--yes`` nor a terminal to ask on.
    """
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError("refusing to delete without confirmation: pass --yes (or --dry-run)")
    answer = input(f"{question} [y/N] ")
    return answer.strip().lower() in ("y", "yes")


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


def read_dir(conn: Transport, key: str, *, ttls: bool = True) -> Node | None:
    """Directory ``key``, or ``None`` if nothing is there; with its children's TTLs if
    ``ttls`` (free on v2, where a listing has them; on v3 one request per child's lease,
    which a command reading thousands of keys only to count them leaves out)."""
    try:
        directory = conn.list_dir(key)
    except KeyNotFoundError:
        return None
    if not ttls:
        return directory
    children = tuple(with_ttl(conn, child) or child for child in directory.children)
    return dataclasses.replace(directory, children=children)
