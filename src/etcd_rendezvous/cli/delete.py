"""``etcd-rendezvous delete``: delete the keys of a finished run.

For the ``etcd`` backend, the run directory ``<prefix>/run_<run_id>`` and all below it;
for ``etcd-v2``, the state key, the node keys' directory and the run's keys in the
shared store (under the default prefix only: the store is shared by all prefixes). A
run that is not finished (closed and quiet, see :mod:`etcd_rendezvous.cli._runs`) is
refused unless ``--force``, with what to do instead; ``--dry-run`` lists the keys and
deletes nothing; otherwise the command asks before deleting (``--yes`` does not ask),
then reads the run again and keeps it if it is no longer finished or its state changed
(a job reusing the run id meanwhile, a node writing a heartbeat): an ``etcd-v2`` run
judged quiet by its state's age, which etcd's members' clocks tell, is read again no
sooner than a heartbeat lifetime after it was judged, by this process's clock. It
deletes the state key first, by a compare-and-delete on the state judged, then looks
for worker keys and a new state once more, and only then deletes the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, TextIO

from ..layout import DEFAULT_PREFIX
from ._common import (
    CliError,
    Transport,
    add_lifetime_option,
    add_run_options,
    choose_backend,
    confirm,
    etcd_errors,
    open_connection,
    v2_backend,
)
from ._runs import RunSummary, owns_store_keys, read_run

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "add_deletion_options", "delete_runs", "run"]

HELP = "delete a finished run's keys"
DESCRIPTION = (
    "Delete the keys of a finished run (closed, and no worker left in it): the run "
    "directory for the etcd backend; the state key, node keys and (under the default "
    "prefix only) store keys for etcd-v2. Asks first unless --yes; --dry-run only lists "
    "the keys. A run that is not closed, or whose workers may still be in it, is refused "
    "unless --force. After the confirmation the run is read again and kept if it changed."
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
    add_lifetime_option(parser)
    add_deletion_options(parser)
    parser.add_argument(
        "--force",
        action="store_true",
        help="delete the run even if it is not closed, or workers may still be in it",
    )


def _summary(args: argparse.Namespace, conn: Transport) -> RunSummary:
    summary = read_run(
        conn, args.backend, args.prefix, args.run_id, stated_lifetime=args.heartbeat_lifetime
    )
    if summary is not None:
        return summary
    if args.backend == "etcd-v2":
        raise CliError(
            f"no run {args.run_id!r} with --backend etcd-v2: etcd key "
            f"{v2_backend(args, conn).key} does not exist (check --run-id, --prefix and "
            "--backend)"
        )
    raise CliError(
        f"no run {args.run_id!r} under prefix {args.prefix or DEFAULT_PREFIX!r}: its run "
        "directory does not exist (check --run-id, --prefix and --backend)"
    )


def _refusal(summary: RunSummary, args: argparse.Namespace) -> str | None:
    """Why ``delete`` without ``--force`` refuses the run (``None``: it is finished),
    and what the operator may do instead."""
    verdict = summary.verdict
    if verdict.finished:
        return None
    what = f"run {summary.run_id!r} is not finished"
    if verdict.over:
        return (
            f"{what}: {summary.status}, but {verdict.reason}: its workers may still be "
            "leaving; delete it once they are gone, or pass --force"
        )
    # A quiet run's reason says it is not closed; a live one's names its live keys.
    why = verdict.reason if verdict.quiet else f"not closed ({summary.status}), {verdict.reason}"
    command = f"etcd-rendezvous close --run-id {summary.run_id}"
    if summary.backend != "etcd":
        command += f" --backend {summary.backend}"
    if args.prefix is not None:
        command += f" --prefix {args.prefix}"
    return (
        f"{what}: {why}. Close it first with `{command}` (and the connection options), "
        "which ends it for any worker still in it, then delete it; or pass --force"
    )


def _index(summary: RunSummary) -> int | None:
    return None if summary.state is None else summary.state.modified_index


def _changed_since(judged: RunSummary, now: RunSummary | None, force: bool) -> str | None:
    """Why ``judged`` must not be deleted after all, given what etcd holds ``now``; or
    ``None`` to go on. Without ``force`` the run must still be finished and its state
    unchanged: a job that took the run id in the meantime is not wiped."""
    if now is None:
        return "it is gone"
    if force:
        return None
    if not now.finished:
        return f"it is no longer finished ({now.status}: {now.verdict.reason})"
    if _index(now) != _index(judged):
        return "its state changed since it was read"
    return None


def _confirm_quiet(runs: list[RunSummary], out: TextIO | None) -> None:
    """Wait until every run judged quiet by its state's TTL was read its
    :attr:`~etcd_rendezvous.cli._runs.Verdict.confirm_quiet` seconds ago, by this
    process's clock: the runs are read again after, and a state written meanwhile keeps
    its run. No etcd member's clock decides that a run is quiet."""
    due = max((s.read_at + s.verdict.confirm_quiet for s in runs if s.finished), default=0.0)
    wait = due - time.monotonic()
    if wait <= 0:
        return
    if out is not None:
        print(
            f"waiting {wait:.0f} s to see the state unchanged for a heartbeat lifetime (its "
            "age is told by etcd members' clocks)",
            file=out,
            flush=True,
        )
    time.sleep(wait)


