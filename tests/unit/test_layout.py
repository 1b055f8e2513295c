"""Unit tests for etcd_rendezvous.layout: the etcd key names, which are PyTorch's wire
protocol, so every expected key below is spelled out literally."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_rendezvous import layout
from etcd_rendezvous.layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    dynamic_store_prefix,
    dynamic_store_round,
    etcd_v2_state_key,
    is_node_key_name,
    keep_alive_rank,
    member_name,
    new_member_name,
    node_key_name,
    normalize_key,
    parse_node_key_name,
    store_value_key,
)

# the prefixes


def test_default_prefixes_are_pytorchs() -> None:
    assert DEFAULT_PREFIX == "/torchelastic/p2p"
    assert ETCD_V2_STATE_PREFIX == "/torch/elastic/rendezvous"
    assert ETCD_V2_STORE_PREFIX == "/torch/elastic/store"


# normalize_key


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("/a/b", "/a/b"),
        ("a/b", "/a/b"),
        ("/a/b/", "/a/b"),
        ("//a///b//", "/a/b"),
        ("", "/"),
        ("/", "/"),
        ("//", "/"),
        ("/a/./b", "/a/b"),
        ("/a/../b", "/b"),
        ("/..", "/"),
        ("/a/b+c=", "/a/b+c="),
    ],
)
def test_normalize_key_cleans_as_etcd_does(key: str, expected: str) -> None:
    assert normalize_key(key) == expected


# the legacy etcd backend


def test_legacy_keys_with_the_default_prefix() -> None:
    keys = LegacyLayout(DEFAULT_PREFIX, "job1")
    assert keys.prefix == "/torchelastic/p2p"
    assert keys.prefix_dir == "/torchelastic/p2p/"
    assert keys.run_dir == "/torchelastic/p2p/run_job1"
    assert keys.rdzv_dir == "/torchelastic/p2p/run_job1/rdzv"
    assert keys.state_key == "/torchelastic/p2p/run_job1/rdzv/active_version"
    assert keys.counter_key == "/torchelastic/p2p/run_job1/rdzv/version_counter"
    assert keys.version_dir("7") == "/torchelastic/p2p/run_job1/rdzv/v_7"
    assert keys.keep_alive_key("7", 3) == "/torchelastic/p2p/run_job1/rdzv/v_7/rank_3"
    assert (
        keys.member_key("7", "node_00000000000000ff")
        == "/torchelastic/p2p/run_job1/rdzv/v_7/node_00000000000000ff"
    )
    assert keys.extra_data_key("7") == "/torchelastic/p2p/run_job1/rdzv/v_7/extra_data"
    assert keys.store_dir("7") == "/torchelastic/p2p/run_job1/rdzv/v_7/kv"


def test_legacy_path_is_pytorchs_get_path() -> None:
    keys = LegacyLayout("/torchelastic/p2p", "job1")
    assert keys.path("/rdzv/active_version") == "/torchelastic/p2p/run_job1/rdzv/active_version"
    assert keys.path("rdzv") == "/torchelastic/p2p/run_job1/rdzv"
    # PyTorch's get_path("") ends in "/": the run directory's keep-alive uses that key.
    assert keys.path("") == "/torchelastic/p2p/run_job1/"


@pytest.mark.parametrize(
    ("prefix", "normalized", "prefix_dir", "run_dir"),
    [
        (
            "/torchelastic/p2p/",
            "/torchelastic/p2p",
            "/torchelastic/p2p/",
            "/torchelastic/p2p/run_r",
        ),
        ("torchelastic//p2p", "/torchelastic/p2p", "/torchelastic/p2p/", "/torchelastic/p2p/run_r"),
        ("/", "/", "/", "/run_r"),
        ("", "/", "/", "/run_r"),
        ("/a/./b/../c", "/a/c", "/a/c/", "/a/c/run_r"),
    ],
)
def test_legacy_prefix_is_normalized(
    prefix: str, normalized: str, prefix_dir: str, run_dir: str
) -> None:
    keys = LegacyLayout(prefix, "r")
    assert keys.prefix == normalized
    assert keys.prefix_dir == prefix_dir
    assert keys.run_dir == run_dir
    assert keys.state_key == run_dir + "/rdzv/active_version"


def test_legacy_layouts_with_equivalent_prefixes_are_equal() -> None:
    assert LegacyLayout("/p/", "r") == LegacyLayout("p", "r")
    assert hash(LegacyLayout("/p/", "r")) == hash(LegacyLayout("p", "r"))


def test_legacy_layout_is_frozen() -> None:
    keys = LegacyLayout("/p", "r")
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.run_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize("run_id", ["", "a/b", "/", None, 3])
def test_legacy_layout_refuses_a_bad_run_id(run_id: object) -> None:
    with pytest.raises(ValueError, match=r"^run_id: must be a non-empty string without '/'"):
        LegacyLayout("/p", run_id)  # type: ignore[arg-type]


def test_legacy_layout_refuses_a_prefix_that_is_not_a_string() -> None:
    with pytest.raises(TypeError, match=r"^prefix: must be a string, got b'/p'"):
        LegacyLayout(b"/p", "r")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "rank"),
    [
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_0", 0),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_12", 12),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_12/", 12),
        ("rank_5", 5),
        ("/torchelastic/p2p/run_r/rdzv/v_1/extra_data", None),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_", None),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_x", None),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_-1", None),
        ("/torchelastic/p2p/run_r/rdzv/v_1/rank_\u00b2", None),
    ],
)
def test_keep_alive_rank(key: str, rank: int | None) -> None:
    assert keep_alive_rank(key) == rank


def test_keep_alive_rank_reads_back_keep_alive_key() -> None:
    assert keep_alive_rank(LegacyLayout("/p", "r").keep_alive_key("3", 17)) == 17


def test_new_member_name_spells_64_bits_in_hex() -> None:
    assert new_member_name(0) == "node_0000000000000000"
    assert new_member_name(0xDEADBEEF) == "node_00000000deadbeef"
    assert new_member_name(2**64 - 1) == "node_ffffffffffffffff"
    for entropy in (-1, 2**64):
        with pytest.raises(ValueError, match=r"^entropy: "):
            new_member_name(entropy)


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("/p/run_r/rdzv/v_1/node_00000000deadbeef", "node_00000000deadbeef"),
        ("/p/run_r/rdzv/v_1/node_00000000deadbeef/", "node_00000000deadbeef"),
        ("node_ffffffffffffffff", "node_ffffffffffffffff"),
        ("/p/run_r/rdzv/v_1/node_00000000DEADBEEF", None),
        ("/p/run_r/rdzv/v_1/node_deadbeef", None),
        ("/p/run_r/rdzv/v_1/node_00000000deadbeef0", None),
        ("/p/run_r/rdzv/v_1/rank_0", None),
        ("/p/run_r/rdzv/v_1/extra_data", None),
    ],
)
def test_member_name(key: str, name: str | None) -> None:
    assert member_name(key) == name


def test_member_name_reads_back_member_key() -> None:
    name = new_member_name(12345)
    assert member_name(LegacyLayout("/p", "r").member_key("3", name)) == name


# the etcd-v2 backend and the dynamic rendezvous


def test_etcd_v2_state_key() -> None:
    assert etcd_v2_state_key("job1") == "/torch/elastic/rendezvous/job1"
    assert etcd_v2_state_key("job1", "/custom") == "/custom/job1"
    # As PyTorch's backend: no prefix means the bare run id, and nothing is normalised.
    assert etcd_v2_state_key("job1", None) == "job1"
    assert etcd_v2_state_key("job1", "") == "job1"
    assert etcd_v2_state_key("job1", "/custom/") == "/custom//job1"


def test_etcd_v2_node_keys_with_the_default_prefix() -> None:
    keys = EtcdV2NodesLayout("job1")
    assert keys.nodes_dir == "/torch/elastic/rendezvous_nodes/job1"
    assert keys.node_key("host1", 42, 0) == "/torch/elastic/rendezvous_nodes/job1/host1_42_0"
    assert keys.aggregator_key == "/torch/elastic/rendezvous_nodes/job1/aggregator"


@pytest.mark.parametrize(
    ("key_prefix", "nodes_dir"),
    [
        ("/custom", "/custom_nodes/job1"),
        ("/custom/", "/custom_nodes/job1"),
        ("custom//x", "/custom/x_nodes/job1"),
        # State keys at the root (no prefix: the bare run id) share one directory.
        (None, "/rendezvous_nodes/job1"),
        ("", "/rendezvous_nodes/job1"),
        ("/", "/rendezvous_nodes/job1"),
    ],
)
def test_etcd_v2_nodes_dir_is_a_sibling_of_the_state_keys(
    key_prefix: str | None, nodes_dir: str
) -> None:
    assert EtcdV2NodesLayout("job1", key_prefix).nodes_dir == nodes_dir


def test_etcd_v2_nodes_dir_is_never_a_state_key() -> None:
    # Not below the state keys' directory: no run id makes it a state key.
    for run_id in ("job1", "job1_nodes", "a/b", ".."):
        nodes_dir = normalize_key(EtcdV2NodesLayout(run_id).nodes_dir)
        assert not nodes_dir.startswith(ETCD_V2_STATE_PREFIX + "/")
    # A "/" in the run id does not nest one run's directory in another's.
    assert EtcdV2NodesLayout("a/b").nodes_dir == "/torch/elastic/rendezvous_nodes/a~2fb"


@pytest.mark.parametrize(
    ("addr", "name"),
    [
        ("node-1.example.com", "node-1.example.com_7_3"),
        ("my_host", "my~5fhost_7_3"),
        ("::1", "~3a~3a1_7_3"),
        ("a/b%c~", "a~2fb~25c~7e_7_3"),
        ("_hidden", "~5fhidden_7_3"),
        ("h\u00f6st", "h~c3~b6st_7_3"),
        ("", "~_7_3"),
    ],
)
def test_node_key_names_escape_the_address(addr: str, name: str) -> None:
    assert node_key_name(addr, 7, 3) == name
    assert is_node_key_name(name)
    assert parse_node_key_name(name) == (addr, 7, 3)


@pytest.mark.parametrize("name", ["aggregator", "h_1", "h_x_1", "h_1_", "h/1_2_3", "h%41_1_2"])
def test_other_names_are_not_node_key_names(name: str) -> None:
    assert not is_node_key_name(name)
    assert parse_node_key_name(name) is None


@pytest.mark.parametrize("name", ["~41_1_2", "a~zz_1_2", "a~5_1_2", "~ff_1_2", "a_01_2"])
def test_names_not_spelled_as_node_key_name_spells_them_are_not_parsed(name: str) -> None:
    assert parse_node_key_name(name) is None


def test_node_key_names_are_distinct() -> None:
    names = {
        node_key_name(addr, pid, 0) for addr in ("a", "a_1", "a~5f1", "a_1_1") for pid in (1, 2)
    }
    assert len(names) == 8


def test_etcd_v2_nodes_layout_refuses_an_empty_run_id() -> None:
    with pytest.raises(ValueError, match="run_id"):
        EtcdV2NodesLayout("")


def test_dynamic_store_prefix() -> None:
    assert dynamic_store_prefix("job1", 0) == "torch.rendezvous.job1.0"
    assert dynamic_store_prefix("job.1", 12) == "torch.rendezvous.job.1.12"


@pytest.mark.parametrize(
    ("prefix", "run_id", "round_"),
    [
        ("torch.rendezvous.job1.0", "job1", 0),
        ("torch.rendezvous.job.1.12", "job.1", 12),
        ("torch.rendezvous.job1.", "job1", None),
        ("torch.rendezvous.job1.x", "job1", None),
        ("torch.rendezvous.job2.0", "job1", None),
        ("/torchelastic/p2p/run_job1/rdzv/v_1/kv/", "job1", None),
    ],
)
def test_dynamic_store_round(prefix: str, run_id: str, round_: int | None) -> None:
    assert dynamic_store_round(prefix, run_id) == round_


def test_dynamic_store_round_reads_back_dynamic_store_prefix() -> None:
    assert dynamic_store_round(dynamic_store_prefix("r", 4), "r") == 4


# EtcdStore entries


@pytest.mark.parametrize(
    ("prefix", "encoded", "key"),
    [
        ("/torch/elastic/store", "YQ==", "/torch/elastic/store/YQ=="),
        ("/torch/elastic/store/", "YQ==", "/torch/elastic/store/YQ=="),
        # base64 may contain "/" and end in it: etcd stores such a key without it.
        ("/s/", "YT8/", "/s/YT8"),
        ("/s/", "a//b", "/s/a/b"),
    ],
)
def test_store_value_key(prefix: str, encoded: str, key: str) -> None:
    assert store_value_key(prefix, encoded) == key


# the module itself


def test_layout_imports_nothing_that_does_io() -> None:
    tree = ast.parse(Path(layout.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported == {"__future__", "dataclasses", "posixpath", "re"}


def test_importing_layout_loads_no_etcd_client() -> None:
    code = (
        "import sys, etcd_rendezvous.layout\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('etcd', 'urllib3'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_is_exported_and_documented() -> None:
    # isidentifier(): pytest may rewrite the package's modules (it is a pytest11 plugin),
    # which adds the helpers "@py_builtins" and "@pytest_ar" to their namespace.
    public = {name for name in vars(layout) if name.isidentifier() and not name.startswith("_")}
    public -= {"annotations", "dataclass", "posixpath", "re"}
    assert set(layout.__all__) == public
    for name in layout.__all__:
        value = getattr(layout, name)
        if callable(value):
            assert value.__doc__, name
