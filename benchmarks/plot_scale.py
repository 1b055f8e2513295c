"""Draw the results of ``bench_scale.py --json`` as the PNGs ``docs/scale.rst`` shows.

Usage::

    pip install -e ".[bench]"        # matplotlib
    python benchmarks/bench_scale.py --breakdown --json benchmarks/results/scale-first.json
    python benchmarks/bench_scale.py --rerendezvous --breakdown \\
        --json benchmarks/results/scale-rerendezvous.json
    python benchmarks/plot_scale.py  # writes docs/_static/scale-*.png
    python benchmarks/sim_scale.py --json benchmarks/results/sim-scale.json
    python benchmarks/plot_scale.py --sim benchmarks/results/sim-scale.json
                                     # writes docs/_static/sim-scale.png

For each results file (default: the ``scale-*.json`` of ``benchmarks/results/``) one
figure of panels against the number of nodes: the seconds the rendezvous took, the etcd
requests per node (writes and reads), and, where the rows have them, the kB per node the
clients received and the client CPU milliseconds per node. The PNG is named after the
results file (``scale-first.json`` gives ``scale-first.png``). One line per backend, API
and implementation; a row that timed out is left out of its line and marked in the
legend.

``--sim FILE`` draws the rows of ``benchmarks/sim_scale.py --json`` instead: kB received
per node, requests per node, and kB received per node in units of the state's size,
against N, one line per backend, API and protocol (``now`` dashed, ``progress`` solid).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # after choosing the backend

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "docs" / "_static"
TITLES = {
    "first": "First rendezvous",
    "rerendezvous": "Re-rendezvous (one node replaced)",
    "heartbeats": "etcd-v2 heartbeats",
}


def _series(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows by ``backend api impl``, in node order."""
    series: dict[str, list[dict[str, Any]]] = {}
    for entry in sorted(rows, key=lambda r: r["nodes"]):
        name = f"{entry['backend']} {entry['api']} {entry['impl']}"
        series.setdefault(name, []).append(entry)
    return series


def plot(results: Path, out_dir: Path) -> Path:
    """Draw one results file; return the PNG's path."""
    document = json.loads(results.read_text())
    rows = document["rows"]
    mode = rows[0]["mode"]
    with_bytes = any("kb_received" in row for row in rows)
    panels = 4 if with_bytes else 2
    figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    seconds_ax, requests_ax = axes[0], axes[1]
    for name, entries in _series(rows).items():
        done = [e for e in entries if "problem" not in e]
        failed = [e["nodes"] for e in entries if "problem" in e]
        label = name + (f" (timeout at N={', '.join(map(str, failed))})" if failed else "")
        style = "--" if "torch" in name else "-"
        nodes = [e["nodes"] for e in done]
        seconds_ax.plot(nodes, [e["seconds"] for e in done], style, marker="o", label=label)
        requests_ax.plot(
            nodes, [e["writes"] + e["reads"] for e in done], style, marker="o", label=label
        )
        if with_bytes:
            measured = [e for e in done if "kb_received" in e]
            for ax, field in ((axes[2], "kb_received"), (axes[3], "cpu_ms")):
                ax.plot(
                    [e["nodes"] for e in measured],
                    [e[field] for e in measured],
                    style,
                    marker="o",
                    label=label,
                )
    if with_bytes:
        axes[2].set_ylabel("kB received per node (client)")
        axes[3].set_ylabel("client CPU ms per node")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes (N)")
        ax.set_xticks(sorted({r["nodes"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    seconds_ax.set_ylabel("seconds to the last rank")
    requests_ax.set_ylabel("etcd requests per node (writes + reads)")
    requests_ax.legend(fontsize=7, loc="upper left")
    figure.suptitle(
        f"{TITLES.get(mode, mode)}: etcd {document.get('etcd', '?')}, "
        f"{document.get('cpus', '?')} CPUs (PyTorch 2.13 dashed)"
    )
    figure.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{results.stem}.png"
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def plot_sim(results: Path, out_dir: Path) -> Path:
    """Draw the rows of ``sim_scale.py --json``; return the PNG's path."""
    document = json.loads(results.read_text())
    rows = [row for row in document["rows"] if not row.get("unfinished")]
    series: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: r["nodes"]):
        name = f"{row['backend']} {row['api']} {row['protocol']}"
        series.setdefault(name, []).append(row)
    figure, axes = plt.subplots(1, 3, figsize=(16.5, 4.6))
    panels = (
        ("kB received per node", lambda r: r["kb_received"]),
        ("etcd requests per node", lambda r: r["requests"]),
        (
            "bytes received per node / final state size",
            lambda r: r["kb_received"] * 1000 / r["state_bytes"],
        ),
    )
    for name, entries in series.items():
        style = "--" if name.endswith(" now") else "-"
        nodes = [e["nodes"] for e in entries]
        for ax, (_, value) in zip(axes, panels, strict=True):
            ax.plot(nodes, [value(e) for e in entries], style, marker="o", label=name)
    for ax, (label, _) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("nodes (N)")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["nodes"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].set_ylim(bottom=0)
    axes[0].legend(fontsize=7, loc="upper left")
    model = document.get("model", {})
    figure.suptitle(
        "Simulated first rendezvous (benchmarks/sim_scale.py): today's protocol dashed, "
        f"the progress hint solid; arrivals over {model.get('window_per_node', '?')} s x N, "
        f"etcd sending {model.get('server_rate', 0) / 1e9:g} GB/s"
    )
    figure.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "sim-scale.png"
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def main() -> None:
    """Draw every results file given (default: those of ``benchmarks/results``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path, help="bench_scale.py --json files")
    parser.add_argument("--out", type=Path, default=OUT, help="directory of the PNGs")
    parser.add_argument("--sim", type=Path, help="draw this sim_scale.py --json file instead")
    args = parser.parse_args()
    if args.sim is not None:
        print(plot_sim(args.sim, args.out))
        return
    files = args.results or sorted(RESULTS.glob("scale-*.json"))
    for results in files:
        print(plot(results, args.out))


if __name__ == "__main__":
    main()