def _delete_run(
    conn: Transport,
    judged: RunSummary,
    now: RunSummary,
    *,
    force: bool,
    stated_lifetime: float | None,
) -> tuple[list[str], str | None]:
    """Delete the keys of ``judged`` (those the user was shown): the state first, only
    if it is still the one read ``now`` (a compare-and-delete: a state written since is
    kept); then, unless ``force``, only if the run holds no new state and no worker key
    (a job that took the run id the moment its closed state went), the rest, each store
    key only if it is still as listed (a job that took the run id since writes keys of
    the same names). Returns the keys deleted, and why the rest was kept (``None``: it
    was not)."""
    deleted: list[str] = []
    if now.state is not None:
        refused = not conn.compare_and_delete(now.state_key, now.state)
        # Refused, and yet gone: our delete whose answer was lost (and whose history
        # etcd no longer holds), or another operator's. The look below decides.
        if refused and conn.try_get(now.state_key) is not None:
            return deleted, "its state changed while it was being deleted"
        if (now.state_key, False) in judged.keys:
            deleted.append(now.state_key)
    if not force:
        after = read_run(
            conn,
            now.backend,
            now.prefix,
            now.run_id,
            store_keys=False,
            stated_lifetime=stated_lifetime,
        )
        if after is not None and (after.state is not None or after.live):
            if now.state is not None and now.state_key not in deleted:
                deleted.append(now.state_key)  # (judged as part of the run directory)
            return deleted, (
                f"a job took the run id while it was being deleted ({after.status}, "
                f"{after.live} live key(s)): its keys were left"
            )
    for key, recursive in judged.keys:
        if key == now.state_key:
            continue
        listed = judged.listed.get(key)
        if listed is None:
            gone = conn.delete(key, recursive=recursive)
        else:
            # A store key of the same name written since it was listed is a new job's.
            gone = conn.compare_and_delete(key, listed)
        if gone:
            deleted.append(key)
    return deleted, None


def delete_runs(
    args: argparse.Namespace,
    conn: Transport,
    runs: list[RunSummary],
    out: TextIO,
    *,
    force: bool = False,
    stated_lifetime: float | None = None,
) -> int:
    """Delete the keys of ``runs`` after the confirmation ``args`` asks for (none with
    ``--dry-run``); report what was (or would be) deleted; return the exit status.

    After the confirmation (and :func:`_confirm_quiet`) each run is read again (judged
    by ``stated_lifetime``, the operator's ``--heartbeat-lifetime``) and kept (and
    reported as skipped) if it is no longer finished or its state changed since it was
    judged (unless ``force``); its state key is then deleted only if it is still the one
    read last, and the rest only if no state nor worker key appeared since (unless
    ``force``).
    """
    keys = [key for summary in runs for key, _ in summary.keys]
    report: dict[str, Any] = {
        "dry_run": args.dry_run,
        "runs": [summary.as_dict() for summary in runs],
        "deleted": [],
        "skipped": [],
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
        if any(s.backend == "etcd-v2" for s in runs) and not owns_store_keys(args.prefix):
            print(
                "store keys in /torch/elastic/store are left alone under a --prefix other "
                "than the default (the store is shared by all prefixes)",
                file=out,
            )
    if args.dry_run or not runs:
        if not args.json:
            print("dry run: nothing deleted" if runs else "nothing to delete", file=out)
        else:
            print(json.dumps(report, indent=2, sort_keys=True), file=out)
        return 0
    if not confirm(f"Delete {len(keys)} key(s) of {len(runs)} run(s)?", args):
        print("nothing deleted", file=out)
        return 1
    if not force:
        _confirm_quiet(runs, out if not args.json else None)
    deleted: list[str] = []
    deleted_runs = 0
    for judged in runs:
        now = read_run(
            conn,
            judged.backend,
            judged.prefix,
            judged.run_id,
            store_keys=False,
            stated_lifetime=stated_lifetime,
        )
        why = _changed_since(judged, now, force)
        if why is None and now is not None:
            done, why = _delete_run(conn, judged, now, force=force, stated_lifetime=stated_lifetime)
            deleted.extend(done)
        if why is not None:
            report["skipped"].append({"run_id": judged.run_id, "reason": why})
            if not args.json:
                print(f"skipped {judged.backend} run {judged.run_id!r}: {why}", file=out)
            continue
        deleted_runs += 1
    report["deleted"] = deleted
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True), file=out)
    else:
        print(f"deleted {len(deleted)} key(s) of {deleted_runs} run(s)", file=out)
    return 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Delete the run's keys (after asking); return the exit status.

    Raises:
        CliError: the run is unknown, or not finished and ``--force`` is not given.
    """
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            choose_backend(args, conn)
            summary = _summary(args, conn)
            refusal = None if args.force else _refusal(summary, args)
            if refusal is not None:
                raise CliError(refusal)
            return delete_runs(
                args,
                conn,
                [summary],
                out,
                force=args.force,
                stated_lifetime=args.heartbeat_lifetime,
            )
    finally:
        conn.close()
