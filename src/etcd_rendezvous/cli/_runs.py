"""The runs under a prefix, read without changing anything: what ``list``, ``status``,
``delete`` and ``gc`` know about a run, and whether it is finished.

A run of the ``etcd`` backend is the directory ``<prefix>/run_<run_id>``
(:class:`~etcd_rendezvous.layout.LegacyLayout`); a run of ``etcd-v2`` is its state key
``<prefix>/<run_id>``, the directory of its node keys
(:class:`~etcd_rendezvous.layout.EtcdV2NodesLayout`) and its rounds' keys in the shared
store (:func:`~etcd_rendezvous.layout.dynamic_store_prefix`).

A run is *finished* (:class:`Verdict`) on two facts etcd shows, never on the absence of
evidence alone (etcd cannot show every live worker: PyTorch's legacy workers below
``min_workers`` write no key, and a re-rendezvous has no state for a while):

* it is **over**: its state is closed, by a worker's ``shutdown()``/``set_closed()`` or by
  ``etcd-rendezvous close``; an ``etcd-v2`` run also when its state key is gone (its
  nodes write it, with a two-hour TTL, at least every two keep-alive intervals);
* it is **quiet**, by etcd's clock and keys with lifetimes only: no ``rank_*``,
  ``node_*`` or ``wait_*`` key in any ``rdzv/v_*`` directory and no joining state with a
  TTL (``etcd``); no node key and, over etcd's v2 API (where PyTorch's nodes, which keep
  no key, may be), a state last written at least one heartbeat lifetime ago
  (:func:`heartbeat_lifetime`).

Invariants (docs/assumptions.rst, "What operators may delete, and when"):

* No command deletes, without ``--force``, a run with a live worker or a waiting node,
  whatever the interleaving: a re-rendezvous gap, PyTorch's workers below
  ``min_workers``, a worker in its exit barrier, a worker frozen for less than its
  keys' lifetime, a run id reused meanwhile, a lost answer to a delete. ``delete`` and
  ``gc`` judge the run again after the confirmation, compare-and-delete the state they
  judged, and look for worker keys once more before the rest goes.
* Nothing is deleted because of bad input: an unknown run, a state that does not decode,
  an option etcd cannot honour is refused, with the culprit named.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
import logging
import time
from base64 import b64decode
from dataclasses import dataclass, field
from typing import Any

from .._transport.v2_session import key_path
from ..api import RendezvousStateError
from ..dynamic_rendezvous import RendezvousState, decode_state
from ..etcd_rendezvous import parse_state
from ..etcd_rendezvous_backend import EtcdRendezvousBackend
from ..layout import (
    DEFAULT_PREFIX,
    ETCD_V2_STATE_PREFIX,
    ETCD_V2_STORE_PREFIX,
    EtcdV2NodesLayout,
    LegacyLayout,
    dynamic_store_prefix,
    dynamic_store_round,
    etcd_v2_state_key,
    keep_alive_rank,
    member_name,
    normalize_key,
    waiter_name,
)
from ._common import KeyNotFoundError, Node, Transport, read_dir, with_ttl

__all__ = [
    "PYTORCH_HEARTBEAT_LIFETIME",
    "EtcdRun",
    "HeartbeatLifetime",
    "RunSummary",
    "Verdict",
    "etcd_v2_status",
    "etcd_v2_store_keys",
    "find_runs",
    "heartbeat_lifetime",
    "is_worker_key",
    "judge_etcd",
    "judge_etcd_v2",
    "list_etcd_runs",
    "list_etcd_v2_run_ids",
    "node_keys_report",
    "owns_store_keys",
    "read_etcd_run",
    "read_run",
    "state_write_age",
    "summarize_etcd",
    "summarize_etcd_v2",
]

logger = logging.getLogger(__name__)

#: The heartbeat lifetime of PyTorch's dynamic rendezvous with its defaults
#: (``keep_alive_interval`` 5 s times ``keep_alive_max_attempt`` 3): what a run whose nodes
#: publish none is judged by, unless the operator says otherwise.
PYTORCH_HEARTBEAT_LIFETIME = 15.0
_RUN_DIR_PREFIX = "run_"
_VERSION_DIR_PREFIX = "v_"


@dataclass(frozen=True)
class HeartbeatLifetime:
    """How long the nodes of an ``etcd-v2`` run may stay silent before they count as
    dead, and where that figure comes from."""

    seconds: float
    #: ``published by its nodes``, ``--heartbeat-lifetime`` or ``PyTorch's default``.
    source: str


def heartbeat_lifetime(published: float | None, stated: float | None) -> HeartbeatLifetime:
    """The heartbeat lifetime to judge a run by: the longest of what our nodes published
    (in the progress key) and what the operator stated (``--heartbeat-lifetime``, for
    PyTorch's nodes configured otherwise); PyTorch's default if neither is known."""
    known = [
        HeartbeatLifetime(float(seconds), source)
        for seconds, source in (
            (published, "published by its nodes"),
            (stated, "--heartbeat-lifetime"),
        )
        if seconds
    ]
    if not known:
        return HeartbeatLifetime(PYTORCH_HEARTBEAT_LIFETIME, "PyTorch's default")
    return max(known, key=lambda lifetime: lifetime.seconds)


@dataclass(frozen=True)
class Verdict:
    """Whether a run is finished, and what etcd showed to say so."""

    #: Closed (or, for ``etcd-v2``, its state key gone): the job is over.
    over: bool
    #: No key with a lifetime shows a worker, and (``etcd-v2`` over v2) the state was
    #: written a heartbeat lifetime ago or more.
    quiet: bool
    #: What made the run live or not, for the operator (one short clause).
    reason: str
    #: Seconds the run has been idle by etcd's clock, at least (0: a key shows a live
    #: worker); ``None`` where etcd keeps no time of it.
    idle_seconds: float | None
    #: Seconds a command that deletes the run must see its state unchanged, by its own
    #: clock, first: quiet was judged from the state's TTL, which etcd's v2 API counts
    #: on the clock of the member that took the write and of the one that answers, and
    #: a member whose clock is ahead makes every state look older (0: not needed).
    confirm_quiet: float = 0.0

    @property
    def finished(self) -> bool:
        """Over and quiet: the run may be deleted without ``--force``."""
        return self.over and self.quiet


def judge_etcd(*, status: str, worker_keys: int, joining: bool) -> Verdict:
    """The verdict on an ``etcd`` run whose state has ``status`` (``none``: no state,
    ``invalid``: one that does not decode), with ``worker_keys`` keys of workers in its
    version directories, ``joining`` if its state has a TTL of its own and is not final
    (workers write it so while they join)."""
    over = status == "closed"
    if worker_keys:
        return Verdict(over, False, f"{worker_keys} worker key(s)", 0.0)
    if joining:
        return Verdict(over, False, f"a {status} state with a TTL (a worker is joining)", 0.0)
    if over:
        return Verdict(True, True, "closed, no worker key", None)
    if status == "none":
        return Verdict(False, True, "not closed (no state: between two versions?)", None)
    return Verdict(False, True, f"not closed ({status})", None)


def state_write_age(api: str, ttl: int | None, granted: int) -> float | None:
    """Seconds since an ``etcd-v2`` state key was written, by etcd's clock: every node
    writes it with a TTL of ``granted`` (PyTorch's two hours), which etcd's v2 API
    reports counting down (in whole seconds, rounded up: the age is never
    overestimated). ``None`` where etcd cannot tell: over the v3 API (this package's
    writes share a lease among keys written within minutes of each other, so the
    lease's age is not the key's), a key without a TTL, or one with a longer TTL."""
    if api != "v2" or ttl is None or ttl > granted:
        return None
    return float(granted - ttl)


def judge_etcd_v2(
    *,
    status: str,
    node_keys: int,
    api: str,
    state_ttl: int | None,
    granted_ttl: int,
    lifetime: HeartbeatLifetime,
) -> Verdict:
    """The verdict on an ``etcd-v2`` run whose state has ``status`` (``none``: no state
    key; ``invalid``: a value that does not decode), with ``node_keys`` node keys, over
    etcd's ``api``, its state key having ``state_ttl`` seconds left of ``granted_ttl``
    (see :func:`state_write_age`), judged by ``lifetime``."""
    over = status in ("none", "closed")
    if node_keys:
        return Verdict(over, False, f"{node_keys} node key(s)", 0.0)
    if status == "none":
        return Verdict(True, True, "no state (it lapsed, or was never written), no node key", None)
    if status == "invalid":
        return Verdict(False, False, "its state does not decode", None)
    age = state_write_age(api, state_ttl, granted_ttl)
    if age is not None:
        quiet = age >= lifetime.seconds
        compared = "at least" if quiet else "less than"
        clause = (
            f"state written {age:g} s ago, {compared} the heartbeat lifetime "
            f"({lifetime.seconds:g} s, {lifetime.source})"
        )
    elif api != "v2":
        quiet, clause = True, "no node key (over etcd's v3 API every node keeps one)"
    elif state_ttl is None:
        quiet, clause = True, "no node key, no TTL on the state (no node wrote it since)"
    else:
        quiet = False
        clause = f"a state of unknown age (its TTL, {state_ttl} s, is above {granted_ttl} s)"
    confirm = lifetime.seconds if quiet and age is not None else 0.0
    if not over:
        return Verdict(False, quiet, f"not closed ({status})", age, confirm)
    return Verdict(True, quiet, f"closed, {clause}" if quiet else clause, age, confirm)


# -- the summary of a run --------------------------------------------------------------


@dataclass(frozen=True)
class EtcdRun:
    """The etcd nodes that describe a run of the ``etcd`` backend (each ``None`` when
    missing)."""

    run_id: str
    prefix: str
    run_dir: Node | None
    state: Node | None
    version_counter: Node | None
    #: ``rdzv/v_<version>`` of the version the state names, its children with their TTLs.
    version_dir: Node | None
    #: Every ``rdzv/v_*`` directory, with its children: their ``rank_<r>``,
    #: ``node_<hex>`` and ``wait_<hex>`` keys are the keys of live workers.
    version_dirs: tuple[Node, ...] = ()

    @property
    def worker_keys(self) -> int:
        """The keys of live workers, in every version directory."""
        return sum(
            1
            for directory in self.version_dirs
            for child in directory.children
            if is_worker_key(child.key)
        )


@dataclass
class RunSummary:
    """One line of ``list``: a run as an operator sees it (JSON-serialisable by
    :meth:`as_dict`)."""

    backend: str
    run_id: str
    api: str
    #: ``setup``/``joinable``/``frozen``/``final``/``closed`` (``etcd``),
    #: ``joining``/``complete``/``closed``/``empty`` (``etcd-v2``), ``none`` (no state:
    #: only keys around it) or ``invalid`` (a state that does not decode).
    status: str
    #: Participants of the current version (round).
    world_size: int
    #: The version (``etcd``) or round (``etcd-v2``).
    version: str | None
    #: Keys of live workers: keep-alive, member and wait keys (``etcd``) or node keys
    #: (``etcd-v2``).
    live: int
    verdict: Verdict
    #: The lifetime the run was judged by (``etcd-v2``; ``None`` for ``etcd``).
    lifetime: HeartbeatLifetime | None = None
    #: What :func:`delete` removes: (key, recursive) pairs.
    keys: list[tuple[str, bool]] = field(default_factory=list)
    #: The prefix the run was found under (``etcd``: of its run directory; ``etcd-v2``:
    #: of its state key), to read it again.
    prefix: str = ""
    #: The run's state key and the node read from it (``None``: no state), which
    #: ``delete`` deletes first, only if it is unchanged.
    state_key: str = ""
    state: Node | None = field(default=None, repr=False)
    #: The keys among :attr:`keys` that ``delete`` deletes only if they are still as
    #: listed (by key): an ``etcd-v2`` run's keys in the shared store, whose names a job
    #: that takes the run id writes again (round 0's) while the rest is deleted.
    listed: dict[str, Node] = field(default_factory=dict, repr=False)
    #: When the run was read, by this process's monotonic clock.
    read_at: float = field(default_factory=time.monotonic, repr=False)

    @property
    def finished(self) -> bool:
        """Whether the run is over and quiet (see :class:`Verdict`)."""
        return self.verdict.finished

    @property
    def idle_seconds(self) -> float | None:
        """Seconds idle by etcd's clock, at least (see :attr:`Verdict.idle_seconds`)."""
        return self.verdict.idle_seconds

    @property
    def never_started(self) -> bool:
        """Whether the run was closed before any worker took part in it (as ``close
        --create`` leaves it): closed, no participant, no time, no version."""
        return (
            self.status == "closed"
            and self.world_size == 0
            and self.idle_seconds is None
            and self.version in (None, "0")
        )

    def as_dict(self) -> dict[str, Any]:
        """The summary as a dict for ``--json`` (keys as a list of key names)."""
        lifetime = self.lifetime
        return {
            "backend": self.backend,
            "run_id": self.run_id,
            "api": self.api,
            "status": self.status,
            "world_size": self.world_size,
            "version": self.version,
            "live": self.live,
            "idle_seconds": None if self.idle_seconds is None else round(self.idle_seconds, 1),
            "finished": self.finished,
            "closed": self.verdict.over,
            "quiet": self.verdict.quiet,
            "reason": self.verdict.reason,
            "heartbeat_lifetime": None if lifetime is None else dataclasses.asdict(lifetime),
            "keys": [key for key, _ in self.keys],
        }


# -- the etcd backend ------------------------------------------------------------------


def _named_version(state: Node | None) -> str | None:
    """The version a state node names, if it decodes far enough to tell."""
    if state is None or state.value is None:
        return None
    try:
        decoded = json.loads(state.value)
    except ValueError:
        return None
    version = decoded.get("version") if isinstance(decoded, dict) else None
    if isinstance(version, str) and version and "/" not in version:
        return version
    return None


def _version_dirs(conn: Transport, layout: LegacyLayout) -> tuple[Node, ...]:
    """Every ``rdzv/v_*`` directory of the run, each listed one level deep (a version's
    store ``kv`` is one child; its keys are not read one by one)."""
    names = [
        child.key
        for child in _children(conn, layout.rdzv_dir)
        if child.is_dir and _last_segment(child).startswith(_VERSION_DIR_PREFIX)
    ]
    listed = []
    for key in names:
        try:
            listed.append(conn.list_dir(key))
        except KeyNotFoundError:
            continue  # deleted since (with its keys)
    return tuple(listed)


def read_etcd_run(
    conn: Transport, prefix: str, run_id: str, *, member_ttls: bool = False
) -> EtcdRun:
    """Read, without changing anything, what describes the run in etcd; with the TTL of
    every key of the version directory if ``member_ttls`` (see
    :func:`~etcd_rendezvous.cli._common.read_dir`: on v3 a request per key)."""
    layout = LegacyLayout(prefix, run_id)
    run_dir = with_ttl(conn, conn.try_get(layout.run_dir))
    state = conn.try_get(layout.state_key)
    # On v3 a key written below the run dir without a TTL shares the run dir's lease:
    # it lives as long as the run dir, as on v2, and has no TTL of its own to show.
    shares_run_dir_lease = (
        state is not None
        and run_dir is not None
        and state.lease != 0
        and state.lease == run_dir.lease
    )
    if not shares_run_dir_lease:
        state = with_ttl(conn, state)
    version = _named_version(state)
    return EtcdRun(
        run_id=run_id,
        prefix=prefix,
        run_dir=run_dir,
        state=state,
        version_counter=conn.try_get(layout.counter_key),
        version_dir=(
            None
            if version is None
            else read_dir(conn, layout.version_dir(version), ttls=member_ttls)
        ),
        version_dirs=_version_dirs(conn, layout),
    )


def is_worker_key(key: str) -> bool:
    """Whether ``key`` is a live worker's key in a version directory of the ``etcd``
    backend (keep-alive, member or wait key)."""
    return (
        keep_alive_rank(key) is not None
        or member_name(key) is not None
        or waiter_name(key) is not None
    )


def list_etcd_runs(conn: Transport, prefix: str) -> list[str]:
    """The run ids of the ``etcd`` backend under ``prefix`` (``run_<id>`` directories)
    whose keys ``conn`` can name (see :func:`_nameable`)."""
    names = (_last_segment(child) for child in _children(conn, prefix))
    run_ids = (
        name[len(_RUN_DIR_PREFIX) :]
        for name in names
        if name.startswith(_RUN_DIR_PREFIX) and len(name) > len(_RUN_DIR_PREFIX)
    )
    return sorted(
        run_id for run_id in run_ids if _nameable(conn, LegacyLayout(prefix, run_id).run_dir)
    )


def _nameable(conn: Transport, key: str) -> bool:
    """Whether ``conn`` can name ``key`` in a request: over etcd's v2 API not a key that
    holds ``?``, ``#`` or ``%`` (written by another client), which a URL spells as another
    key (see :func:`~etcd_rendezvous._transport.v2_session.key_path`). Such a run is left
    out, with a warning naming its key: it can be neither read nor deleted over v2, and
    the others are listed."""
    if conn.api != "v2":
        return True
    try:
        key_path(key)
    except ValueError as exc:
        logger.warning("Leaving out a run whose key the v2 API cannot name: %s", exc)
        return False
    return True


def summarize_etcd(run: EtcdRun, api: str) -> RunSummary:
    """The :class:`RunSummary` of an ``etcd`` run."""
    layout = LegacyLayout(run.prefix, run.run_id)
    status, version, world = "none", None, 0
    if run.state is not None:
        try:
            state = parse_state(run.state)
        except RendezvousStateError:
            status = "invalid"
        else:
            status = state["status"]
            version = state.get("version")
            world = len(state.get("participants", []))
    # Workers write a joining state (setup, joinable, frozen) with a TTL: it is theirs.
    joining = run.state is not None and run.state.ttl is not None and status != "final"
    verdict = judge_etcd(status=status, worker_keys=run.worker_keys, joining=joining)
    return RunSummary(
        backend="etcd",
        run_id=run.run_id,
        api=api,
        status=status,
        world_size=world,
        version=version,
        live=run.worker_keys,
        verdict=verdict,
        keys=[(layout.run_dir, True)] if run.run_dir is not None else [(layout.state_key, False)],
        prefix=run.prefix,
        state_key=layout.state_key,
        state=run.state,
    )


# -- the etcd-v2 backend ---------------------------------------------------------------


def list_etcd_v2_run_ids(conn: Transport, state_prefix: str) -> list[str]:
    """The run ids of ``etcd-v2`` runs: the keys (not directories) directly below the
    state prefix, and the runs with a nodes directory (node keys, the aggregator lock,
    the progress key) but no state key left."""
    key_prefix = None if state_prefix == "/" else state_prefix
    run_ids = {
        _last_segment(child)
        for child in _children(conn, state_prefix)
        if not child.is_dir and _names_state_key(conn, child, key_prefix)
    }
    runs_dir = EtcdV2NodesLayout.runs_dir(key_prefix)
    for child in _children(conn, runs_dir):
        run_id = EtcdV2NodesLayout.run_id_of(_last_segment(child)) if child.is_dir else None
        if run_id is not None:
            run_ids.add(run_id)
    return sorted(
        run_id for run_id in run_ids if _nameable(conn, etcd_v2_state_key(run_id, key_prefix))
    )


def _names_state_key(conn: Transport, child: Node, key_prefix: str | None) -> bool:
    """Whether ``child``, a key right below the state prefix ``key_prefix``, is where
    the run named by its last segment keeps its state. Under the root the state key is
    the run id alone (PyTorch's spelling): etcd's v2 API stores it right below the root,
    its v3 API as it is, without a ``/``, so over v3 a key right below the root is
    another program's."""
    key = etcd_v2_state_key(_last_segment(child), key_prefix)
    return (normalize_key(key) if conn.api == "v2" else key) == child.key


def _children(conn: Transport, directory: str) -> tuple[Node, ...]:
    try:
        return conn.list_dir(normalize_key(directory)).children
    except KeyNotFoundError:
        return ()


def _last_segment(node: Node) -> str:
    return node.key.rstrip("/").rsplit("/", 1)[-1]


def _leaves(node: Node) -> list[Node]:
    if not node.is_dir:
        return [node]
    return [leaf for child in node.children for leaf in _leaves(child)]


def etcd_v2_store_keys(conn: Transport) -> dict[str, list[Node]]:
    """The keys of the shared ``etcd-v2`` store (as read) by the run they belong to: a
    key whose decoded name starts with ``torch.rendezvous.<run_id>.<round>/`` is
    ``run_id``'s (:func:`~etcd_rendezvous.layout.dynamic_store_round`). One recursive
    read."""
    store = normalize_key(ETCD_V2_STORE_PREFIX)
    try:
        listing = conn.list_dir(store, recursive=True)
    except KeyNotFoundError:
        return {}
    scope = dynamic_store_prefix("", 0).rsplit(".", 2)[0] + "."  # "torch.rendezvous."
    found: dict[str, list[Node]] = {}
    for leaf in _leaves(listing):
        encoded = normalize_key(leaf.key)[len(store) + 1 :]
        try:
            name = b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
        head = name.partition("/")[0]
        run_id = head[len(scope) :].rpartition(".")[0]
        if head.startswith(scope) and dynamic_store_round(head, run_id) is not None:
            found.setdefault(run_id, []).append(leaf)
    return found


def summarize_etcd_v2(
    run_id: str,
    backend: EtcdRendezvousBackend,
    conn: Transport,
    api: str,
    stated_lifetime: float | None = None,
) -> RunSummary:
    """The :class:`RunSummary` of an ``etcd-v2`` run (store keys not included: see
    :func:`etcd_v2_store_keys`), judged by the heartbeat lifetime its nodes published,
    or ``stated_lifetime`` if longer (see :func:`heartbeat_lifetime`)."""
    nodes_dir = backend.nodes_layout.nodes_dir
    # Every node key is a live node's, one leaving its round included.
    node_keys = len(backend.list_nodes())
    published, _, _ = backend.read_progress()
    state: RendezvousState | None
    current: tuple[bytes, object] | None = None
    try:
        current = backend.get_state()
        state = (
            None if current is None else decode_state(current[0], f"etcd-v2 key {backend.key!r}")
        )
        status = "none" if state is None else etcd_v2_status(state)
    except RendezvousStateError:
        state, status = None, "invalid"
    # The state node ``delete`` compare-and-deletes: the one judged here (by its index).
    # Its TTL (v2) is that of this read, which is never older than the one judged.
    state_node = conn.try_get(backend.key)
    if state_node is not None and current is not None:
        state_node = dataclasses.replace(state_node, modified_index=int(str(current[1])))
    elif status == "none":
        state_node = None  # a state written since it was read: not judged, not deleted
    lifetime = heartbeat_lifetime(
        None if published is None else published.lifetime, stated_lifetime
    )
    verdict = judge_etcd_v2(
        status=status,
        node_keys=node_keys,
        api=api,
        state_ttl=None if state_node is None else state_node.ttl,
        granted_ttl=backend.ttl,
        lifetime=lifetime,
    )
    keys = [(backend.key, False)]
    if _exists_below(conn, nodes_dir):  # node keys, the aggregator lock, the progress key
        keys.append((nodes_dir, True))
    return RunSummary(
        backend="etcd-v2",
        run_id=run_id,
        api=api,
        status=status,
        world_size=0 if state is None else len(state.participants),
        version=None if state is None else str(state.round),
        live=node_keys,
        verdict=verdict,
        lifetime=lifetime,
        keys=keys,
        prefix=backend.key.rpartition("/")[0] or "/",
        state_key=backend.key,
        state=state_node,
    )


def _exists_below(conn: Transport, directory: str) -> bool:
    """Whether ``directory`` (a v2 directory, a v3 prefix) holds anything."""
    try:
        return bool(conn.list_dir(directory).children)
    except KeyNotFoundError:
        return False


def etcd_v2_status(state: RendezvousState) -> str:
    """The status of an ``etcd-v2`` state: ``closed``, ``complete``, ``joining`` (some
    participants) or ``empty``."""
    if state.closed:
        return "closed"
    if state.complete:
        return "complete"
    return "joining" if state.participants else "empty"


def node_keys_report(backend: EtcdRendezvousBackend) -> list[dict[str, Any]]:
    """The ``etcd-v2`` node keys of our nodes, oldest first, with their marks."""
    return [
        {
            "node": f"{entry.node.addr}_{entry.node.pid}_{entry.node.local_id}",
            "created_index": entry.created_index,
            "leaving": entry.leaving,
        }
        for entry in backend.list_nodes()
    ]


def _v2_state_prefix(prefix: str | None) -> str:
    """The ``etcd-v2`` state prefix ``--prefix`` names, normalised ("" for the root)."""
    return normalize_key(prefix or ETCD_V2_STATE_PREFIX).rstrip("/")


def owns_store_keys(prefix: str | None) -> bool:
    """Whether ``etcd-v2`` runs under ``prefix`` may have their keys in the shared store
    deleted: only under the default prefix. The store is one for all prefixes and its
    keys name the run id alone, so under another prefix they may be another job's (the
    same run id under the default prefix)."""
    return _v2_state_prefix(prefix) == _v2_state_prefix(None)


def _etcd_v2_run(
    conn: Transport,
    prefix: str | None,
    run_id: str,
    store_keys: dict[str, list[Node]],
    stated_lifetime: float | None,
) -> RunSummary:
    state_prefix = _v2_state_prefix(prefix)
    backend = EtcdRendezvousBackend(conn, run_id, key_prefix=state_prefix or None)
    summary = summarize_etcd_v2(run_id, backend, conn, conn.api, stated_lifetime)
    for node in store_keys.get(run_id, ()):
        summary.keys.append((node.key, False))
        summary.listed[node.key] = node
    return summary


def read_run(
    conn: Transport,
    backend: str,
    prefix: str | None,
    run_id: str,
    *,
    store_keys: bool = True,
    stated_lifetime: float | None = None,
) -> RunSummary | None:
    """The :class:`RunSummary` of one run of ``backend`` under ``prefix`` (the
    backend's default when ``None``), with its store keys where :func:`owns_store_keys`
    allows (and ``store_keys``: they take a read of the whole store); ``None`` if etcd
    has no key of it (no run directory nor state; for ``etcd-v2``, no state key nor any
    key in its nodes directory: node keys, the aggregator lock, the progress key).
    ``stated_lifetime``: the operator's ``--heartbeat-lifetime``."""
    if backend == "etcd-v2":
        state_prefix = _v2_state_prefix(prefix)
        probe = EtcdRendezvousBackend(conn, run_id, key_prefix=state_prefix or None)
        if conn.try_get(probe.key) is None and not _exists_below(
            conn, probe.nodes_layout.nodes_dir
        ):
            return None
        found = etcd_v2_store_keys(conn) if store_keys and owns_store_keys(prefix) else {}
        return _etcd_v2_run(conn, prefix, run_id, found, stated_lifetime)
    etcd_run = read_etcd_run(conn, prefix or DEFAULT_PREFIX, run_id)
    if etcd_run.run_dir is None and etcd_run.state is None:
        return None
    return summarize_etcd(etcd_run, conn.api)


def find_runs(
    conn: Transport,
    backends: list[str],
    prefix: str | None,
    stated_lifetime: float | None = None,
) -> list[RunSummary]:
    """The runs of ``backends`` (``etcd``, ``etcd-v2``) under ``prefix`` (each backend's
    default prefix when ``None``), sorted by backend and run id; ``etcd-v2`` runs with
    their store keys where :func:`owns_store_keys` allows."""
    summaries = []
    if "etcd" in backends:
        legacy_prefix = prefix or DEFAULT_PREFIX
        for run_id in list_etcd_runs(conn, legacy_prefix):
            summaries.append(summarize_etcd(read_etcd_run(conn, legacy_prefix, run_id), conn.api))
    if "etcd-v2" in backends:
        store_keys = etcd_v2_store_keys(conn) if owns_store_keys(prefix) else {}
        for run_id in list_etcd_v2_run_ids(conn, _v2_state_prefix(prefix) or "/"):
            summaries.append(_etcd_v2_run(conn, prefix, run_id, store_keys, stated_lifetime))
    return summaries
