"""The etcd key layout of every backend, in one place: names only, no I/O.

The key names are part of the wire protocol: workers using this package and workers
using PyTorch meet only because both spell the same keys, and every module of the
package takes its keys from here. The ``etcd`` backend's keys are those of
:class:`LegacyLayout`, the ``etcd-v2`` backend's :func:`etcd_v2_state_key` and
:class:`EtcdV2NodesLayout`, a store's :func:`store_value_key`; :doc:`how-it-works`
draws them (sections "Key layout" and "Our nodes").
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

__all__ = [
    "DEFAULT_PREFIX",
    "ETCD_V2_STATE_PREFIX",
    "ETCD_V2_STORE_PREFIX",
    "MEMBER_NAME_PREFIX",
    "WAITER_NAME_PREFIX",
    "EtcdV2NodesLayout",
    "LegacyLayout",
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
]

#: Default key prefix of the ``etcd`` backend (``etcd_prefix``), as in PyTorch.
DEFAULT_PREFIX = "/torchelastic/p2p"
#: Where the ``etcd-v2`` backend keeps the rendezvous states, as PyTorch does.
ETCD_V2_STATE_PREFIX = "/torch/elastic/rendezvous"
#: Where the ``etcd-v2`` backend keeps the store shared by the workers, as PyTorch does.
ETCD_V2_STORE_PREFIX = "/torch/elastic/store"

_KEEP_ALIVE_PREFIX = "rank_"
#: What the name of a member key starts with; 16 lowercase hex digits follow.
MEMBER_NAME_PREFIX = "node_"
_MEMBER_NAME_DIGITS = 16
#: What the name of a wait key starts with (a worker waiting on a final version); 16
#: lowercase hex digits follow.
WAITER_NAME_PREFIX = "wait_"
_DYNAMIC_STORE_SCOPE = "torch.rendezvous"


def normalize_key(key: str) -> str:
    """Canonical form of an etcd key, the one etcd stores and reports.

    etcd cleans every key as Go's ``path.Clean`` does: one leading ``/``, no empty,
    ``.`` or ``..`` segments, no trailing ``/``. So ``a//b/`` becomes ``/a/b``, and
    ``""`` the root ``/``. Compare keys written by different clients in this form.
    """
    return "/" + posixpath.normpath("/" + key).lstrip("/")


@dataclass(frozen=True)
class LegacyLayout:
    """The keys of one run of the ``etcd`` backend, below ``<prefix>/run_<run_id>``.

    Args:
        prefix: the ``etcd_prefix``; kept in the form :func:`normalize_key` gives it
            (``/torchelastic/p2p``, or ``/`` for the root).
        run_id: the job's run id.

    Raises:
        ValueError: ``run_id`` is empty or contains ``/``.
        TypeError: ``prefix`` is not a string.
    """

    prefix: str
    run_id: str

    def __post_init__(self) -> None:
        run_id = self.run_id
        if not isinstance(run_id, str) or not run_id or "/" in run_id:
            raise ValueError(f"run_id: must be a non-empty string without '/', got {run_id!r}.")
        if not isinstance(self.prefix, str):
            raise TypeError(f"prefix: must be a string, got {self.prefix!r}.")
        object.__setattr__(self, "prefix", normalize_key(self.prefix))

    @property
    def prefix_dir(self) -> str:
        """The prefix ending in ``/`` (``/torchelastic/p2p/``; ``/`` for the root), as
        PyTorch's ``EtcdRendezvous`` keeps it."""
        return self.prefix.rstrip("/") + "/"

    @property
    def run_dir(self) -> str:
        """``<prefix>/run_<run_id>``: the directory holding everything of the run."""
        return f"{self.prefix_dir}run_{self.run_id}"

    def path(self, path: str) -> str:
        """The key of ``path`` inside the run directory, spelled as PyTorch's
        ``EtcdRendezvous.get_path`` spells it (``path("")`` ends in ``/``)."""
        if not path.startswith("/"):
            path = "/" + path
        return self.run_dir + path

    @property
    def rdzv_dir(self) -> str:
        """``.../rdzv``: the directory of the state, the counter and the versions."""
        return self.path("/rdzv")

    @property
    def state_key(self) -> str:
        """``.../rdzv/active_version``: the state document, changed only by CAS."""
        return self.path("/rdzv/active_version")

    @property
    def counter_key(self) -> str:
        """``.../rdzv/version_counter``: the last rendezvous version handed out."""
        return self.path("/rdzv/version_counter")

    def version_dir(self, version: str) -> str:
        """``.../rdzv/v_<version>``: the directory of one rendezvous version."""
        return self.path(f"/rdzv/v_{version}")

    def keep_alive_key(self, version: str, rank: int) -> str:
        """``.../rdzv/v_<version>/rank_<rank>``: the keep-alive key of a PyTorch member
        (ours keep their :meth:`member_key` alive instead)."""
        return f"{self.version_dir(version)}/{_KEEP_ALIVE_PREFIX}{rank}"

    def member_key(self, version: str, name: str) -> str:
        """``.../rdzv/v_<version>/<name>``: the member key a worker of this package
        announces itself with (``name`` is ``node_<hex>``, see :func:`member_name`).

        A direct child of the version directory, so that it also serves as the worker's
        keep-alive key: PyTorch's workers check exactly that of each key listed in the
        state's ``keep_alives``.
        """
        return f"{self.version_dir(version)}/{name}"

    def waiter_key(self, version: str, name: str) -> str:
        """``.../rdzv/v_<version>/<name>``: the key a worker of this package waiting on the
        final ``version`` announces itself with (``name`` is ``wait_<hex>``, see
        :func:`waiter_name`), to be counted in ``num_workers_waiting``."""
        return f"{self.version_dir(version)}/{name}"

    def progress_key(self, version: str) -> str:
        """``.../rdzv/v_<version>/progress``: a small summary of the version's latest state
        write made by a worker of this package (a hint that lets waiting workers skip
        reading the state; PyTorch's workers ignore it)."""
        return f"{self.version_dir(version)}/progress"

    def extra_data_key(self, version: str) -> str:
        """``.../rdzv/v_<version>/extra_data``: the version's extra data (a JSON object)."""
        return f"{self.version_dir(version)}/extra_data"

    def store_dir(self, version: str) -> str:
        """``.../rdzv/v_<version>/kv``: the prefix of the version's EtcdStore."""
        return f"{self.version_dir(version)}/kv"


