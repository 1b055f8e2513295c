"""The fault harness's bounded pass: a fixed list of scenarios, each checked against
every invariant (``docs/testing.rst``, "The fault harness").

Marked ``chaos``: selected only by ``pytest -m chaos tests/chaos`` (see
``tests/chaos/conftest.py``). A scenario whose etcd binary is missing here is skipped.
A failure lists the violations and the one-line command that replays the scenario.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chaos.runner import run_scenario
from chaos.scenario import FLAVORS, generate

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

#: (seed, etcd flavor, family): every flavor, every family, both backends, one and three
#: members. Chosen once from the generator's output; a scenario's choices live in the
#: generator, so this list only names them.
CI_SCENARIOS = [
    (21, "3.4", "mixed"),
    (5, "3.5", "ops"),
    (3, "3.5-v3", "etcd"),
    (2, "3.5-v3", "limit"),
    (11, "3.6", "clock"),
    (14, "3.6", "nodes"),
    (9, "3.7", "store"),
    (13, "3.7", "network"),
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
        pytest.skip(missing)
    scenario = generate(seed, flavor, family)
    verdict = run_scenario(scenario, tmp_path / "records", log=lambda _: None)
    assert verdict.ok, (
        f"{scenario.describe()}\n"
        + "\n".join(f"[{v.invariant}] at {v.t} s: {v.detail}" for v in verdict.violations)
        + f"\nreplay: {scenario.replay_command()}\nrecords: {verdict.out}"
    )
