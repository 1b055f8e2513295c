"""The ``etcd-rendezvous`` command (also ``python -m etcd_rendezvous``).

This module parses the command line and dispatches to one module per command:
:mod:`~etcd_rendezvous.cli.demo`, :mod:`~etcd_rendezvous.cli.list_runs` (``list``),
:mod:`~etcd_rendezvous.cli.status`, :mod:`~etcd_rendezvous.cli.close`,
:mod:`~etcd_rendezvous.cli.delete`, :mod:`~etcd_rendezvous.cli.gc`,
:mod:`~etcd_rendezvous.cli.server` and :mod:`~etcd_rendezvous.cli.dashboard`. The
commands that talk to etcd share one parser of
connection options (filled from the ``ETCDCTL_*`` variables where a flag is absent);
errors the user can act on are one line on stderr, without a traceback. What each
command does: :doc:`operations`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
from collections.abc import Sequence

from .. import __version__
from ..api import RendezvousError
from . import close, dashboard, delete, demo, gc, list_runs, server, status
from ._common import EXIT_FAILED, PROG, CliError, UsageError, connection_options

__all__ = ["main"]

#: Exit status for bad usage (argparse uses it too).
_EXIT_USAGE = 2
#: Exit status after Ctrl-C, as shells report SIGINT.
_EXIT_INTERRUPTED = 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tools for the torch-free etcd rendezvous of PyTorch Elastic.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    connection = connection_options()
    for name, module, parents in (
        ("demo", demo, [connection]),
        ("list", list_runs, [connection]),
        ("status", status, [connection]),
        ("close", close, [connection]),
        ("delete", delete, [connection]),
        ("gc", gc, [connection]),
        ("server", server, []),
        ("dashboard", dashboard, [connection]),
    ):
        epilog = getattr(module, "EPILOG", None)
        # A command's epilog (what its columns mean) keeps its lines; then its
        # description is wrapped here.
        command = commands.add_parser(
            name,
            parents=parents,
            help=module.HELP,
            description=module.DESCRIPTION if epilog is None else textwrap.fill(module.DESCRIPTION),
            epilog=epilog,
            formatter_class=(
                argparse.HelpFormatter if epilog is None else argparse.RawDescriptionHelpFormatter
            ),
        )
        module.add_arguments(command)
    return parser


def _run(args: argparse.Namespace) -> int:
    """Run the command ``args`` names, writing to the standard streams."""
    commands = {
        "list": list_runs.run,
        "status": status.run,
        "close": close.run,
        "delete": delete.run,
        "gc": gc.run,
        "dashboard": dashboard.run,
    }
    if args.command in commands:
        return commands[args.command](args, sys.stdout)
    if args.command == "server":
        return server.run(args, sys.stdout, sys.stderr)
    return demo.run(args, sys.stdout, sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``etcd-rendezvous`` command; return its exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        problem = demo.usage_problem(args)
        if problem is not None:
            parser.error(problem)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return _EXIT_USAGE
    except CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except RendezvousError as exc:
        print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        what = "workers and embedded etcd stopped" if args.command == "demo" else "stopped"
        print(f"\n{PROG}: interrupted; {what}", file=sys.stderr)
        return _EXIT_INTERRUPTED
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