def keep_alive_rank(key: str) -> int | None:
    """The rank a keep-alive key ``.../rank_<rank>`` names; ``None`` for any other key."""
    name = key.rstrip("/").rsplit("/", 1)[-1]
    digits = name[len(_KEEP_ALIVE_PREFIX) :]
    if name.startswith(_KEEP_ALIVE_PREFIX) and _is_number(digits):
        return int(digits)
    return None


def new_member_name(entropy: int) -> str:
    """The member name ``node_<16 hex digits>`` spelling ``entropy``, a random 64-bit
    number the caller draws (``secrets.randbits(64)``): unique among a run's workers."""
    return _hex_name(MEMBER_NAME_PREFIX, entropy)


def member_name(key: str) -> str | None:
    """The name (``node_<16 hex digits>``) of a member key ``.../v_<N>/node_<hex>``, or of a
    bare name; ``None`` for any other key."""
    return _named(MEMBER_NAME_PREFIX, key)


def new_waiter_name(entropy: int) -> str:
    """The wait key name ``wait_<16 hex digits>`` spelling ``entropy`` (as
    :func:`new_member_name`)."""
    return _hex_name(WAITER_NAME_PREFIX, entropy)


def waiter_name(key: str) -> str | None:
    """The name (``wait_<16 hex digits>``) of a wait key ``.../v_<N>/wait_<hex>``, or of a
    bare name; ``None`` for any other key."""
    return _named(WAITER_NAME_PREFIX, key)


def _hex_name(prefix: str, entropy: int) -> str:
    if not 0 <= entropy < 1 << (4 * _MEMBER_NAME_DIGITS):
        raise ValueError(f"entropy: must be a 64-bit unsigned number, got {entropy!r}.")
    return f"{prefix}{entropy:0{_MEMBER_NAME_DIGITS}x}"


