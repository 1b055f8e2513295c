"""``etcd-rendezvous list``: the runs under a prefix, one line each, without changing
anything.

For each run: its backend, the etcd API spoken, its status, the size of its world, its
version (``etcd``) or round (``etcd-v2``), how many keys of live workers it has, how
long it has been idle by etcd's clock (where etcd keeps a time of it), whether it is
finished, and why (see :mod:`etcd_rendezvous.cli._runs`).
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from ._common import (
    UsageError,
    add_endpoint_option,
    add_lifetime_option,
    etcd_errors,
    open_connection,
)
from ._runs import RunSummary, find_runs

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "add_selection", "format_idle", "run"]

HELP = "list the runs under a prefix"
DESCRIPTION = (
    "List the rendezvous runs etcd holds: backend, API, status, world size, "
    "version (round for etcd-v2), keys of live workers, idle time by etcd's clock, "
    "whether the run is finished (closed, and no worker left) and why. Both backends "
    "under their default prefixes unless --backend is given. Reads only."
)

#: What each column means, shown by ``list --help``.
EPILOG = """\
columns:
  STATUS   etcd: the state's status (setup, joinable, frozen, final, closed; none: no
           state); etcd-v2: empty, joining, complete, closed; invalid: a corrupt state
  WORLD    participants in the state now. An etcd-v2 state keeps only the nodes still
           in the round: a run whose nodes have left shows fewer than it formed with
  VERSION  etcd: the version; etcd-v2: the round
  LIVE     etcd: keep-alive, member and wait keys of live workers in any version
           directory (etcd deletes them when their TTL passes); etcd-v2: node keys.
           Closing a run does not end its workers: they leave as they finish, and
           their keys lapse
  IDLE     how long the run has been idle by etcd's clock, at least (0s while a key
           shows a live worker; etcd-v2 over the v2 API: the age of its state; -:
           etcd keeps no time of the run, as for the etcd backend)
  DONE     the run is finished: closed, and no worker left in it by etcd's keys and
           clock; only then may delete and gc remove it without --force
  WHY      what made DONE what it is (not closed, a live key, a recent state write...)
"""


def add_selection(parser: argparse.ArgumentParser) -> None:
    """``--endpoint``, ``--backend`` (both backends by default) and
    ``--heartbeat-lifetime`` of ``list`` and ``gc``."""
    add_endpoint_option(parser)
    parser.add_argument(
        "--backend",
        choices=("etcd", "etcd-v2"),
        help="only the runs of this backend (needed with --prefix; default: both)",
    )
    add_lifetime_option(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``list`` (the connection options come from a parent)."""
    add_selection(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON array")


def select_runs(args: argparse.Namespace) -> list[RunSummary]:
    """The runs ``--backend`` and ``--prefix`` select, read through a new connection."""
    if args.prefix is not None and args.backend is None:
        raise UsageError("--prefix needs --backend: the two backends use different prefixes")
    backends = [args.backend] if args.backend else ["etcd", "etcd-v2"]
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            return find_runs(conn, backends, args.prefix, args.heartbeat_lifetime)
    finally:
        conn.close()


def format_idle(summary: RunSummary) -> str:
    """The idle column: how long the run has been idle by etcd's clock (at least), or
    ``-`` where etcd keeps no time of it."""
    if summary.idle_seconds is not None:
        return _duration(summary.idle_seconds)
    return "-"


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Print the runs, as a table or (``--json``) a JSON array; return 0."""
    summaries = select_runs(args)
    if args.json:
        print(json.dumps([s.as_dict() for s in summaries], indent=2, sort_keys=True), file=out)
        return 0
    if not summaries:
        print("no runs", file=out)
        return 0
    header = (
        "BACKEND",
        "RUN ID",
        "API",
        "STATUS",
        "WORLD",
        "VERSION",
        "LIVE",
        "IDLE",
        "DONE",
        "WHY",
    )
    rows = [header] + [
        (
            s.backend,
            s.run_id,
            s.api,
            s.status,
            str(s.world_size),
            s.version or "-",
            str(s.live),
            format_idle(s),
            "yes" if s.finished else "no",
            s.verdict.reason,
        )
        for s in summaries
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(),
            file=out,
        )
    return 0
