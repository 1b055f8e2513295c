"""Sphinx configuration for the etcd-rendezvous documentation.

Build with ``python -m sphinx -W -b html docs docs/_build/html`` (CI does exactly this).
No extension needs the network: intersphinx is deliberately not used.
"""

from __future__ import annotations

import os
import sys

# Document the checkout, even when another version of the package is installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src")))

project = "etcd-rendezvous"
author = "etcd-rendezvous developers"
copyright = "etcd-rendezvous developers"

from etcd_rendezvous import __version__  # noqa: E402

release = __version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

exclude_patterns = ["_build"]
nitpicky = False

autodoc_default_options = {
    "members": True,
    "undoc-members": False,
    "show-inheritance": True,
}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"

napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {
    "description": "PyTorch Elastic's etcd rendezvous, without PyTorch",
}