def _named(prefix: str, key: str) -> str | None:
    name = key.rstrip("/").rsplit("/", 1)[-1]
    digits = name[len(prefix) :]
    # strip() in C rather than a loop in Python: workers list hundreds of these.
    is_hex = len(digits) == _MEMBER_NAME_DIGITS and not digits.strip("0123456789abcdef")
    return name if name.startswith(prefix) and is_hex else None


def etcd_v2_state_key(run_id: str, key_prefix: str | None = ETCD_V2_STATE_PREFIX) -> str:
    """The ``etcd-v2`` backend's state key: ``<key_prefix>/<run_id>``.

    Spelled as PyTorch's ``EtcdRendezvousBackend`` spells it, without normalising:
    just ``run_id`` when ``key_prefix`` is empty or ``None``.
    """
    return f"{key_prefix}/{run_id}" if key_prefix else run_id


#: The nodes directories of ``etcd-v2`` runs whose state keys have no prefix (the root).
_ROOT_NODES_DIR = "/rendezvous_nodes"
_NODES_DIR_SUFFIX = "_nodes"
_AGGREGATOR_NAME = "aggregator"
#: The last segment of the progress key of an ``etcd-v2`` run (see :class:`EtcdV2NodesLayout`).
_PROGRESS_NAME = "progress"
#: Characters a node key name or an escaped run id keeps as they are; every other byte
#: becomes ``~`` and two hex digits. Neither ``%`` (which etcd's v2 HTTP API would
#: decode) nor ``_`` (the separator, and on v2 the mark of a hidden key) nor ``/``
#: survives, so a name is one key, visible, and maps back to one node only.
_KEY_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
#: A node key's name: an escaped address (``~`` alone for an empty one), pid, local id.
_NODE_KEY_NAME = re.compile(r"([A-Za-z0-9.~-]+)_([0-9]+)_([0-9]+)")


_SAFE_TEXT = re.compile(r"[A-Za-z0-9.-]*")


def _escape(text: str) -> str:
    """``text`` with every byte outside :data:`_KEY_SAFE` spelled ``~xx`` (injective)."""
    if _SAFE_TEXT.fullmatch(text):
        return text
    return "".join(
        chr(byte) if chr(byte) in _KEY_SAFE else f"~{byte:02x}" for byte in text.encode()
    )


@dataclass(frozen=True)
class EtcdV2NodesLayout:
    """The node keys of one ``etcd-v2`` run: ``<key_prefix>_nodes/<run_id>/...``.

    Only this package's nodes write them (PyTorch's never read them): each of our nodes
    keeps a key there while it is joining or in the rendezvous, with a TTL (its
    heartbeat), and one of them holds the :attr:`aggregator_key` lock. The directory is
    a sibling of the state keys' directory, so no run's state key can be one of them:
    with the default prefix, ``/torch/elastic/rendezvous_nodes/<run_id>``; with an empty
    (or root) prefix, ``/rendezvous_nodes/<run_id>``. The run id is escaped (a ``/`` in
    it does not nest one run's directory in another's).

    Args:
        run_id: the job's run id.
        key_prefix: the state keys' prefix, as given to
            :func:`etcd_v2_state_key`.

    Raises:
        ValueError: ``run_id`` is empty.
    """

    run_id: str
    key_prefix: str | None = ETCD_V2_STATE_PREFIX

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"run_id: must be a non-empty string, got {self.run_id!r}.")

    @property
    def nodes_dir(self) -> str:
        """The run's directory of node keys."""
        return f"{self.runs_dir(self.key_prefix)}/{_escape(self.run_id)}"

    @staticmethod
    def runs_dir(key_prefix: str | None) -> str:
        """The directory that holds the nodes directory of every run whose state keys
        are below ``key_prefix`` (``None``: the root)."""
        prefix = normalize_key(key_prefix or "/")
        return _ROOT_NODES_DIR if prefix == "/" else prefix + _NODES_DIR_SUFFIX

    @staticmethod
    def run_id_of(name: str) -> str | None:
        """The run id whose nodes directory is named ``name`` (the last segment of
        :attr:`nodes_dir`); ``None`` if no run id is spelled so."""
        try:
            run_id = _unescape(name)
        except (ValueError, UnicodeDecodeError):
            return None
        return run_id if run_id and _escape(run_id) == name else None

    def node_key(self, addr: str, pid: int, local_id: int) -> str:
        """``<nodes_dir>/<addr>_<pid>_<local_id>``: the key of one node (``addr``
        escaped)."""
        return f"{self.nodes_dir}/{node_key_name(addr, pid, local_id)}"

    @property
    def aggregator_key(self) -> str:
        """``<nodes_dir>/aggregator``: the lock of the node that folds the others'
        heartbeats into the state (a name no node key can have)."""
        return f"{self.nodes_dir}/{_AGGREGATOR_NAME}"

    @property
    def progress_key(self) -> str:
        """``<nodes_dir>/progress``: a small summary of the last state write by one of
        our nodes, which our waiting nodes watch instead of the state (a name no node key
        can have)."""
        return f"{self.nodes_dir}/{_PROGRESS_NAME}"


