"""``etcd-rendezvous status``: show a run's rendezvous state, without changing it.

By default a summary that stays short at hundreds of nodes: the phase, the counts, and
who is missing. For the ``etcd`` backend: the status (setup/joinable/frozen/final/
closed), version, participants, the keep-alives that lapsed (rank and key), the member
keys our workers announced and how many were admitted, workers waiting, the version
counter and the run directory's TTL. For ``etcd-v2``: the round, participants, wait and
redundancy lists, the heartbeats (and who lags behind the newest by more than the
heartbeat lifetime) and our nodes' node keys (and those marked as leaving). Both say
whether the run is finished and why (see :mod:`etcd_rendezvous.cli._runs`). ``-v`` lists
every member, ``--watch`` shows the run again at each change (at least every
``--interval`` seconds), ``--json`` prints one JSON object (one per refresh with
``--watch``).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from typing import Any, TextIO

from ..api import Deadline, RendezvousStateError
from ..dynamic_rendezvous import NodeDesc, RendezvousState
from ..etcd_rendezvous import member_ranks, parse_state
from ..etcd_rendezvous_backend import EtcdRendezvousBackend
from ..layout import DEFAULT_PREFIX, LegacyLayout, keep_alive_rank, member_name, normalize_key
from ._common import (
    CliError,
    Node,
    Transport,
    add_lifetime_option,
    add_run_options,
    choose_backend,
    etcd_errors,
    non_negative_seconds,
    open_connection,
    v2_backend,
    v2_state,
    with_ttl,
)
from ._runs import (
    EtcdRun,
    RunSummary,
    etcd_v2_status,
    node_keys_report,
    read_etcd_run,
    read_run,
    summarize_etcd,
)

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "describe_etcd_run", "etcd_v2_report", "run"]

HELP = "show the rendezvous state of a run"
DESCRIPTION = (
    "Show a run's rendezvous as a summary: for the etcd backend its status "
    "(setup/joinable/frozen/final/closed), version, participants, the keep-alives that "
    "lapsed, the member keys announced and admitted, workers waiting, the version counter "
    "and the run dir's TTL; for etcd-v2 its round, participants, wait and redundancy "
    "lists, heartbeats and node keys; for both, whether the run is finished and why. -v "
    "lists every member; --watch follows the run live. Reads only. Exits 1 if the run is "
    "unknown or its state is corrupt."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``status`` (the connection options come from a parent)."""
    add_run_options(parser)
    add_lifetime_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="list every member, not only the missing"
    )
    parser.add_argument(
        "--watch",
        action="store_true",
        help="show the run again at each change (Ctrl-C stops)",
    )
    parser.add_argument(
        "--interval",
        type=non_negative_seconds,
        default=2.0,
        metavar="S",
        help="with --watch: refresh at least every S seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--count",
        type=int,
        metavar="N",
        help="with --watch: stop after N reports (default: until interrupted)",
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Print the run's status report (again at each change with ``--watch``); return 0.

    Raises:
        CliError: the run is unknown, or its state is corrupt (then after the report).
    """
    conn = open_connection(args)
    shown = 0
    try:
        with etcd_errors(args.endpoint):
            choose_backend(args, conn)
        while True:
            with etcd_errors(args.endpoint):
                report = _report(args, conn)
            if args.json:
                indent = None if args.watch else 2  # one line per report when following
                print(json.dumps(report, indent=indent, sort_keys=True), file=out)
            else:
                if args.watch:
                    print(f"--- {datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}", file=out)
                print("\n".join(_format(report, verbose=args.verbose)), file=out)
            out.flush()
            shown += 1
            if not report["valid"]:
                # The report is out; the error line says what is wrong and names the key.
                raise CliError(report["error"])
            if not args.watch or (args.count is not None and shown >= args.count):
                return 0
            with etcd_errors(args.endpoint):
                _wait_for_change(args, conn, report)
    finally:
        conn.close()


def _report(args: argparse.Namespace, conn: Transport) -> dict[str, Any]:
    if args.backend == "etcd-v2":
        return _status_etcd_v2(args, conn)
    return _status_etcd(args, conn)


def _format(report: dict[str, Any], *, verbose: bool) -> list[str]:
    if report["backend"] == "etcd-v2":
        return _format_etcd_v2_status(report, verbose=verbose)
    return _format_etcd_status(report, verbose=verbose)


def _wait_for_change(args: argparse.Namespace, conn: Transport, report: dict[str, Any]) -> None:
    """Wait until something of the run changes, or ``--interval`` seconds pass (a watch
    on the run's directory or state key from the last index read)."""
    key = report["run_dir"] if report["backend"] == "etcd" else report["key"]
    started = time.monotonic()
    conn.watch(key, conn.last_index + 1, Deadline(args.interval), recursive=True)
    # A burst of changes (a rendezvous forming) is shown at most once a second.
    pause = min(1.0, args.interval) - (time.monotonic() - started)
    if pause > 0:
        time.sleep(pause)


# -- the etcd backend ----------------------------------------------------------------------


def describe_etcd_run(run: EtcdRun) -> dict[str, Any]:
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
    members = [
        {"key": c.key, "rank": rank_of(c.key), "ttl": c.ttl, **_member_host(c.value)}
        for c in announced
    ]
    return keep_alives, members


def _member_host(value: str | None) -> dict[str, Any]:
    """The ``host`` and ``pid`` a member key of ours holds (``None`` each if it holds
    nothing readable: a key written by an older version)."""
    try:
        fields = json.loads(value or "")
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        fields = {}
    host, pid = fields.get("host"), fields.get("pid")
    return {
        "host": host if isinstance(host, str) else None,
        "pid": pid if type(pid) is int else None,
    }


def _format_etcd_status(report: dict[str, Any], *, verbose: bool) -> list[str]:
    """The text form of :func:`describe_etcd_run`'s report."""
    lines = [
        f"run:              {report['run_id']} (backend etcd, prefix {report['prefix']}, "
        f"API {report['api']})"
    ]
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
    lapsed = [entry for entry in keep_alives if not entry["live"]]
    if keep_alives:
        lines.append(
            f"keep-alives:      {len(keep_alives) - len(lapsed)} live, {len(lapsed)} LAPSED"
        )
        for entry in keep_alives if verbose else lapsed:
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
        for entry in members if verbose else ():
            rank = "-" if entry["rank"] is None else entry["rank"]
            where = "?" if entry["host"] is None else f"{entry['host']} pid {entry['pid']}"
            ttl = "" if entry["ttl"] is None else f" (expires in {entry['ttl']} s)"
            lines.append(f"  rank {rank}: {where}{ttl}  {member_name(entry['key'])}")
    if report["num_workers_waiting"] is not None:
        lines.append(f"workers waiting:  {report['num_workers_waiting']}")
    lines.append(f"version counter:  {report['version_counter'] or '(none)'}")
    ttl = report["run_dir_ttl"]
    if ttl is not None:
        lines.append(f"run dir TTL:      {ttl} s ({report['run_dir']})")
    else:
        lines.append(f"run dir TTL:      none: delete {report['run_dir']} once the job is over")
    if report["valid"]:
        lines.extend(_format_verdict(report))
    if lapsed and status == "final":
        lines.append(
            f"note: a member's keep-alive lapsed; the next worker to arrive discards version "
            f"{report['version']} and starts a new rendezvous"
        )
    return lines


def _status_etcd(args: argparse.Namespace, conn: Transport) -> dict[str, Any]:
    prefix = args.prefix or DEFAULT_PREFIX
    # Each member's TTL is shown with -v and in --json only (on v3 a request per member).
    run = read_etcd_run(conn, prefix, args.run_id, member_ttls=args.verbose or args.json)
    report = describe_etcd_run(run)
    report["api"] = conn.api
    report.update(_verdict(summarize_etcd(run, conn.api)))
    return report


def _verdict(summary: RunSummary) -> dict[str, Any]:
    """The report's fields of whether the run is finished (as ``list --json`` has them)."""
    fields = summary.as_dict()
    names = ("finished", "quiet", "reason", "idle_seconds", "heartbeat_lifetime", "live")
    return {name: fields[name] for name in names}


def _format_verdict(report: dict[str, Any]) -> list[str]:
    """The text lines of :func:`_verdict`'s fields."""
    idle = report["idle_seconds"]
    lines = [f"finished:         {'yes' if report['finished'] else 'no'} ({report['reason']})"]
    if idle is not None and not report["live"]:
        lines.append(f"idle:             {idle:g} s at least, by etcd's clock")
    return lines


# -- the etcd-v2 backend ----------------------------------------------------------------------


def _node_name(node: NodeDesc) -> str:
    return f"{node.addr}_{node.pid}_{node.local_id}"


def _age(now: datetime, beat: datetime) -> float:
    """Seconds since ``beat`` by etcd's clock as ``now`` estimates it (to within a
    second): a heartbeat less than a second ahead of ``now`` is ``0``; one further
    ahead was written by a clock that is (a PyTorch node's host), and shows negative."""
    age = round((now - beat).total_seconds(), 1)
    return 0.0 if -1.0 < age < 0.0 else age


def _describe_v2_state(
    run_id: str,
    key: str,
    node: Node | None,
    state: RendezvousState,
    now: datetime,
    lifetime: float,
) -> dict[str, Any]:
    """The ``status`` report of an ``etcd-v2`` run, as a JSON-serialisable dict (the
    heartbeats' ages by this machine's clock, ``now``; who is missing by the nodes'
    clocks alone, against ``lifetime``)."""
    participants = sorted(state.participants.items(), key=lambda item: item[1])
    heartbeats = sorted(state.last_heartbeats.items(), key=lambda item: item[1], reverse=True)
    newest = heartbeats[0][1] if heartbeats else None
    return {
        "backend": "etcd-v2",
        "run_id": run_id,
        "key": key,
        "key_ttl": None if node is None else node.ttl,
        "valid": True,
        "status": etcd_v2_status(state),
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
                "age": _age(now, beat),
            }
            for n, beat in heartbeats
        },
        # Participants without a heartbeat, or one more than the heartbeat lifetime
        # behind the newest: as a node writing the state judges them (the nodes' clocks
        # against each other, never against this machine's).
        "missing": sorted(
            _node_name(n)
            for n, _ in participants
            if newest is None
            or n not in state.last_heartbeats
            or (newest - state.last_heartbeats[n]).total_seconds() > lifetime
        ),
    }


