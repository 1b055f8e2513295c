"""The runs under a prefix, read without changing anything: what ``list``, ``status``,
``delete`` and ``gc`` know about a run.

A run of the ``etcd`` backend is the directory ``<prefix>/run_<run_id>``
(:class:`~etcd_rendezvous.layout.LegacyLayout`); a run of ``etcd-v2`` is its state key
``<prefix>/<run_id>``, the directory of its node keys
(:class:`~etcd_rendezvous.layout.EtcdV2NodesLayout`) and its rounds' keys in the shared
store (:func:`~etcd_rendezvous.layout.dynamic_store_prefix`).

A run is *finished* when no worker is left in it, whatever its status
(:func:`run_finished`): no key of a live worker (keep-alive, member, wait or node key),
nobody joining (a state with a TTL, which workers write while they join; for ``etcd``,
``num_workers_waiting`` of a final state, as PyTorch's waiting workers write no key)
and, for ``etcd-v2``, no recent heartbeat (:func:`heartbeat_is_live`). A closed run is
not finished while its workers still run: the first worker to finish closes it while
the others may still be in their exit barrier, using the run's keys. Only a finished run
may be deleted without ``--force``.
"""

from __future__ import annotations

import binascii
import dataclasses
import json
from base64 import b64decode
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

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
    keep_alive_rank,
    member_name,
    normalize_key,
    waiter_name,
)
from ._common import KeyNotFoundError, Node, Transport, read_dir, with_ttl

__all__ = [
    "CLOCK_SKEW_MARGIN_SECONDS",
    "HEARTBEAT_LIVE_SECONDS",
    "EtcdRun",
    "RunSummary",
    "etcd_v2_store_keys",
    "find_runs",
    "heartbeat_is_live",
    "is_worker_key",
    "list_etcd_runs",
    "list_etcd_v2_run_ids",
    "node_keys_report",
    "owns_store_keys",
    "read_etcd_run",
    "read_run",
    "run_finished",
    "summarize_etcd",
    "summarize_etcd_v2",
]

#: A heartbeat of an ``etcd-v2`` node younger than this says the run is alive
#: (PyTorch's default keep-alive is every 5 s, 3 attempts).
HEARTBEAT_LIVE_SECONDS = 60.0
#: Heartbeat times are the workers' clocks, compared with the operator's: a heartbeat
#: counts as recent for this much longer, so that an operator's clock running ahead
#: of the workers' by less than this does not make a live run look finished.
CLOCK_SKEW_MARGIN_SECONDS = 60.0
_RUN_DIR_PREFIX = "run_"


@dataclass(frozen=True)
class EtcdRun:
    """The etcd nodes that describe a run of the ``etcd`` backend (each ``None`` when
    missing)."""

    run_id: str
    prefix: str
    run_dir: Node | None
    state: Node | None
    version_counter: Node | None
    #: ``rdzv/v_<version>`` of the version the state names: its ``rank_<r>``,
    #: ``node_<hex>`` and ``wait_<hex>`` children are the keys of live workers.
    version_dir: Node | None


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
    #: Keys of live workers (``etcd``) or nodes with a recent heartbeat or a node key
    #: (``etcd-v2``).
    live: int
    #: Seconds since the newest sign of life etcd holds a time for (``etcd-v2``
    #: heartbeats); ``None`` where etcd keeps no time (the ``etcd`` backend).
    idle_seconds: float | None
    finished: bool
    #: What :func:`delete` removes: (key, recursive) pairs.
    keys: list[tuple[str, bool]] = field(default_factory=list)
    #: The prefix the run was found under (``etcd``: of its run directory; ``etcd-v2``:
    #: of its state key), to read it again.
    prefix: str = ""
    #: The run's state key and the node read from it (``None``: no state), which
    #: ``delete`` deletes first, only if it is unchanged.
    state_key: str = ""
    state: Node | None = field(default=None, repr=False)

    @property
    def never_started(self) -> bool:
        """Whether the run was closed before any worker took part in it (as ``close
        --create`` leaves it): closed, no participant, no heartbeat, no version."""
        return (
            self.status == "closed"
            and self.world_size == 0
            and self.idle_seconds is None
            and self.version in (None, "0")
        )

    def as_dict(self) -> dict[str, Any]:
        """The summary as a dict for ``--json`` (keys as a list of key names)."""
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
            "keys": [key for key, _ in self.keys],
        }


