"""``etcd-rendezvous close``: close a run's rendezvous as a worker's ``set_closed()`` does.

Its workers stop re-rendezvousing and ``next_rendezvous()`` raises
:class:`~etcd_rendezvous.api.RendezvousClosedError`. A run etcd knows nothing of (a
mistyped run id) is refused; ``--create`` closes it in advance, so that workers started
later under that run id stop at once: its keys are written without a TTL and stay until
deleted (``gc`` keeps such runs unless ``--force``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from datetime import timedelta
from typing import TextIO

from ..dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from ..etcd_rendezvous import EtcdRendezvous, parse_state
from ..etcd_store import EtcdStore
from ..layout import DEFAULT_PREFIX, ETCD_V2_STORE_PREFIX, LegacyLayout
from ._common import (
    CliError,
    CompareFailedError,
    KeyExistsError,
    KeyNotFoundError,
    Transport,
    add_run_options,
    choose_backend,
    etcd_errors,
    open_connection,
    v2_backend,
    v2_state,
)

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "mark a run's rendezvous closed"
DESCRIPTION = (
    "Close a run's rendezvous as a worker's set_closed() does: its workers "
    "stop re-rendezvousing and next_rendezvous() raises RendezvousClosedError. A run "
    "etcd has no key of is refused unless --create is given."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``close`` (the connection options come from a parent)."""
    add_run_options(parser)
    parser.add_argument(
        "--create",
        action="store_true",
        help="close a run etcd has no key of, by creating its closed state without a "
        "TTL (workers started later under this run id stop at once, until the run is "
        "deleted)",
    )


def _unknown_run(args: argparse.Namespace, where: str) -> CliError:
    return CliError(
        f"no run {args.run_id!r} ({where} does not exist): nothing closed; check --run-id, "
        "--prefix and --backend, or pass --create to close it in advance"
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Close the run's rendezvous and say what was done; 0 on success."""
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            choose_backend(args, conn)
            if args.backend == "etcd-v2":
                done = _close_etcd_v2(args, conn)
            else:
                done = _close_etcd(args, conn)
    finally:
        conn.close()
    print(done, file=out)
    return 0


def _close_etcd(args: argparse.Namespace, conn: Transport) -> str:
    """``EtcdRendezvous.set_closed`` on the run; returns what was done, for the user."""
    prefix = args.prefix or DEFAULT_PREFIX
    layout = LegacyLayout(prefix, args.run_id)
    run_dir, key = layout.run_dir, layout.state_key
    had_run_dir = conn.try_get(run_dir) is not None
    before = conn.try_get(key)
    previous = None if before is None else parse_state(before)
    if previous is not None and previous["status"] == "closed":
        return f"run {args.run_id!r} was already closed ({key})"
    if previous is None and not had_run_dir and not args.create:
        raise _unknown_run(args, run_dir)
    if previous is None and not had_run_dir and _create_closed_etcd_run(conn, layout):
        return (
            f"closed run {args.run_id!r}: created a closed state at {key} and {run_dir}, "
            "without a TTL: it stays until deleted"
        )
    # The rendezvous's own set_closed: a compare-and-swap to "closed" that keeps the
    # rest of the state, or a new closed state when there is none.
    rdzv = EtcdRendezvous(
        client=conn,
        prefix=prefix,
        run_id=args.run_id,
        num_min_workers=1,
        num_max_workers=1,
        timeout=max(args.read_timeout, 1.0),
        last_call_timeout=0,
    )
    try:
        rdzv.set_closed()
    finally:
        rdzv.close()
    if previous is None:
        done = f"closed run {args.run_id!r}: created a closed state at {key} (there was none)"
        if not had_run_dir:
            done += f"; {run_dir} did not exist and was created"
        return done
    what = previous["status"]
    if "version" in previous:
        what += f", version {previous['version']}, {len(previous['participants'])} participants"
    return f"closed run {args.run_id!r} (was {what}); its workers stop re-rendezvousing ({key})"


def _create_closed_etcd_run(conn: Transport, layout: LegacyLayout) -> bool:
    """Create the keys of a run closed in advance, as a worker's ``set_closed()`` on a
    new run would, but without the run directory's TTL (which a worker renews only while
    it runs): the run directory, its ``rdzv`` directory and version counter, and the
    state ``{"status": "closed"}``. False if a state appeared meanwhile."""
    conn.mkdir(layout.run_dir)
    conn.mkdir(layout.rdzv_dir)
    with contextlib.suppress(KeyExistsError):
        conn.create(layout.counter_key, "0")  # PyTorch's value: no tag, none needed
    try:
        conn.create(layout.state_key, json.dumps({"status": "closed"}))  # the same from anyone
    except KeyExistsError:
        return False
    return True


def _close_etcd_v2(args: argparse.Namespace, conn: Transport) -> str:
    """``DynamicRendezvousHandler.set_closed`` through the ``etcd-v2`` backend."""
    backend = v2_backend(args, conn)
    before = v2_state(backend)
    if before is not None and before.closed:
        return f"run {args.run_id!r} was already closed (etcd-v2 key {backend.key})"
    if before is None and not args.create:
        raise _unknown_run(args, f"etcd-v2 key {backend.key}")
    handler = DynamicRendezvousHandler.from_backend(
        run_id=args.run_id,
        store=EtcdStore(conn, ETCD_V2_STORE_PREFIX),
        backend=backend,
        min_nodes=1,
        max_nodes=1,
        timeout=RendezvousTimeout(close=timedelta(seconds=max(args.read_timeout, 1.0) * 2)),
    )
    # Never joined, so there is no heartbeat to stop: closing is one fenced write.
    handler.set_closed()
    if before is None:
        # The backend writes every state with a two-hour TTL, renewed by the workers'
        # writes; a state closed in advance has no worker to renew it, so it is written
        # again, the same value, without a TTL (only if no one changed it meanwhile).
        created = conn.try_get(backend.key)
        if created is not None:
            with contextlib.suppress(CompareFailedError, KeyNotFoundError):
                conn.compare_and_swap(backend.key, created.value or "", created, ttl=None)
        return (
            f"closed run {args.run_id!r}: created a closed state at etcd-v2 key "
            f"{backend.key} (there was none), without a TTL: it stays until deleted"
        )
    return (
        f"closed run {args.run_id!r} (was round {before.round}, "
        f"{'complete' if before.complete else 'not complete'}, "
        f"{len(before.participants)} participants); its agents stop re-rendezvousing "
        f"(etcd-v2 key {backend.key})"
    )