def _status_etcd_v2(args: argparse.Namespace, conn: Transport) -> dict[str, Any]:
    backend = v2_backend(args, conn)
    summary = read_run(
        conn,
        "etcd-v2",
        args.prefix,
        args.run_id,
        store_keys=False,
        stated_lifetime=args.heartbeat_lifetime,
    )
    report = None if summary is None else etcd_v2_report(conn, backend, summary)
    if report is None:
        raise CliError(
            f"no run {args.run_id!r} with --backend etcd-v2: etcd key {backend.key} does not "
            "exist (check --run-id, --prefix and --backend)"
        )
    return report


def etcd_v2_report(
    conn: Transport, backend: EtcdRendezvousBackend, summary: RunSummary
) -> dict[str, Any] | None:
    """The ``status`` report of the ``etcd-v2`` run of ``backend``, whose
    :class:`RunSummary` is ``summary`` (:func:`read_run`), as a JSON-serialisable dict
    (``valid`` false for a state that does not decode); ``None`` if its state key does
    not exist. Heartbeat ages are by etcd's clock."""
    node = with_ttl(conn, conn.try_get(backend.key))
    if node is None:
        return None
    try:
        state = v2_state(backend)
    except RendezvousStateError as exc:
        return {
            "backend": "etcd-v2",
            "run_id": backend.nodes_layout.run_id,
            "key": backend.key,
            "key_ttl": node.ttl,
            "valid": False,
            "error": str(exc),
            "raw": node.value,
            "status": None,
            "version": None,
            "participants": {},
            "api": conn.api,
        }
    if state is None:  # deleted between the two reads
        return None
    if summary.lifetime is None:  # deleted since the summary was read
        return None
    report = _describe_v2_state(
        summary.run_id, backend.key, node, state, conn.clock.now(), summary.lifetime.seconds
    )
    report.update(_verdict(summary))
    report["api"] = conn.api
    report["nodes_dir"] = backend.nodes_layout.nodes_dir
    report["node_keys"] = node_keys_report(backend)
    return report


