"""Following every run in etcd: one watch stream per prefix, and each run read again
when its keys change.

The :class:`Follower` owns two kinds of threads: one per watch stream (the ``etcd``
backend's prefix; the ``etcd-v2`` state keys and their nodes directories), which only
note which run changed, and one reader, which reads a changed run again (through
:mod:`etcd_rendezvous.cli._runs`, as ``list`` and ``status`` do) and folds the read into
its :class:`~etcd_rendezvous.cli._dashboard.model.RunRecord`. A burst of changes to one
run (a rendezvous forming) costs one read per :data:`SETTLE_SECONDS`, not one per change.

The streams are opened "from now" before the runs are listed and read, so no change
falls between the read and the watch. When a stream breaks (etcd unreachable, or its
history gone), the follower says so (:attr:`Snapshot.error`), keeps what it last saw,
and starts again: streams opened, every run read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...api import Deadline, RendezvousError
from ...etcd_rendezvous_backend import EtcdRendezvousBackend
from ...layout import DEFAULT_PREFIX, ETCD_V2_STATE_PREFIX, EtcdV2NodesLayout, normalize_key
from .._common import Transport, WatchStream
from .._runs import (
    list_etcd_runs,
    list_etcd_v2_run_ids,
    read_etcd_run,
    read_run,
    summarize_etcd,
)
from ..status import describe_etcd_run, etcd_v2_report
from .model import RunRead, RunRecord, observe

__all__ = ["RETRY_SECONDS", "SETTLE_SECONDS", "Follower", "Snapshot", "Source"]

logger = logging.getLogger(__name__)

#: The least time between two reads of one run: changes in between are read together.
SETTLE_SECONDS = 0.5
#: How long the follower waits before starting again after etcd failed it.
RETRY_SECONDS = 2.0
#: How long a stream thread waits for a change at a time. Closing the stream wakes it;
#: etcd unreachable for the connection's read timeout fails it (and so is reported).
_WAIT_SECONDS = 3600.0

RunKey = tuple[str, str]  # (backend, run id)


@dataclass(frozen=True)
class Source:
    """The runs of one backend under one prefix."""

    backend: str
    #: ``etcd``: the prefix of the run directories; ``etcd-v2``: of the state keys.
    prefix: str

    @classmethod
    def default(cls, backend: str, prefix: str | None = None) -> Source:
        """The source of ``backend`` under ``prefix`` (the backend's default if ``None``)."""
        fallback = DEFAULT_PREFIX if backend == "etcd" else ETCD_V2_STATE_PREFIX
        return cls(backend, normalize_key(prefix or fallback))

    def watched(self) -> tuple[str, ...]:
        """The keys to watch (recursively): everything of this source's runs."""
        if self.backend == "etcd":
            return (self.prefix,)
        return (self.prefix, EtcdV2NodesLayout.runs_dir(self._state_prefix))

    @property
    def _state_prefix(self) -> str | None:
        return None if self.prefix == "/" else self.prefix

    def run_of(self, key: str) -> str | None:
        """The run id whose key ``key`` is (``None``: not a run's key)."""
        key = normalize_key(key)
        if self.backend == "etcd":
            rest = _below(key, self.prefix)
            head = rest.split("/", 1)[0] if rest else ""
            return head[len("run_") :] if head.startswith("run_") and len(head) > 4 else None
        rest = _below(key, self.prefix)
        if rest and "/" not in rest:
            return rest
        rest = _below(key, EtcdV2NodesLayout.runs_dir(self._state_prefix))
        return EtcdV2NodesLayout.run_id_of(rest.split("/", 1)[0]) if rest else None

    def run_ids(self, conn: Transport) -> list[str]:
        """Every run of this source in etcd."""
        if self.backend == "etcd":
            return list_etcd_runs(conn, self.prefix)
        return list_etcd_v2_run_ids(conn, self.prefix)

    def read(self, conn: Transport, run_id: str) -> RunRead | None:
        """Read run ``run_id`` (``None``: etcd has no key of it)."""
        if self.backend == "etcd":
            run = read_etcd_run(conn, self.prefix, run_id)
            if run.run_dir is None and run.state is None:
                return None
            report = describe_etcd_run(run)
            report["api"] = conn.api
            return RunRead(summarize_etcd(run, conn.api), report)
        summary = read_run(conn, "etcd-v2", self.prefix, run_id, store_keys=False)
        if summary is None:
            return None
        backend = EtcdRendezvousBackend(conn, run_id, key_prefix=self._state_prefix)
        v2_report = etcd_v2_report(conn, backend, summary)
        # No state (node keys left): an empty report.
        return RunRead(summary, v2_report or {"backend": "etcd-v2", "run_id": run_id})


def _below(key: str, prefix: str) -> str:
    """What follows ``prefix/`` in ``key`` ("" if ``key`` is not below ``prefix``)."""
    start = prefix.rstrip("/") + "/"
    return key[len(start) :] if key.startswith(start) else ""


@dataclass(frozen=True)
class Snapshot:
    """What the follower knows at one moment (a consistent copy for one page)."""

    records: dict[RunKey, RunRecord]
    #: Why etcd cannot be followed now (``None``: it is being followed).
    error: str | None
    #: Since when (monotonic) the error holds.
    error_since: float | None
    #: When the runs were last all read (monotonic; ``None``: not yet).
    synced: float | None
    sources: tuple[Source, ...] = field(default=())


class Follower:
    """Keeps a :class:`RunRecord` of every run of ``sources``, following etcd.

    Owns its threads and watch streams (not ``conn``): :meth:`start` starts them,
    :meth:`close` stops them; both idempotent.
    """

    def __init__(
        self,
        conn: Transport,
        sources: tuple[Source, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._conn = conn
        self._sources = sources
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._records: dict[RunKey, RunRecord] = {}
        self._dirty: set[RunKey] = set()
        self._broken: str | None = "starting"
        self._error: str | None = None
        self._error_since: float | None = None
        self._synced: float | None = None
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start following (in the background)."""
        with self._lock:
            if self._reader is not None or self._closed:
                return
            self._reader = threading.Thread(
                target=self._read_loop, name="etcd-rendezvous-dashboard-reader", daemon=True
            )
        self._reader.start()

    def close(self) -> None:
        """Stop every thread and close the watch streams."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            reader = self._reader
        if reader is not None:
            reader.join()

    def snapshot(self) -> Snapshot:
        """A copy of what is known now."""
        with self._lock:
            return Snapshot(
                dict(self._records), self._error, self._error_since, self._synced, self._sources
            )

    # -- the reader ---------------------------------------------------------------------

    def _read_loop(self) -> None:
        streams: list[tuple[threading.Thread, WatchStream]] = []
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    broken = self._broken
                if broken is not None:
                    _close_all(streams)
                    streams = self._restart()
                    continue
                self._read_changed()
        finally:
            _close_all(streams)

    def _restart(self) -> list[tuple[threading.Thread, WatchStream]]:
        """Open the streams, then read every run; on failure say why and wait."""
        streams: list[tuple[threading.Thread, WatchStream]] = []
        try:
            for source in self._sources:
                for key in source.watched():
                    stream = self._conn.watch_stream(key, 0, recursive=True)
                    thread = threading.Thread(
                        target=self._watch_loop,
                        args=(source, stream),
                        name=f"etcd-rendezvous-dashboard-watch {key}",
                        daemon=True,
                    )
                    streams.append((thread, stream))
                    thread.start()
            found = {
                (source.backend, run_id): source
                for source in self._sources
                for run_id in source.run_ids(self._conn)
            }
            with self._lock:
                self._dirty.clear()
                self._broken = None
                self._records = {k: v for k, v in self._records.items() if k in found}
            for (_, run_id), source in found.items():
                self._read_one(source, run_id)
        except RendezvousError as exc:
            self._fail(f"cannot follow etcd at {', '.join(self._conn.endpoints)}: {exc}")
            _close_all(streams)
            with self._lock:
                self._wake.wait_for(lambda: self._closed, RETRY_SECONDS)
            return []
        with self._lock:
            self._synced = self._clock()
            self._error = self._error_since = None
        return streams

    def _read_changed(self) -> None:
        """Wait for a change, let a burst settle, then read the runs that changed."""
        with self._lock:
            self._wake.wait_for(lambda: self._closed or self._broken or self._dirty)
            if self._closed or self._broken:
                return
        with self._lock:
            self._wake.wait_for(lambda: self._closed, SETTLE_SECONDS)
            dirty, self._dirty = self._dirty, set()
        by_backend = {source.backend: source for source in self._sources}
        try:
            for backend, run_id in sorted(dirty):
                self._read_one(by_backend[backend], run_id)
        except RendezvousError as exc:
            self._fail(f"cannot read etcd at {', '.join(self._conn.endpoints)}: {exc}")

    def _read_one(self, source: Source, run_id: str) -> None:
        key = (source.backend, run_id)
        try:
            read = source.read(self._conn, run_id)
        except ValueError as exc:  # a run id no key can spell
            logger.debug("Skipping run %r: %s", run_id, exc)
            return
        now = self._clock()
        with self._lock:
            if read is None:
                self._records.pop(key, None)
            else:
                self._records[key] = observe(self._records.get(key), read, now)

    def _fail(self, why: str) -> None:
        logger.warning("%s", why)
        with self._lock:
            self._broken = why
            if self._error is None:
                self._error, self._error_since = why, self._clock()
            else:
                self._error = why
            self._wake.notify_all()

    # -- the stream threads ---------------------------------------------------------------

    def _watch_loop(self, source: Source, stream: WatchStream) -> None:
        """Note the run of each change ``stream`` delivers, until it is closed or fails."""
        try:
            while not stream.closed:
                change = stream.next(Deadline(_WAIT_SECONDS), give_up_after=self._conn.read_timeout)
                run_id = None if change is None else source.run_of(change.key)
                if run_id is not None:
                    with self._lock:
                        self._dirty.add((source.backend, run_id))
                        self._wake.notify_all()
        except RendezvousError as exc:
            if not stream.closed:
                self._fail(
                    f"lost the watch on {stream.key} at {', '.join(self._conn.endpoints)}: {exc}"
                )


def _close_all(streams: list[tuple[threading.Thread, WatchStream]]) -> None:
    """Close ``streams`` and wait for their threads to end."""
    for _, stream in streams:
        stream.close()
    for thread, _ in streams:
        thread.join()
