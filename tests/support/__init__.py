"""Helpers shared by the unit and integration tests (``tests/conftest.py`` holds the
shared fixtures).

* :mod:`support.wait`: :func:`~support.wait.wait_until` (poll a condition under a
  monotonic deadline) and the waits that watch an etcd key.
* :mod:`support.transports`: the etcd APIs a transport test runs on, and the transport of each.
* :mod:`support.net`, :mod:`support.processes`: closed ports, a process's state.
* :mod:`support.faultproxy`: a TCP proxy that injects network faults.
* :mod:`support.etcd_requests`: counting etcd's requests from its ``/metrics`` page.
* :mod:`support.v3_gateway`: raw calls to etcd's v3 JSON gateway.
* :mod:`support.history`: making etcd forget its history (v2 events, v3 compaction).
* :mod:`support.rdzv`, :mod:`support.torchrun`: worker processes and torchrun agents.
* :mod:`support.cli`: the command line, run as a process or in the test's own.
* :mod:`support.threads`: one call in several threads at once.
* :mod:`support.events`, :mod:`support.tls_certs`: event logs, test certificates.

The scripts the tests run as processes live in ``support/scripts/``; their paths are
:data:`RDZV_WORKER`, :data:`TORCHRUN_WORKER`, :data:`TORCH_PG_WORKER` and :data:`EVENT_AGENT`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EVENT_AGENT", "RDZV_WORKER", "SCRIPTS", "TORCHRUN_WORKER", "TORCH_PG_WORKER"]

#: The folder of the scripts the tests start as processes.
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: A rendezvous worker driven over stdin/stdout (:class:`support.rdzv.Worker`).
RDZV_WORKER = SCRIPTS / "rdzv_worker.py"
#: The training script torchrun agents run (:class:`support.torchrun.Agent`).
TORCHRUN_WORKER = SCRIPTS / "torchrun_worker.py"
#: A worker that joins a torch process group over a ``TorchEtcdStore``.
TORCH_PG_WORKER = SCRIPTS / "torch_pg_worker.py"
#: torchrun's ``main()`` with an event handler that writes events to a file.
EVENT_AGENT = SCRIPTS / "event_agent.py"
