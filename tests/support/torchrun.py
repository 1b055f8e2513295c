"""Start ``torchrun`` agents (``python -m torch.distributed.run``) on localhost for tests.

Each :class:`Agent` is one "node": a torchrun process whose workers run
``scripts/torchrun_worker.py``. :meth:`Agent.kill_node` SIGKILLs the agent and every process it
started, as when a machine is lost (torchrun starts its workers in sessions of their
own, so killing the agent alone would leave them running).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from support import TORCHRUN_WORKER
from support.wait import wait_until

WORKER = TORCHRUN_WORKER


class Agent:
    """One ``torchrun`` process, its output in ``<out>/agent-<name>.log``."""

    def __init__(
        self,
        name: str,
        out: Path,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        nproc_per_node: int,
        rdzv_conf: Mapping[str, object],
        max_restarts: int = 0,
        steps: int = 3,
        step_seconds: float = 0.0,
        env: Mapping[str, str] | None = None,
        launcher: list[str] | None = None,
        monitor_interval: float = 0.2,
        script: Sequence[str] | None = None,
    ) -> None:
        """``script``: the training script and its arguments, instead of
        ``scripts/torchrun_worker.py`` with ``--out``, ``--steps`` and
        ``--step-seconds``."""
        self.name = name
        self.log_path = out / f"agent-{name}.log"
        conf = ",".join(f"{key}={value}" for key, value in rdzv_conf.items())
        command = [
            *(launcher or [sys.executable, "-m", "torch.distributed.run"]),
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval}",
            "--local-addr=127.0.0.1",
            *(
                script
                or [
                    str(WORKER),
                    f"--out={out}",
                    f"--steps={steps}",
                    f"--step-seconds={step_seconds}",
                ]
            ),
        ]
        child_env = dict(os.environ)
        # The tests of other modules opt out of TCPStore sharing; here torchrun decides.
        child_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        child_env.update({"TEST_AGENT_ID": name, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})

        child_env.update(env or {})
        self.command = command
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )

    def wait(self, timeout: float) -> int:
        """The agent's exit code; raises ``AssertionError`` with its log on timeout."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"torchrun agent {self.name} still running after {timeout} s\n{self.log()}"
            ) from None

    def log(self, tail: int = 80) -> str:
        """The last ``tail`` lines of the agent's output."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def kill_node(self) -> list[int]:
        """SIGKILL the agent, then all its descendants; returns the pids killed."""
        descendants = _descendants(self.process.pid)
        os.kill(self.process.pid, signal.SIGKILL)
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)
        return [self.process.pid, *descendants]

    def signal_node(self, sig: int) -> list[int]:
        """Send ``sig`` (SIGSTOP, SIGCONT, ...) to the agent and all its descendants;
        returns their pids."""
        pids = [self.process.pid, *_descendants(self.process.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def stop(self) -> None:
        """Kill whatever is left of the agent and its workers (test cleanup)."""
        if self.process.poll() is None:
            self.kill_node()


def _descendants(pid: int) -> list[int]:
    """The pids of all living descendants of ``pid`` (read from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may contain spaces.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


class AgentExitedError(AssertionError):
    """An agent exited with an error while a test waited on something else."""


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, agents: list[Agent]) -> None:
    """:func:`~support.wait.wait_until` ``predicate``, failing at once if an agent exits
    with an error, and with the agents' logs if the time runs out."""

    def ready() -> bool:
        for agent in agents:
            if agent.process.poll() not in (None, 0):
                raise AgentExitedError(
                    f"agent {agent.name} exited with {agent.process.returncode} while waiting "
                    f"for {what}\n{agent.log()}"
                )
        return predicate()

    try:
        wait_until(ready, timeout, what)
    except AgentExitedError:
        raise
    except AssertionError as timed_out:
        logs = "\n".join(f"--- agent {a.name} ---\n{a.log()}" for a in agents)
        raise AssertionError(f"{timed_out}\n{logs}") from None
