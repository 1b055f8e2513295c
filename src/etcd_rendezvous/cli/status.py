"""``etcd-rendezvous status``: show a run's rendezvous state, without changing it.

For the ``etcd`` backend: the status (setup/joinable/frozen/final/closed), version,
participants, which keep-alives are live or lapsed (with the rank of each: PyTorch's
keys name it, ours are looked up in the state's ``members``), the member keys our workers
announced and which were admitted, workers waiting, the version counter and the run
directory's TTL. For ``etcd-v2``: the round, participants, wait and
redundancy lists and last heartbeats. As text, or as one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TextIO

from ..api import RendezvousStateError
from ..dynamic_rendezvous import NodeDesc, RendezvousState
from ..etcd_rendezvous import member_ranks, parse_state
from ..layout import DEFAULT_PREFIX, LegacyLayout, keep_alive_rank, member_name, normalize_key
from ._common import (
    CliError,
    Node,
    Transport,
    add_run_options,
    etcd_errors,
    open_connection,
    read_dir,
    v2_backend,
    v2_state,
    with_ttl,
)

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "show the rendezvous state of a run"
DESCRIPTION = (
    "Show a run's rendezvous: for the etcd backend its status "
    "(setup/joinable/frozen/final/closed), version, participants, which keep-alives "
    "are live or lapsed, the member keys announced and admitted, workers waiting, the "
    "version counter and the run dir's TTL; "
    "for etcd-v2 its round, participants, wait and redundancy lists and last "
    "heartbeats. Reads only. Exits 1 if the run is unknown or its state is corrupt."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``status`` (the connection options come from a parent)."""
    add_run_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Print the run's status report and return 0.

    Raises:
        CliError: the run is unknown, or its state is corrupt (then after the report).
    """
    conn = open_connection(args)
    try:
        with etcd_errors(args.endpoint):
            if args.backend == "etcd-v2":
                report = _status_etcd_v2(args, conn)
                lines = _format_etcd_v2_status(report)
            else:
                report = _status_etcd(args, conn)
                lines = _format_etcd_status(report)
    finally:
        conn.close()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True), file=out)
    else:
        print("\n".join(lines), file=out)
    if not report["valid"]:
        # The report is out; the error line says what is wrong and names the key.
        raise CliError(report["error"])
    return 0


# -- the etcd backend ----------------------------------------------------------------------


@dataclass(frozen=True)
class _EtcdRun:
    """The etcd nodes ``status`` reads for a run of the ``etcd`` backend (each ``None``
    when missing)."""

    run_id: str
    prefix: str
    run_dir: Node | None
    state: Node | None
    version_counter: Node | None
    #: ``rdzv/v_<version>`` of the version the state names: its ``rank_<r>`` and
    #: ``node_<hex>`` children are the keep-alive keys that have not lapsed.
    version_dir: Node | None


def _named_version(state: Node | None) -> str | None:
    """The version a state node names, if it decodes far enough to tell."""
    if state is None or state.value is None:
        return None
    try:
        decoded = json.loads(state.value)
    except ValueError:
        return None
    version = decoded.get("version") if isinstance(decoded, dict) else None
    if isinstance(version, str) and version and "/" not in version:
        return version
    return None


def _read_etcd_run(conn: Transport, prefix: str, run_id: str) -> _EtcdRun:
    """Read, without changing anything, what describes the run in etcd."""
    layout = LegacyLayout(prefix, run_id)
    run_dir = with_ttl(conn, conn.try_get(layout.run_dir))
    state = conn.try_get(layout.state_key)
    # On v3 a key written below the run dir without a TTL shares the run dir's lease:
    # it lives as long as the run dir, as on v2, and has no TTL of its own to show.
    shares_run_dir_lease = (
        state is not None
        and run_dir is not None
        and state.lease != 0
        and state.lease == run_dir.lease
    )
    if not shares_run_dir_lease:
        state = with_ttl(conn, state)
    version = _named_version(state)
    return _EtcdRun(
        run_id=run_id,
        prefix=prefix,
        run_dir=run_dir,
        state=state,
        version_counter=conn.try_get(layout.counter_key),
        version_dir=None if version is None else read_dir(conn, layout.version_dir(version)),
    )


def _describe_etcd_run(run: _EtcdRun) -> dict[str, Any]:
    """The ``status`` report of an ``etcd`` run, as a JSON-serialisable dict.

    Raises:
        CliError: the run is unknown (neither its directory nor its state exists).
    """
    layout = LegacyLayout(run.prefix, run.run_id)
    run_dir, key = layout.run_dir, layout.state_key
    if run.run_dir is None and run.state is None:
        raise CliError(
            f"no run {run.run_id!r} under prefix {run.prefix!r}: neither {run_dir} nor {key} "
            "exists in etcd (check --run-id, --prefix and --backend)"
        )
    report: dict[str, Any] = {
        "backend": "etcd",
        "run_id": run.run_id,
        "prefix": run.prefix,
        "key": key,
        "run_dir": run_dir,
        "run_dir_ttl": None if run.run_dir is None else run.run_dir.ttl,
        "version_counter": None if run.version_counter is None else run.version_counter.value,
        "valid": True,
        "status": None,
        "version": None,
        "participants": [],
        "keep_alives": [],
        "members": [],
        "num_workers_waiting": None,
        "state_ttl": None,
    }
    if run.state is None:
        return report
    report["state_ttl"] = run.state.ttl
    try:
        state = parse_state(run.state)
    except RendezvousStateError as exc:
        report.update(valid=False, error=str(exc), raw=run.state.value)
        return report
    report["status"] = state["status"]
    report["version"] = state.get("version")
    report["participants"] = list(state.get("participants", []))
    report["num_workers_waiting"] = state.get("num_workers_waiting")
    children = () if run.version_dir is None else run.version_dir.children
    report["keep_alives"], report["members"] = _keep_alives_and_members(state, children)
    return report


def _keep_alives_and_members(
    state: dict[str, Any], children: tuple[Node, ...]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The report's ``keep_alives`` (those the state lists, by rank, live if among
    ``children``, the version directory's) and ``members`` (the member keys among
    ``children``, oldest first, with their rank if admitted)."""
    live = {normalize_key(child.key): child for child in children}
    ranks = member_ranks(state)

    def rank_of(key: str) -> int | None:
        name = member_name(key)
        return keep_alive_rank(key) if name is None else ranks.get(name)

    keep_alives = []
    for key in sorted(state.get("keep_alives", []), key=lambda k: (rank_of(k) or 0, k)):
        child = live.get(normalize_key(key))
        entry = {"key": key, "rank": rank_of(key), "live": child is not None}
        keep_alives.append({**entry, "ttl": None if child is None else child.ttl})
    announced = sorted((c for c in children if member_name(c.key)), key=lambda c: c.created_index)
    members = [{"key": c.key, "rank": rank_of(c.key), "ttl": c.ttl} for c in announced]
    return keep_alives, members


