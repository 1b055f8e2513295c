"""What the processes of a scenario write down: one JSON object a line.

Every node process (``chaos.node``) appends to ``node-<name>.jsonl`` in the scenario's
folder, and the runner (``chaos.runner``) to ``runner.jsonl``. A record is written and
flushed before the next step, so a node killed with SIGKILL loses nothing it did
before. The checker (``chaos.checker``) reads nothing else.

Fields every record has:

``t``
    ``time.monotonic()`` of the writing process. Linux has one monotonic clock for
    the whole machine and libfaketime leaves it alone
    (``FAKETIME_DONT_FAKE_MONOTONIC=1``), so the times of all processes compare,
    whatever clock offset a node runs with.
``ev``
    What happened (below).

A node's records (``node`` is its name, ``call`` numbers its ``next_rendezvous()``
calls from 1):

``start``        ``node``, ``pid``, ``impl`` (``ours``/``torch``), ``backend``, ``run_id``,
                 ``timeout`` (of ``next_rendezvous()``), ``store_timeout``
``create_error`` creating the handler failed: ``error``, ``named``, ``message``
``join_start``   ``call``: ``next_rendezvous()`` is called now
``joined``       ``call``, ``round`` (legacy: the version), ``rank``, ``world_size``,
                 ``elapsed``
``join_error``   ``call``, ``error`` (class name), ``named`` (a ``RendezvousError`` or
                 PyTorch's ``RendezvousError``), ``closed`` (the run is closed),
                 ``message``, ``elapsed``
``world``        ``round``, ``members`` (the node name each rank wrote into the round's
                 store, by rank), ``conflict`` (another node had already claimed this
                 node's rank in this round's store)
``stored``       ``round``, ``key``: a value written through the round's store
``step``         ``round``, ``k``: the ``k``-th barrier of the round passed (every rank
                 added itself to one counter)
``step_failed``  ``round``, ``k``: the barrier did not pass within the step timeout
``overflow``     ``round``, ``k``, ``count``: the barrier counter went past the world
                 size (a rank added twice, or two worlds share the round's store)
``lost``         ``round``, ``key``: a value stored in this round reads as missing
``op_error``     ``op`` (``store.set``, ``num_nodes_waiting``, ...), ``round``,
                 ``error``, ``named``, ``message``, ``elapsed``, ``timeout``
``waiting``      ``round``, ``n``: ``num_nodes_waiting()`` said ``n`` > 0; the node
                 re-rendezvouses, as torchrun's agent does
``stop``         the runner asked the node to end
``shutdown``     ``result`` (of ``shutdown()``), ``error``, ``elapsed``
``leaks``        ``threads``: the names of the threads alive 3 s after ``shutdown()``
                 (``close()`` for a node that leaves) besides the main thread and the
                 node's own; ``threads_after_close``: the same after ``close()``;
                 ``sockets``: ``host:port STATE`` of the TCP connections to the node's
                 etcd endpoints still ESTABLISHED after ``close()``;
                 ``sockets_after_gc``: those left (in any state) once the node dropped
                 the handler and ran the garbage collector
``exit``         the node's last record

The runner's records:

``scenario``     ``scenario``: the scenario as generated (``Scenario.as_dict()``)
``etcd``         ``endpoints``, ``client_urls``, ``api``, ``version``
``begin``        the scenario's start (the nodes' start times count from it); ``bound``
                 (the liveness bound, seconds) and ``bound_terms``
``proc``         ``node``, ``pid``, ``impl``, ``members`` (the etcd members it was
                 given): a node process (or torchrun agent) was started
``fault``        ``id``, ``index`` (in the scenario's list), ``kind``, ``target``,
                 ``params`` (with what was done: the member, the key and the value it
                 held), ``end`` (when it is to be undone; ``None``: never)
``recovered``    ``id``, ``kind``, ``target``: a fault with a duration was undone
``fault_failed`` / ``undo_failed``: the runner could not do it (``error``)
``command``      ``kind``, ``args``, ``t0`` (its start; ``t`` is its end), ``rc``,
                 ``stdout``, ``stderr``, ``report`` (the JSON of ``delete``/``gc``)
``state``        each new value of the run's state key: ``present``, ``size`` and, for
                 ``etcd-v2``, ``round``, ``complete``, ``closed``, ``participants``
                 (``addr_pid_id`` -> rank), ``wait_list``, ``redundancy_list``,
                 ``heartbeats``; for ``etcd``, ``status``, ``version``, ``participants``
                 (how many), ``keep_alives``, ``waiting``
``faults_over``  ``T_f``: every fault injected and every timed one undone
``hung``         ``node``, ``waited``, ``last`` (its last record): a node that did not
                 end within its bounds once asked to stop (then killed)
``proc_end``     ``node``, ``rc``, ``killed`` (by a fault or the runner), ``stderr``
                 (the tail of its output)
``leases``       ``leases``: every v3 lease once the nodes ended (``id``, ``ttl``,
                 ``keys``, ``pids``: the nodes whose keys it holds)
``end``          ``reason``: why the runner ended the scenario
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Recorder", "read_all", "read_records"]


class Recorder:
    """Appends records to one JSON-lines file, each flushed before the call returns."""

    def __init__(self, path: Path, **common: Any) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())
        self._common = common
        self._lock = threading.Lock()

    def __call__(self, ev: str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.monotonic(), "ev": ev, **self._common, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one file; a last line cut short by a kill is left out."""
    with open(path) as fh:
        for line in fh:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def read_all(folder: Path) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """The runner's records and every node's, by node name, from a scenario's folder."""
    runner = list(read_records(folder / "runner.jsonl"))
    nodes: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("node-") and name.endswith(".jsonl"):
            nodes[name[len("node-") : -len(".jsonl")]] = list(read_records(folder / name))
    return runner, nodes