def heartbeat_is_live(age_seconds: float) -> bool:
    """Whether a heartbeat ``age_seconds`` old (by the operator's clock) says its node is
    alive: younger than :data:`HEARTBEAT_LIVE_SECONDS` plus
    :data:`CLOCK_SKEW_MARGIN_SECONDS` (a negative age, from a clock behind the workers',
    is recent)."""
    return age_seconds < HEARTBEAT_LIVE_SECONDS + CLOCK_SKEW_MARGIN_SECONDS


def run_finished(*, live: int, joining: bool, waiting: int = 0) -> bool:
    """Whether a run is finished: no live worker key or recent heartbeat (``live``),
    nobody joining, and no worker waiting (``waiting``: ``num_workers_waiting`` of an
    ``etcd`` final state). The status does not count: a closed run may still have
    workers in their exit barrier."""
    return live == 0 and not joining and waiting == 0


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


def read_etcd_run(conn: Transport, prefix: str, run_id: str) -> EtcdRun:
    """Read, without changing anything, what describes the run in etcd."""
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
        version_dir=None if version is None else read_dir(conn, layout.version_dir(version)),
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
    """The run ids of the ``etcd`` backend under ``prefix`` (``run_<id>`` directories)."""
    try:
        listing = conn.list_dir(normalize_key(prefix))
    except KeyNotFoundError:
        return []
    names = (child.key.rstrip("/").rsplit("/", 1)[-1] for child in listing.children)
    return sorted(
        name[len(_RUN_DIR_PREFIX) :]
        for name in names
        if name.startswith(_RUN_DIR_PREFIX) and len(name) > len(_RUN_DIR_PREFIX)
    )