def _format_etcd_status(report: dict[str, Any]) -> list[str]:
    """The text form of :func:`_describe_etcd_run`'s report."""
    lines = [f"run:              {report['run_id']} (prefix {report['prefix']})"]
    lines.append(f"state key:        {report['key']}")
    status = report["status"]
    if not report["valid"]:
        lines.append("status:           INVALID (the state is not a valid rendezvous state)")
        lines.append(f"raw value:        {report['raw']!r}")
    elif status is None:
        lines.append(
            "status:           none (no rendezvous state: none started yet, or the last "
            "version was just discarded)"
        )
    else:
        ttl = report["state_ttl"]
        lines.append(
            f"status:           {status}" + ("" if ttl is None else f" (expires in {ttl} s)")
        )
    if report["version"] is not None:
        participants = report["participants"]
        lines.append(f"version:          {report['version']}")
        lines.append(
            f"participants:     {len(participants)}"
            + (f" (ranks {', '.join(map(str, participants))})" if participants else "")
        )
    keep_alives = report["keep_alives"]
    if keep_alives:
        lines.append("keep-alives:")
        for entry in keep_alives:
            rank = "?" if entry["rank"] is None else entry["rank"]
            state = (
                f"live (expires in {entry['ttl']} s)"
                if entry["live"]
                else "LAPSED (the worker is gone)"
            )
            lines.append(f"  rank {rank}: {state:<30} {entry['key']}")
    elif status == "frozen":
        lines.append("keep-alives:      none yet (participants are confirming)")
    members = report["members"]
    if members:
        admitted = sum(1 for entry in members if entry["rank"] is not None)
        lines.append(f"member keys:      {len(members)} announced, {admitted} admitted")
    if report["num_workers_waiting"] is not None:
        lines.append(f"workers waiting:  {report['num_workers_waiting']}")
    lines.append(f"version counter:  {report['version_counter'] or '(none)'}")
    ttl = report["run_dir_ttl"]
    if ttl is not None:
        lines.append(f"run dir TTL:      {ttl} s ({report['run_dir']})")
    else:
        lines.append(f"run dir TTL:      none: delete {report['run_dir']} once the job is over")
    if any(not entry["live"] for entry in keep_alives) and status == "final":
        lines.append(
            f"note: a member's keep-alive lapsed; the next worker to arrive discards version "
            f"{report['version']} and starts a new rendezvous"
        )
    return lines