def node_key_name(addr: str, pid: int, local_id: int) -> str:
    """The last segment of a node's key: ``<escaped addr>_<pid>_<local_id>`` (an empty
    address is spelled ``~``: a v2 key whose name starts with ``_`` is hidden)."""
    return f"{_escape(addr) or '~'}_{int(pid)}_{int(local_id)}"


def is_node_key_name(name: str) -> bool:
    """Whether ``name`` (the last segment of a key) is spelled as a node key's is."""
    return _NODE_KEY_NAME.fullmatch(name) is not None


def parse_node_key_name(name: str) -> tuple[str, int, int] | None:
    """The ``(addr, pid, local_id)`` a node key's name spells (the inverse of
    :func:`node_key_name`); ``None`` for any other name."""
    match = _NODE_KEY_NAME.fullmatch(name)
    if match is None:
        return None
    escaped, pid, local_id = match.groups()
    if "~" not in escaped:
        addr = escaped
    else:
        try:
            addr = _unescape(escaped)
        except ValueError:
            return None
    if (pid[0] == "0" and pid != "0") or (local_id[0] == "0" and local_id != "0"):
        return None  # Not how node_key_name spells a number.
    if addr != escaped and _escape(addr) != escaped and escaped != "~":
        return None  # Not the canonical spelling (e.g. "~41" for "A").
    return addr, int(pid), int(local_id)


def _unescape(text: str) -> str:
    """The inverse of :func:`_escape` (``~`` alone: the empty address)."""
    if text == "~":
        return ""
    raw = bytearray()
    parts = text.split("~")
    raw += parts[0].encode()
    for part in parts[1:]:
        raw.append(int(part[:2], 16))
        raw += part[2:].encode()
    return raw.decode()


def dynamic_store_prefix(run_id: str, round_: int) -> str:
    """``torch.rendezvous.<run_id>.<round>``: the store prefix of a dynamic round.

    The dynamic rendezvous wraps the store it hands out in a c10d ``PrefixStore`` with
    this prefix, so each round starts with fresh keys (``MASTER_ADDR`` etc.).
    """
    return f"{_DYNAMIC_STORE_SCOPE}.{run_id}.{round_}"


def dynamic_store_round(prefix: str, run_id: str) -> int | None:
    """The round a :func:`dynamic_store_prefix` of ``run_id`` names; ``None`` if it is
    not one."""
    scope = f"{_DYNAMIC_STORE_SCOPE}.{run_id}."
    digits = prefix[len(scope) :]
    if prefix.startswith(scope) and _is_number(digits):
        return int(digits)
    return None


def store_value_key(store_prefix: str, encoded_key: str) -> str:
    """The etcd key of an :class:`~etcd_rendezvous.etcd_store.EtcdStore` entry.

    Args:
        store_prefix: the store's directory (with or without a trailing ``/``).
        encoded_key: the store key as the store encodes it (base64, which may contain
            ``/`` and so end in one: etcd stores such a key without it).
    """
    return normalize_key(f"{store_prefix}/{encoded_key}")


def _is_number(text: str) -> bool:
    """Whether ``text`` is a decimal number as the keys spell one (ASCII digits only)."""
    return text.isascii() and text.isdigit()