def summarize_etcd(run: EtcdRun, api: str) -> RunSummary:
    """The :class:`RunSummary` of an ``etcd`` run."""
    layout = LegacyLayout(run.prefix, run.run_id)
    children = () if run.version_dir is None else run.version_dir.children
    live = sum(1 for child in children if is_worker_key(child.key))
    status, version, world, waiting = "none", None, 0, 0
    if run.state is not None:
        try:
            state = parse_state(run.state)
        except RendezvousStateError:
            status = "invalid"
        else:
            status = state["status"]
            version = state.get("version")
            world = len(state.get("participants", []))
            if status == "final":
                waiting = int(state.get("num_workers_waiting", 0))
    # Workers write a joining state (setup, joinable, frozen) with a TTL: it is theirs.
    joining = run.state is not None and run.state.ttl is not None and status != "final"
    finished = run_finished(live=live, joining=joining, waiting=waiting)
    return RunSummary(
        backend="etcd",
        run_id=run.run_id,
        api=api,
        status=status,
        world_size=world,
        version=version,
        live=live,
        idle_seconds=None,
        finished=finished,
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
    run_ids = {_last_segment(child) for child in _children(conn, state_prefix) if not child.is_dir}
    runs_dir = EtcdV2NodesLayout.runs_dir(None if state_prefix == "/" else state_prefix)
    for child in _children(conn, runs_dir):
        run_id = EtcdV2NodesLayout.run_id_of(_last_segment(child)) if child.is_dir else None
        if run_id is not None:
            run_ids.add(run_id)
    return sorted(run_ids)


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


def etcd_v2_store_keys(conn: Transport) -> dict[str, list[str]]:
    """The keys of the shared ``etcd-v2`` store by the run they belong to: a key whose
    decoded name starts with ``torch.rendezvous.<run_id>.<round>/`` is ``run_id``'s
    (:func:`~etcd_rendezvous.layout.dynamic_store_round`). One recursive read."""
    store = normalize_key(ETCD_V2_STORE_PREFIX)
    try:
        listing = conn.list_dir(store, recursive=True)
    except KeyNotFoundError:
        return {}
    scope = dynamic_store_prefix("", 0).rsplit(".", 2)[0] + "."  # "torch.rendezvous."
    found: dict[str, list[str]] = {}
    for leaf in _leaves(listing):
        encoded = normalize_key(leaf.key)[len(store) + 1 :]
        try:
            name = b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
        head = name.partition("/")[0]
        run_id = head[len(scope) :].rpartition(".")[0]
        if head.startswith(scope) and dynamic_store_round(head, run_id) is not None:
            found.setdefault(run_id, []).append(leaf.key)
    return found


def summarize_etcd_v2(
    run_id: str,
    backend: EtcdRendezvousBackend,
    conn: Transport,
    api: str,
    now: datetime | None = None,
) -> RunSummary:
    """The :class:`RunSummary` of an ``etcd-v2`` run (store keys not included: see
    :func:`etcd_v2_store_keys`)."""
    now = now or datetime.now(timezone.utc)
    nodes_dir = backend.nodes_layout.nodes_dir
    node_keys = [n for n in backend.list_nodes() if n.leaving is None]
    state: RendezvousState | None
    current: tuple[bytes, object] | None = None
    try:
        current = backend.get_state()
        state = (
            None if current is None else decode_state(current[0], f"etcd-v2 key {backend.key!r}")
        )
        status = "empty" if state is None else _v2_status(state)
    except RendezvousStateError:
        state, status = None, "invalid"
    # The state node ``delete`` compare-and-deletes: the one judged here (by its index).
    state_node = conn.try_get(backend.key)
    if state_node is not None and current is not None:
        state_node = dataclasses.replace(state_node, modified_index=int(str(current[1])))
    elif state is None and status != "invalid":
        state_node = None  # a state written since it was read: not judged, not deleted
    idle: float | None = None
    recent = 0
    if state is not None and state.last_heartbeats:
        ages = [(now - beat).total_seconds() for beat in state.last_heartbeats.values()]
        idle = max(0.0, min(ages))
        recent = sum(1 for age in ages if heartbeat_is_live(age))
    live = max(len(node_keys), recent)
    keys = [(backend.key, False)]
    if _exists_below(conn, nodes_dir):  # node keys, the aggregator lock
        keys.append((nodes_dir, True))
    return RunSummary(
        backend="etcd-v2",
        run_id=run_id,
        api=api,
        status=status,
        world_size=0 if state is None else len(state.participants),
        version=None if state is None else str(state.round),
        live=live,
        idle_seconds=idle,
        # Joining nodes write heartbeats (and node keys): they count in ``live``.
        finished=run_finished(live=live, joining=False),
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


def _v2_status(state: RendezvousState) -> str:
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
    conn: Transport, prefix: str | None, run_id: str, store_keys: dict[str, list[str]]
) -> RunSummary:
    state_prefix = _v2_state_prefix(prefix)
    backend = EtcdRendezvousBackend(conn, run_id, key_prefix=state_prefix or None)
    summary = summarize_etcd_v2(run_id, backend, conn, conn.api)
    summary.keys.extend((key, False) for key in store_keys.get(run_id, ()))
    return summary


def read_run(
    conn: Transport, backend: str, prefix: str | None, run_id: str, *, store_keys: bool = True
) -> RunSummary | None:
    """The :class:`RunSummary` of one run of ``backend`` under ``prefix`` (the
    backend's default when ``None``), with its store keys where :func:`owns_store_keys`
    allows (and ``store_keys``: they take a read of the whole store); ``None`` if etcd
    has no key of it (no run directory nor state; for ``etcd-v2``, no state key nor any
    key in its nodes directory: node keys, the aggregator lock, the progress key)."""
    if backend == "etcd-v2":
        state_prefix = _v2_state_prefix(prefix)
        probe = EtcdRendezvousBackend(conn, run_id, key_prefix=state_prefix or None)
        if conn.try_get(probe.key) is None and not _exists_below(
            conn, probe.nodes_layout.nodes_dir
        ):
            return None
        found = etcd_v2_store_keys(conn) if store_keys and owns_store_keys(prefix) else {}
        return _etcd_v2_run(conn, prefix, run_id, found)
    etcd_run = read_etcd_run(conn, prefix or DEFAULT_PREFIX, run_id)
    if etcd_run.run_dir is None and etcd_run.state is None:
        return None
    return summarize_etcd(etcd_run, conn.api)


def find_runs(conn: Transport, backends: list[str], prefix: str | None) -> list[RunSummary]:
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
            summaries.append(_etcd_v2_run(conn, prefix, run_id, store_keys))
    return summaries
