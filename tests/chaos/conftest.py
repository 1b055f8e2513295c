"""The fault harness's scenarios (marked ``chaos``) run only when ``-m`` names them.

They take minutes and start many processes, so ``pytest``, ``pytest -m slow`` and
``pytest -m ""`` leave them out; ``pytest -m chaos tests/chaos`` runs them (CI runs
them in a step of their own). The checker's unit tests beside them run in every pass.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos" in (config.getoption("markexpr") or ""):
        return
    skipped = [item for item in items if item.get_closest_marker("chaos") is not None]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if item.get_closest_marker("chaos") is None]
