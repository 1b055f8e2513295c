"""API snapshot: every public name is importable from the module it was in before.

The names below were read from the tree before the package's private modules moved
into subpackages (each public module's ``__all__``), plus the names public modules
expose outside their ``__all__`` (PyTorch's, and those users import by name) and the
entry points declared in ``pyproject.toml``. They are written out, not computed from the
code, so a name that disappears or moves fails here. Adding names is fine; removing one
is a breaking change.

Every public class whose instances are pickled (the errors, which cross processes, and
the decoded state) names a public module as its ``__module__``, one that has it under its
own name: a pickle refers to it there, so a private module behind it can move without
breaking it. Other classes and functions may name the private module they live in.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import pathlib
import sys

import pytest

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"

#: Each public module's ``__all__`` before the move.
BEFORE: dict[str, tuple[str, ...]] = {
    "etcd_rendezvous": (
        "EtcdRendezvousHandler",
        "EtcdStore",
        "RendezvousClosedError",
        "RendezvousConnectionError",
        "RendezvousError",
        "RendezvousGracefulExitError",
        "RendezvousHandler",
        "RendezvousHandlerRegistry",
        "RendezvousInfo",
        "RendezvousParameters",
        "RendezvousStateError",
        "RendezvousStoreInfo",
        "RendezvousTimeoutError",
        "__version__",
        "get_rendezvous_handler",
        "rendezvous_handler_registry",
    ),
    "etcd_rendezvous.api": (
        "Deadline",  # added since: the deadline callers pass down
        "RendezvousClosedError",
        "RendezvousConnectionError",
        "RendezvousError",
        "RendezvousGracefulExitError",
        "RendezvousHandler",
        "RendezvousHandlerCreator",
        "RendezvousHandlerRegistry",
        "RendezvousInfo",
        "RendezvousParameters",
        "RendezvousStateError",
        "RendezvousStoreInfo",
        "RendezvousTimeoutError",
        "Store",
        "rendezvous_handler_registry",
    ),
    "etcd_rendezvous.utils": (
        "parse_rendezvous_endpoint",
        "parse_rendezvous_endpoints",
    ),
    "etcd_rendezvous.registry": ("get_rendezvous_handler",),
    "etcd_rendezvous.etcd_rendezvous": (
        "EtcdRendezvous",
        "EtcdRendezvousHandler",
        "EtcdRendezvousRetryImmediately",
        "EtcdRendezvousRetryableFailure",
        "create_rdzv_handler",
        "member_ranks",
        "parse_state",
    ),
    "etcd_rendezvous.etcd_store": (
        "DEFAULT_TIMEOUT",
        "EtcdStore",
        "cas_delay",
    ),
    "etcd_rendezvous.dynamic_rendezvous": (
        "DynamicRendezvousHandler",
        "NodeDesc",
        "RendezvousBackend",
        "RendezvousSettings",
        "RendezvousState",
        "RendezvousTimeout",
        "Token",
        "create_handler",
        "decode_state",
    ),
    "etcd_rendezvous.etcd_rendezvous_backend": (
        "EtcdRendezvousBackend",
        "create_backend",
    ),
    "etcd_rendezvous.events": (
        "EventHandler",
        "NodeState",
        "RdzvEvent",
        "add_event_handler",
        "record_rdzv_event",
        "remove_event_handler",
    ),
    "etcd_rendezvous.layout": (
        "DEFAULT_PREFIX",
        "ETCD_V2_STATE_PREFIX",
        "ETCD_V2_STORE_PREFIX",
        "EtcdV2NodesLayout",
        "LegacyLayout",
        "MEMBER_NAME_PREFIX",
        "WAITER_NAME_PREFIX",
        "dynamic_store_prefix",
        "dynamic_store_round",
        "etcd_v2_state_key",
        "is_node_key_name",
        "keep_alive_rank",
        "member_name",
        "new_member_name",
        "new_waiter_name",
        "node_key_name",
        "normalize_key",
        "parse_node_key_name",
        "store_value_key",
        "waiter_name",
    ),
    "etcd_rendezvous.metrics": (
        "Metric",
        "MetricKind",
        "MetricsCollector",
        "MetricsHandler",
        "add_metrics_handler",
        "record_metric",
        "remove_metrics_handler",
        "timed",
    ),
    "etcd_rendezvous.etcd_server": (
        "BINARY_PATH_ENV",
        "EtcdBinaryNotFoundError",
        "EtcdServer",
        "EtcdServerError",
        "EtcdServerTimeoutError",
        "TORCHELASTIC_BINARY_PATH_ENV",
        "bundled_etcd_binary",
        "find_etcd_binary",
    ),
    "etcd_rendezvous.etcd_cluster": (
        "EtcdCluster",
        "EtcdClusterMember",
    ),
    "etcd_rendezvous.pytest_plugin": (
        "ETCD_API_ENV",
        "REQUIRE_ETCD_ENV",
        "etcd_api_under_test",
        "etcd_client",
        "etcd_cluster",
        "etcd_prefix",
        "etcd_server",
        "pytest_configure",
        "pytest_runtest_makereport",
        "pytest_runtest_setup",
    ),
    "etcd_rendezvous.torchrun": (
        "BACKEND_NAME",
        "V2_BACKEND_NAME",
        "as_rendezvous_parameters",
        "create_etcd_rendezvous_handler",
        "create_etcd_rendezvous_v2_handler",
        "etcd_rendezvous_handler",
        "etcd_rendezvous_v2_handler",
        "main",
        "replace_torch_etcd_backends",
    ),
    "etcd_rendezvous.torch_store": (
        "StoreTimeoutError",
        "TorchEtcdStore",
    ),
    "etcd_rendezvous.cli": ("main",),
    "etcd_rendezvous.cli.close": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "run",
    ),
    "etcd_rendezvous.cli.delete": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "add_deletion_options",
        "delete_runs",
        "run",
    ),
    "etcd_rendezvous.cli.demo": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "run",
        "usage_problem",
    ),
    "etcd_rendezvous.cli.gc": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "duration",
        "run",
    ),
    "etcd_rendezvous.cli.list_runs": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "add_selection",
        "format_idle",
        "run",
    ),
    "etcd_rendezvous.cli.server": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "run",
    ),
    "etcd_rendezvous.cli.status": (
        "DESCRIPTION",
        "HELP",
        "add_arguments",
        "run",
    ),
}

#: PyTorch's names that its ``etcd_rendezvous`` module defines and this one re-exports
#: without listing them in ``__all__`` (code written for PyTorch imports them).
PYTORCH_EXTRAS: dict[str, tuple[str, ...]] = {
    "etcd_rendezvous.etcd_rendezvous": (
        "CONST_ETCD_FROZEN_TTL",
        "CONST_ETCD_JOINABLE_EPHEMERAL_TTL",
        "CONST_ETCD_SETUP_TTL",
        "CONST_RUNID_SUBROOT_TTL",
        "CONST_WORKER_KEEPALIVE_TTL",
    ),
}

#: Names outside ``__all__`` that users and tools import by name (type aliases for
#: annotations, the metric group, the CLI's run selection, a pytest hook).
OUTSIDE_ALL: dict[str, tuple[str, ...]] = {
    "etcd_rendezvous.etcd_store": ("KeyLike",),
    "etcd_rendezvous.metrics": ("TORCH_METRIC_GROUP",),
    "etcd_rendezvous.torchrun": ("HandlerCreator",),
    "etcd_rendezvous.cli.list_runs": ("select_runs",),
    "etcd_rendezvous.pytest_plugin": ("pytest_report_header",),
}

#: pyproject.toml's entry points: (group, name) -> "module:attribute".
ENTRY_POINTS: dict[tuple[str, str], str] = {
    ("console_scripts", "etcd-rendezvous"): "etcd_rendezvous.cli:main",
    ("console_scripts", "etcd-torchrun"): "etcd_rendezvous.torchrun:main",
    ("torchrun.handlers", "etcd-rendezvous"): "etcd_rendezvous.torchrun:etcd_rendezvous_handler",
    ("torchrun.handlers", "etcd-rendezvous-v2"): (
        "etcd_rendezvous.torchrun:etcd_rendezvous_v2_handler"
    ),
    ("pytest11", "etcd_rendezvous"): "etcd_rendezvous.pytest_plugin",
}

#: Modules that import PyTorch when loaded; without it, their names are read from source.
NEEDS_TORCH = frozenset({"etcd_rendezvous.torch_store"})


def _module_level_names(module: str) -> set[str]:
    """Names a module defines or imports at its top level, read without importing it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    assert spec.origin is not None, module
    tree = ast.parse(pathlib.Path(spec.origin).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _missing(module: str, names: tuple[str, ...]) -> list[str]:
    if module in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        defined = _module_level_names(module)
        return [name for name in names if name not in defined]
    loaded = importlib.import_module(module)
    return [name for name in names if not hasattr(loaded, name)]


def _public_names(module: str) -> tuple[str, ...]:
    return BEFORE[module] + PYTORCH_EXTRAS.get(module, ()) + OUTSIDE_ALL.get(module, ())


@pytest.mark.parametrize("module", sorted(BEFORE))
def test_public_names_still_importable(module: str) -> None:
    assert _missing(module, _public_names(module)) == [], f"{module} lost public names"


#: Public classes, besides the errors, whose instances are pickled: a decoded state sent to
#: another process (PyTorch's state classes, under their public names here).
PICKLED: frozenset[tuple[str, str]] = frozenset(
    {
        ("etcd_rendezvous.dynamic_rendezvous", "NodeDesc"),
        ("etcd_rendezvous.dynamic_rendezvous", "RendezvousState"),
    }
)


def _misplaced(module: str, name: str) -> str | None:
    """Why ``module.name``'s ``__module__`` is wrong, or None if it is a public home (or
    the object is not pickled)."""
    obj = getattr(importlib.import_module(module), name)
    pickled = inspect.isclass(obj) and (issubclass(obj, BaseException) or (module, name) in PICKLED)
    if not pickled:
        return None
    home = obj.__module__
    if home.split(".")[0] != "etcd_rendezvous":
        return None  # another library's object (typing's, PyTorch's), re-exported as is
    if home not in BEFORE or name not in _public_names(home):
        return f"{module}.{name}.__module__ is {home}, not a public module exporting {name}"
    if getattr(importlib.import_module(home), obj.__qualname__, None) is not obj:
        return f"{module}.{name}: {home}.{obj.__qualname__} is not it (pickle cannot find it)"
    return None


@pytest.mark.parametrize("module", sorted(BEFORE))
def test_pickled_objects_name_a_public_module(module: str) -> None:
    if module in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("importing the module would import PyTorch, which is not installed")
    found = [_misplaced(module, name) for name in _public_names(module)]
    assert [problem for problem in found if problem] == []


@pytest.mark.parametrize("module", sorted(BEFORE))
def test_public_names_still_exported(module: str) -> None:
    if module in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("reading __all__ would import PyTorch, which is not installed")
    exported = set(importlib.import_module(module).__all__)
    assert sorted(set(BEFORE[module]) - exported) == [], f"{module}.__all__ lost names"


@pytest.mark.parametrize(("group", "name"), sorted(ENTRY_POINTS))
def test_entry_points_unchanged(group: str, name: str) -> None:
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
    target = ENTRY_POINTS[group, name]
    assert installed.get(name) == target
    if sys.version_info >= (3, 11):  # tomllib; the installed metadata is checked above
        import tomllib

        project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
        tables = {"console_scripts": project["scripts"], **project["entry-points"]}
        assert tables[group].get(name) == target
    module, _, attribute = target.partition(":")
    if attribute:
        assert _missing(module, (attribute,)) == []
    else:
        importlib.import_module(module)