def _status_etcd(args: argparse.Namespace, conn: Transport) -> dict[str, Any]:
    prefix = args.prefix or DEFAULT_PREFIX
    return _describe_etcd_run(_read_etcd_run(conn, prefix, args.run_id))


# -- the etcd-v2 backend ----------------------------------------------------------------------


def _node_name(node: NodeDesc) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


def _describe_v2_state(
    run_id: str, key: str, node: Node | None, state: RendezvousState, now: datetime
) -> dict[str, Any]:
    """The ``status`` report of an ``etcd-v2`` run, as a JSON-serialisable dict."""
    if state.closed:
        status = "closed"
    elif state.complete:
        status = "complete"
    elif state.participants:
        status = "joining"
    else:
        status = "empty"
    participants = sorted(state.participants.items(), key=lambda item: item[1])
    heartbeats = sorted(state.last_heartbeats.items(), key=lambda item: item[1], reverse=True)
    return {
        "backend": "etcd-v2",
        "run_id": run_id,
        "key": key,
        "key_ttl": None if node is None else node.ttl,
        "valid": True,
        "status": status,
        "version": state.round,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "deadline": None if state.deadline is None else state.deadline.isoformat(),
        "deadline_in": (
            None if state.deadline is None else round((state.deadline - now).total_seconds(), 1)
        ),
        "participants": {_node_name(n): rank for n, rank in participants},
        "wait_list": sorted(_node_name(n) for n in state.wait_list),
        "redundancy_list": sorted(_node_name(n) for n in state.redundancy_list),
        "last_heartbeats": {
            _node_name(n): {
                "time": beat.isoformat(),
                "age": round((now - beat).total_seconds(), 1),
            }
            for n, beat in heartbeats
        },
    }


def _status_etcd_v2(args: argparse.Namespace, conn: Transport) -> dict[str, Any]:
    backend = v2_backend(args, conn)
    node = with_ttl(conn, conn.try_get(backend.key))
    if node is None:
        raise CliError(
            f"no run {args.run_id!r} with --backend etcd-v2: etcd key {backend.key} does not "
            "exist (check --run-id, --prefix and --backend)"
        )
    try:
        state = v2_state(backend)
    except RendezvousStateError as exc:
        return {
            "backend": "etcd-v2",
            "run_id": args.run_id,
            "key": backend.key,
            "key_ttl": node.ttl,
            "valid": False,
            "error": str(exc),
            "raw": node.value,
            "status": None,
            "version": None,
            "participants": {},
        }
    if state is None:  # deleted between the two reads
        raise CliError(f"no run {args.run_id!r}: etcd key {backend.key} was just deleted")
    return _describe_v2_state(args.run_id, backend.key, node, state, datetime.now(timezone.utc))


def _format_etcd_v2_status(report: dict[str, Any]) -> list[str]:
    """The text form of an ``etcd-v2`` status report."""
    lines = [f"run:              {report['run_id']} (backend etcd-v2)"]
    lines.append(f"state key:        {report['key']}")
    if not report["valid"]:
        lines.append("status:           INVALID (the key does not hold a rendezvous state)")
        lines.append(f"raw value:        {report['raw']!r}")
        return lines
    lines.append(f"status:           {report['status']}")
    lines.append(f"round:            {report['round']}")
    lines.append(f"complete:         {'yes' if report['complete'] else 'no'}")
    lines.append(f"closed:           {'yes' if report['closed'] else 'no'}")
    if report["deadline"] is None:
        lines.append("deadline:         none")
    else:
        lines.append(f"deadline:         {report['deadline']} (in {report['deadline_in']:g} s)")
    participants = report["participants"]
    lines.append(f"participants:     {len(participants)}")
    lines.extend(f"  rank {rank}: {name}" for name, rank in participants.items())
    for title, names in (
        ("wait list", report["wait_list"]),
        ("redundancy", report["redundancy_list"]),
    ):
        lines.append(f"{title + ':':<17} {len(names)}")
        lines.extend(f"  {name}" for name in names)
    lines.append("last heartbeats:")
    if not report["last_heartbeats"]:
        lines.append("  none")
    for name, beat in report["last_heartbeats"].items():
        lines.append(f"  {name}: {beat['age']:g} s ago ({beat['time']})")
    ttl = report["key_ttl"]
    lines.append(f"key TTL:          {'none' if ttl is None else f'{ttl} s'}")
    return lines
