"""``python -m tests.chaos``: see :mod:`chaos.cli`."""

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
# The harness imports the test helpers as ``support`` and itself as ``chaos``, as pytest
# does; the library from src/ (``PYTHONPATH=src``) when it is not installed.
for path in (str(_TESTS), str(_TESTS.parent / "src")):
    if path not in sys.path:
        sys.path.insert(0 if path == str(_TESTS) else 1, path)
os.environ.setdefault("PYTHONPATH", str(_TESTS.parent / "src"))

from chaos.cli import main  # noqa: E402

sys.exit(main())
