"""The fault harness's bounded pass: a fixed list of scenarios, each checked against
every invariant (``docs/testing.rst``, "The fault harness").

Marked ``chaos``: selected only by ``pytest -m chaos tests/chaos`` (see
``tests/chaos/conftest.py``). A scenario whose etcd binary is missing here is skipped
(an error where ``ETCD_RENDEZVOUS_REQUIRE_ETCD`` is set, as in CI).
A failure lists the violations and the one-line command that replays the scenario.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chaos.runner import run_scenario
from chaos.scenario import FLAVORS, generate
from support.tools import missing_tool

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

#: (seed, etcd flavor, family): every flavor and family, both backends, one and three
#: members, PyTorch's nodes and torchrun's agents. Three are the known bugs' seeds, kept
#: as their regression tests: 5-3.5-ops (``gc`` deletes a live ``etcd`` run between two
#: versions), 2-3.5-v3-limit (a state over etcd's request limit hangs the nodes that wait
#: for a batch), 200-3.5-v3-clock (a node with a slow clock writes everyone's heartbeats
#: and the others drop them). The list names the scenarios; their choices live in the
#: generator.
CI_SCENARIOS = [
    (22, "3.4", "mixed"),
    (1, "3.5", "torchrun"),
    (5, "3.5", "ops"),
    (2, "3.5-v3", "limit"),
    (200, "3.5-v3", "clock"),
    (6, "3.6", "etcd"),
    (19, "3.6", "store"),
    (66, "3.6", "network"),
    (36, "3.7", "nodes"),
]


def _binary_missing(flavor: str) -> str | None:
    binary = FLAVORS[flavor].binary
    if binary is None:
        return None if shutil.which("etcd") else "no etcd on PATH"
    if binary.startswith("build:"):
        try:
            FLAVORS[flavor].resolve_binary()
        except Exception as exc:  # no Go, no network for the modules
            return f"etcd {binary[6:]} cannot be built here: {exc}"
        return None
    return None if os.access(binary, os.X_OK) else f"{binary} is missing"


@pytest.mark.parametrize(
    ("seed", "flavor", "family"), CI_SCENARIOS, ids=[f"{s}-{f}-{k}" for s, f, k in CI_SCENARIOS]
)
def test_scenario_keeps_every_invariant(seed: int, flavor: str, family: str, tmp_path: Path):
    missing = _binary_missing(flavor)
    if missing:
        missing_tool(missing)
    scenario = generate(seed, flavor, family)
    verdict = run_scenario(scenario, tmp_path / "records", log=lambda _: None)
    assert verdict.ok, (
        f"{scenario.describe()}\n"
        + "\n".join(f"[{v.invariant}] at {v.t} s: {v.detail}" for v in verdict.violations)
        + f"\nreplay: {scenario.replay_command()}\nrecords: {verdict.out}"
    )
