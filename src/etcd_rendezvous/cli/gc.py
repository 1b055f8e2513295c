"""``etcd-rendezvous gc``: delete the finished runs nobody has touched for a while.

A run is collected when it is finished (closed and quiet, see
:mod:`etcd_rendezvous.cli._runs`) and idle for at least ``--older-than`` by etcd's
clock: for ``etcd-v2`` over etcd's v2 API, since its state key was last written (its
TTL tells). Where etcd keeps no time of a run (the ``etcd`` backend; ``etcd-v2`` over
the v3 API, or without a state key) the run has no age: it is collected only with
``--undated``. A run that was never closed is never collected: close it first (``close``
ends it for any worker still in it). As ``delete``, it asks first unless ``--yes``, and
``--dry-run`` deletes nothing; each run is read again after the confirmation and kept
if it changed. A run closed before it ever started (as ``close --create`` leaves it) is
kept unless ``--force``: it is there to stop workers that come later.
"""

from __future__ import annotations

import argparse
import re
from typing import TextIO

from ._common import etcd_errors, open_connection
from ._runs import RunSummary
from .delete import add_deletion_options, delete_runs
from .list_runs import add_selection, select_runs

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "duration", "run"]

HELP = "delete the finished runs idle for longer than a given time"
DESCRIPTION = (
    "Delete the finished runs (closed, and no worker left in them) idle for at least "
    "--older-than by etcd's clock (etcd-v2 over etcd's v2 API: since its state was "
    "written). Runs etcd keeps no time of (the etcd backend, etcd-v2 over v3) only with "
    "--undated; runs closed before they started (close --create) only with --force; runs "
    "never closed, never. Asks first unless --yes; --dry-run only lists."
)

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?)\s*([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """The argparse type of ``--older-than``: seconds, or a number with ``s``, ``m``,
    ``h`` or ``d``."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a duration like 90, 30m, 12h or 7d, got {text!r}"
        )
    return float(match[1]) * _UNITS[match[2]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``gc`` (the connection options come from a parent)."""
    add_selection(parser)
    parser.add_argument(
        "--older-than",
        type=duration,
        required=True,
        metavar="DURATION",
        help="idle time, by etcd's clock, after which a finished run is deleted (90, 30m, 12h, 7d)",
    )
    parser.add_argument(
        "--undated",
        action="store_true",
        help="also delete finished runs whose idle time etcd cannot tell (the etcd "
        "backend; etcd-v2 over etcd's v3 API)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="also delete runs closed before they ever started (close --create)",
    )
    add_deletion_options(parser)


def _collectable(
    summary: RunSummary, older_than: float, undated: bool, force: bool = False
) -> bool:
    if not summary.finished or (summary.never_started and not force):
        return False
    if summary.idle_seconds is None:
        return undated
    return summary.idle_seconds >= older_than


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Delete (after asking) the runs to collect; return the exit status."""
    runs = [
        r for r in select_runs(args) if _collectable(r, args.older_than, args.undated, args.force)
    ]
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            return delete_runs(args, conn, runs, out, stated_lifetime=args.heartbeat_lifetime)
    finally:
        conn.close()