def _format_etcd_v2_status(report: dict[str, Any], *, verbose: bool) -> list[str]:
    """The text form of an ``etcd-v2`` status report (every member with ``verbose``)."""
    lines = [f"run:              {report['run_id']} (backend etcd-v2, API {report['api']})"]
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
    if verbose:
        lines.extend(f"  rank {rank}: {name}" for name, rank in participants.items())
    for title, names in (
        ("wait list", report["wait_list"]),
        ("redundancy", report["redundancy_list"]),
    ):
        lines.append(f"{title + ':':<17} {len(names)}")
        lines.extend(f"  {name}" for name in (names if verbose else ()))
    beats = report["last_heartbeats"]
    ages = [beat["age"] for beat in beats.values()]
    if ages:
        lines.append(
            f"heartbeats:       {len(ages)}, newest {min(ages):g} s ago, oldest {max(ages):g} s ago"
        )
    else:
        lines.append("heartbeats:       none")
    missing = report["missing"]
    lifetime = report["heartbeat_lifetime"]
    if missing:
        lines.append(
            f"missing:          {len(missing)} participant(s) whose heartbeat is more than "
            f"{lifetime['seconds']:g} s behind the newest"
        )
        lines.extend(f"  {name}" for name in missing)
    if verbose:
        lines.append("last heartbeats:")
        lines.extend(
            f"  {name}: {beat['age']:g} s ago ({beat['time']})" for name, beat in beats.items()
        )
    node_keys = report["node_keys"]
    leaving = [entry for entry in node_keys if entry["leaving"] is not None]
    lines.append(
        f"node keys:        {len(node_keys)} in {report['nodes_dir']}"
        + (f", {len(leaving)} marked as leaving" if leaving else "")
    )
    for entry in node_keys if verbose else leaving:
        mark = "" if entry["leaving"] is None else f"  leaving after round {entry['leaving']}"
        lines.append(f"  {entry['node']}{mark}")
    ttl = report["key_ttl"]
    lines.append(f"key TTL:          {'none' if ttl is None else f'{ttl} s'}")
    lines.append(
        f"lifetime:         {lifetime['seconds']:g} s (heartbeat lifetime, {lifetime['source']})"
    )
    lines.extend(_format_verdict(report))
    return lines
