"""``etcd-rendezvous delete``: delete the keys of a finished run.

For the ``etcd`` backend, the run directory ``<prefix>/run_<run_id>`` and all below it;
for ``etcd-v2``, the state key, the node keys' directory and the run's keys in the
shared store. A run that is not finished (see :mod:`etcd_rendezvous.cli._runs`) is
refused unless ``--force``; ``--dry-run`` lists the keys and deletes nothing; otherwise
the command asks before deleting (``--yes`` does not ask).
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from ..layout import DEFAULT_PREFIX
from ._common import (
    CliError,
    Transport,
    add_run_options,
    confirm,
    etcd_errors,
    open_connection,
    v2_backend,
)
from ._runs import RunSummary, etcd_v2_store_keys, read_etcd_run, summarize_etcd, summarize_etcd_v2

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "add_deletion_options", "delete_runs", "run"]

HELP = "delete a finished run's keys"
DESCRIPTION = (
    "Delete the keys of a finished run (closed, or no worker left): the run directory "
    "for the etcd backend; the state key, node keys and store keys for etcd-v2. Asks "
    "first unless --yes; --dry-run only lists the keys. A live run is refused unless "
    "--force."
)


def add_deletion_options(parser: argparse.ArgumentParser) -> None:
    """``--dry-run``, ``--yes`` and ``--json`` of ``delete`` and ``gc``."""
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted; delete nothing"
    )
    parser.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``delete`` (the connection options come from a parent)."""
    add_run_options(parser)
    add_deletion_options(parser)
    parser.add_argument(
        "--force", action="store_true", help="delete the run even if workers are still in it"
    )


def _summary(args: argparse.Namespace, conn: Transport) -> RunSummary:
    if args.backend == "etcd-v2":
        backend = v2_backend(args, conn)
        if conn.try_get(backend.key) is None and not backend.list_nodes():
            raise CliError(
                f"no run {args.run_id!r} with --backend etcd-v2: etcd key {backend.key} does "
                "not exist (check --run-id, --prefix and --backend)"
            )
        summary = summarize_etcd_v2(args.run_id, backend, conn, conn.api)
        store_keys = etcd_v2_store_keys(conn).get(args.run_id, [])
        summary.keys.extend((key, False) for key in store_keys)
        return summary
    prefix = args.prefix or DEFAULT_PREFIX
    etcd_run = read_etcd_run(conn, prefix, args.run_id)
    if etcd_run.run_dir is None and etcd_run.state is None:
        raise CliError(
            f"no run {args.run_id!r} under prefix {prefix!r}: its run directory does not "
            "exist (check --run-id, --prefix and --backend)"
        )
    return summarize_etcd(etcd_run, conn.api)


def delete_runs(
    args: argparse.Namespace, conn: Transport, runs: list[RunSummary], out: TextIO
) -> int:
    """Delete the keys of ``runs`` after the confirmation ``args`` asks for (none with
    ``--dry-run``); report what was (or would be) deleted; return the exit status."""
    keys = [key for summary in runs for key, _ in summary.keys]
    report = {
        "dry_run": args.dry_run,
        "runs": [summary.as_dict() for summary in runs],
        "deleted": [],
    }
    if not args.json:
        for summary in runs:
            print(
                f"{summary.backend} run {summary.run_id!r} ({summary.status}, "
                f"{summary.live} live): {len(summary.keys)} key(s)",
                file=out,
            )
            for key, recursive in summary.keys:
                print(f"  {key}{'/ (and all below)' if recursive else ''}", file=out)
    if args.dry_run or not runs:
        if not args.json:
            print("dry run: nothing deleted" if runs else "nothing to delete", file=out)
        else:
            print(json.dumps(report, indent=2, sort_keys=True), file=out)
        return 0
    if not confirm(f"Delete {len(keys)} key(s) of {len(runs)} run(s)?", args):
        print("nothing deleted", file=out)
        return 1
    deleted = []
    for summary in runs:
        for key, recursive in summary.keys:
            if conn.delete(key, recursive=recursive):
                deleted.append(key)
    report["deleted"] = deleted
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True), file=out)
    else:
        print(f"deleted {len(deleted)} key(s) of {len(runs)} run(s)", file=out)
    return 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Delete the run's keys (after asking); return the exit status.

    Raises:
        CliError: the run is unknown, or not finished and ``--force`` is not given.
    """
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            summary = _summary(args, conn)
            if not summary.finished and not args.force:
                raise CliError(
                    f"run {args.run_id!r} is not finished ({summary.status}, {summary.live} "
                    "live worker key(s)): close it first, or pass --force"
                )
            return delete_runs(args, conn, [summary], out)
    finally:
        conn.close()
