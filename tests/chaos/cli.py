"""``python -m tests.chaos``: run scenarios from seeds, show them, re-check their records.

``run --seeds 1-20 [--etcd 3.4,3.5,3.5-v3,3.6,3.7] [--family F] [--minutes M]
[--out DIR]`` runs the scenario of each seed (an open range ``100-`` goes on until
``--minutes`` are up), each on the etcd flavor the seed picks among ``--etcd``, prints
one line per scenario and, for each violation, the invariant, what happened and the
one-line command that replays it; the records of each scenario stay in
``DIR/seed-<seed>-<flavor>/``. ``show`` prints the scenarios without running them;
``check DIR`` runs the checker again over a scenario's records.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from chaos import checker
from chaos.records import read_all
from chaos.scenario import FAMILIES, FLAVORS, generate, pick_flavor

__all__ = ["main"]


def _seeds(text: str) -> Iterator[int]:
    for part in text.split(","):
        if part.endswith("-"):
            yield from itertools.count(int(part[:-1]))
        elif "-" in part:
            low, high = part.split("-")
            yield from range(int(low), int(high) + 1)
        else:
            yield int(part)


def _flavors(text: str) -> list[str]:
    flavors = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in flavors if f not in FLAVORS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown etcd flavor(s) {unknown}: expected some of {', '.join(FLAVORS)}"
        )
    return flavors


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "show"):
        p = sub.add_parser(name)
        p.add_argument("--seeds", required=True, help="1-20, 3,7,9 or 100- (open: see --minutes)")
        p.add_argument("--etcd", type=_flavors, default=list(FLAVORS), help="flavors to draw from")
        p.add_argument("--family", choices=sorted(FAMILIES), help="force one family")
    run = sub.choices["run"]
    run.add_argument("--minutes", type=float, help="stop starting scenarios after this long")
    run.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / f"chaos-{os.getpid()}",
        help="where the records go",
    )
    check = sub.add_parser("check")
    check.add_argument("folder", type=Path)
    report = sub.add_parser("report")
    report.add_argument("folder", type=Path, help="a run's --out folder")
    timeline = sub.add_parser("timeline")
    timeline.add_argument("folder", type=Path)
    timeline.add_argument("--nodes", action="store_true", help="every node record too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check":
        return _check(args.folder)
    if args.command == "report":
        return _report(args.folder)
    if args.command == "timeline":
        return _timeline(args.folder, args.nodes)
    if args.command == "show":
        for seed in _seeds(args.seeds):
            scenario = generate(seed, pick_flavor(seed, args.etcd), args.family)
            print(scenario.describe())
            for fault in scenario.faults:
                print(f"    {fault}")
            print(f"    liveness bound {scenario.liveness_bound().explain()}")
        return 0
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from chaos.runner import run_scenario

    # SIGTERM ends the run as Ctrl-C does: the scenario's nodes and etcd are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"records in {args.out}", flush=True)
    results = []
    for seed in _seeds(args.seeds):
        if args.minutes is not None and time.monotonic() - started > args.minutes * 60:
            break
        flavor = pick_flavor(seed, args.etcd)
        scenario = generate(seed, flavor, args.family)
        folder = args.out / f"seed-{seed}-{flavor}"
        verdict = run_scenario(scenario, folder, log=lambda m: print(m, flush=True))
        results.append(verdict.as_dict())
        mark = "ok" if verdict.ok else f"{len(verdict.violations)} VIOLATION(S)"
        live = verdict.liveness.how or verdict.liveness.why or "-"
        print(f"  seed {seed}: {mark} in {verdict.seconds:.0f} s ({live})", flush=True)
        for v in verdict.violations:
            print(f"    [{v.invariant}] at {v.t} s: {v.detail}", flush=True)
        if verdict.violations:
            print(f"    replay: {scenario.replay_command()}", flush=True)
        (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    _summary(results, time.monotonic() - started)
    return 1 if any(r["violations"] for r in results) else 0


def _summary(results: list[dict], seconds: float) -> None:
    faults: Counter[str] = Counter()
    invariants: Counter[str] = Counter()
    for r in results:
        faults.update(r["faults"])
        invariants.update(
            {
                f"{v['invariant']}/{v['what']}" if v.get("what") else v["invariant"]
                for v in r["violations"]
            }
        )
    flavors = Counter(r["flavor"] for r in results)
    print(f"\n{len(results)} scenarios in {seconds / 60:.1f} min; etcd: {dict(flavors)}")
    print(f"faults injected: {dict(sorted(faults.items()))}")
    bad = [r for r in results if r["violations"]]
    print(f"scenarios with violations: {len(bad)}; scenarios by invariant: {dict(invariants)}")
    for r in bad:
        kinds = sorted(
            {
                f"{v['invariant']}/{v['what']}" if v.get("what") else v["invariant"]
                for v in r["violations"]
            }
        )
        print(
            f"  seed {r['seed']} ({r['flavor']}, {r['family']}): {', '.join(kinds)}: {r['replay']}"
        )


def _check(folder: Path) -> int:
    runner, nodes = read_all(folder)
    scenario = next(r["scenario"] for r in runner if r["ev"] == "scenario")
    found = checker.check(scenario, runner, nodes)
    for v in found:
        print(f"[{v.invariant}] at {v.t} s: {v.detail}")
    print(f"{len(found)} violation(s)")
    return 1 if found else 0


def _report(folder: Path) -> int:
    """Check every scenario under ``folder`` again and print the run's summary."""
    results = []
    for sub in sorted(folder.glob("seed-*"), key=lambda p: int(p.name.split("-")[1])):
        if not (sub / "runner.jsonl").exists():
            continue
        runner, nodes = read_all(sub)
        if not any(r["ev"] == "end" for r in runner):
            continue  # cut short
        scenario = next(r["scenario"] for r in runner if r["ev"] == "scenario")
        found = checker.check(scenario, runner, nodes)
        counts: Counter[str] = Counter(r["kind"] for r in runner if r["ev"] in ("fault", "command"))
        if scenario.get("max_request_bytes"):
            counts["request_limit"] += 1
        counts["join"] += sum(1 for n in scenario["nodes"] if n["start"] > 2.0)
        begin = next(r["t"] for r in runner if r["ev"] == "begin")
        end = next(r["t"] for r in runner if r["ev"] == "end")
        results.append(
            {
                "seed": scenario["seed"],
                "flavor": scenario["flavor"],
                "family": scenario["family"],
                "backend": scenario["backend"],
                "replay": (
                    f"python -m tests.chaos run --seeds {scenario['seed']} --etcd "
                    f"{scenario['flavor']} --family {scenario['family']}"
                ),
                "seconds": end - begin,
                "faults": {k: v for k, v in counts.items() if v},
                "violations": [v.as_dict() for v in found],
            }
        )
        kinds = Counter(v.key for v in found)
        print(
            f"seed {scenario['seed']:>4} {scenario['flavor']:<7} {scenario['family']:<9} "
            f"{scenario['backend']:<8} {end - begin:5.0f} s  {dict(kinds) or 'ok'}"
        )
    _summary(results, sum(r["seconds"] for r in results))
    return 1 if any(r["violations"] for r in results) else 0


_QUIET = {"step", "stored", "world"}


def _timeline(folder: Path, everything: bool) -> int:
    """Print what happened in a scenario, in time order (seconds after its start)."""
    runner, nodes = read_all(folder)
    t0 = next(r["t"] for r in runner if r["ev"] == "begin")
    merged = [("runner", r) for r in runner] + [
        (name, r) for name, records in nodes.items() for r in records
    ]
    for who, r in sorted(merged, key=lambda e: e[1]["t"]):
        if r["ev"] in ("scenario",) or (not everything and r["ev"] in _QUIET):
            continue
        fields = {
            k: v
            for k, v in r.items()
            if k not in ("t", "ev", "node", "stdout", "scenario") and v not in (None, "", [], {})
        }
        text = json.dumps(fields, default=str)
        print(f"{r['t'] - t0:8.2f} {who:>6} {r['ev']:<12} {text[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
