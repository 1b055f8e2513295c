"""What an etcd process is made of, for :mod:`.member`: ports, flags, signals, log, probe.

Free loopback ports, the flags each etcd release accepts, stopping a process, reading
its log, and the readiness probe. The probe speaks only what every etcd since 3.4
serves with or without the v2 API (the v3 JSON gateway, ``/health`` and ``/version``),
so it works on etcd 3.6, which has no v2 API at all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import urllib3

__all__ = [
    "ADDRESS_IN_USE",
    "HOST",
    "REMOVED_FLAGS",
    "NotReadyError",
    "ProbeTimeoutError",
    "ProcessExitedError",
    "binary_version",
    "continue_process",
    "free_ports",
    "has_v2_api",
    "last_lines",
    "member_status",
    "probe_member",
    "read_log_from",
    "removed_flag_problem",
    "request_json",
    "stop_process",
    "terminate",
    "unknown_flag_problem",
    "v2_flags",
    "wait_ready",
]

logger = logging.getLogger(__name__)

#: The only address the local servers listen on.
HOST = "127.0.0.1"
#: What etcd logs when another process holds one of its ports.
ADDRESS_IN_USE = re.compile(r"address already in use", re.IGNORECASE)


class ProcessExitedError(Exception):
    """etcd exited while we waited for it to answer."""


class NotReadyError(Exception):
    """One readiness probe failed; the message says how."""


class ProbeTimeoutError(Exception):
    """The deadline passed before a probe succeeded; the message is the last problem."""


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct loopback TCP ports that were free a moment ago.

    All sockets are bound before any is released, so the ports differ from each other.
    Another process may still take one before etcd binds it: callers look for
    :data:`ADDRESS_IN_USE` in etcd's log and try again with new ports.
    """
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((HOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


#: etcd's flags that are gone from a release on, with what to do instead. etcd 3.7
#: dropped every ``--experimental-*`` flag (3.6 had deprecated them for
#: ``--feature-gates`` or a name without the prefix).
REMOVED_FLAGS: tuple[tuple[str, tuple[int, int], str], ...] = (
    ("--enable-v2", (3, 6), "etcd 3.6 has no v2 API; use the v3 API (enable_v2=False)"),
    ("--experimental-enable-v2v3", (3, 6), "etcd 3.6 has no v2 API"),
    ("--experimental-", (3, 7), "use its name without --experimental- or --feature-gates"),
)
#: What etcd prints (and exits 2) when given a flag it does not know.
_UNKNOWN_FLAG = re.compile(r"flag provided but not defined: -+([\w.-]+)")
_VERSION_LINE = re.compile(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)")
_versions: dict[tuple[str, float], tuple[int, int, int] | None] = {}


def binary_version(binary: str) -> tuple[int, int, int] | None:
    """The release of the etcd ``binary`` (from ``etcd --version``); ``None`` if unknown.

    Asked once per binary (and modification time): etcd answers in a few milliseconds.
    """
    try:
        key = (binary, os.stat(binary).st_mtime)
    except OSError:
        return None
    if key not in _versions:
        try:
            result = subprocess.run(
                [binary, "--version"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
                check=False,
            )
            match = _VERSION_LINE.search(result.stdout.decode(errors="replace"))
        except (OSError, subprocess.TimeoutExpired):
            match = None
        _versions[key] = None if match is None else (int(match[1]), int(match[2]), int(match[3]))
    return _versions[key]


def has_v2_api(binary: str) -> bool:
    """Whether etcd ``binary`` can serve the v2 API: releases before 3.6 (or unknown)."""
    version = binary_version(binary)
    return version is None or version[:2] < (3, 6)


def removed_flag_problem(binary: str, args: Sequence[str]) -> str | None:
    """Why etcd ``binary`` would refuse one of ``args`` as a removed flag, or ``None``.

    The message names the flag, the server's version and what to do instead.
    """
    version = binary_version(binary)
    if version is None:
        return None
    for arg in args:
        flag = arg.split("=", 1)[0]
        for removed, since, instead in REMOVED_FLAGS:
            matches = flag.startswith(removed) if removed.endswith("-") else flag == removed
            if matches and version[:2] >= since:
                release = ".".join(map(str, version))
                return (
                    f"etcd {release} ({binary}) does not accept {flag}: it was removed in "
                    f"etcd {since[0]}.{since[1]} ({instead})"
                )
    return None


def unknown_flag_problem(binary: str, output: str) -> str | None:
    """The flag etcd ``binary`` refused at start-up, as a message; ``None`` if none.

    ``output`` is what etcd printed before it exited.
    """
    match = _UNKNOWN_FLAG.search(output)
    if match is None:
        return None
    version = binary_version(binary)
    release = "" if version is None else " " + ".".join(map(str, version))
    return f"etcd{release} ({binary}) does not accept the flag --{match[1]} (unknown to it)"


def v2_flags(enable_v2: bool) -> list[str]:
    """etcd's arguments for serving the v2 API or not.

    Without v2 the flag is left out rather than set to false: v2 is off by default
    since etcd 3.4, and etcd 3.6 no longer knows the flag (it refuses to start).
    """
    return ["--enable-v2=true"] if enable_v2 else []


def last_lines(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])


def read_log_from(path: str, offset: int = 0) -> str:
    """The text of the log file ``path`` from byte ``offset``; ``""`` if it is gone."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


#: How long :func:`stop_process` / :func:`continue_process` wait for the kernel to act.
_SIGNAL_WAIT = 5.0


def _is_stopped(pid: int) -> bool | None:
    """Whether ``pid`` is stopped (state ``T``/``t`` in ``/proc``); ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The state follows the command name, which is in parentheses.
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return None


def _signal_and_wait(pid: int, signum: int, *, stopped: bool) -> None:
    """Send ``signum`` to ``pid``; return once its state says ``stopped`` (or is unknown).

    A signal is delivered asynchronously: without the wait, a request sent right after
    SIGSTOP may still be answered, and a test of a hung member would not test one.
    """
    os.kill(pid, signum)
    deadline = time.monotonic() + _SIGNAL_WAIT
    while _is_stopped(pid) not in (stopped, None):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"etcd (pid {pid}) is still {'running' if stopped else 'stopped'} "
                f"{_SIGNAL_WAIT:g} s after signal {signal.Signals(signum).name}."
            )
        time.sleep(0.001)


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel has stopped it."""
    _signal_and_wait(pid, signal.SIGSTOP, stopped=True)


def continue_process(pid: int) -> None:
    """SIGCONT ``pid`` and wait until it runs again."""
    _signal_and_wait(pid, signal.SIGCONT, stopped=False)


def terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM ``proc`` (waking it if stopped), SIGKILL it after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        # A SIGSTOPped process only acts on SIGTERM once continued.
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("etcd (pid %d) ignored SIGTERM for %.1fs; killing it", proc.pid, grace)
            proc.kill()
    proc.wait()


def wait_ready(
    proc: subprocess.Popen[bytes],
    deadline: float,
    probe: Callable[[urllib3.Timeout], str],
) -> str:
    """Call ``probe`` until it succeeds; return what it returns.

    Raises:
        ProcessExitedError: if ``proc`` exits first.
        ProbeTimeoutError: if the monotonic ``deadline`` passes first.
    """
    delay = 0.005
    last_problem = "no answer yet"
    while True:
        if proc.poll() is not None:
            raise ProcessExitedError
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProbeTimeoutError(last_problem)
        # Short: a port thief that accepts but never answers must not stall us; a
        # slow etcd just gets asked again.
        request_timeout = urllib3.Timeout(connect=min(0.5, remaining), read=min(1.0, remaining))
        try:
            return probe(request_timeout)
        except NotReadyError as exc:
            last_problem = str(exc)
        # Wait for the process to exit or for the next poll, whichever is first.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)


def request_json(
    pool: urllib3.PoolManager,
    method: str,
    url: str,
    timeout: urllib3.Timeout,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send one probe request; return the JSON object of a 200 answer.

    Raises:
        NotReadyError: on a connection error, any other status, or a body that is not
            a JSON object; the message names the request.
    """
    what = f"{method} {url}"
    encoded = None if body is None else json.dumps(body).encode()
    try:
        with warnings.catch_warnings():
            # Without a CA a probe cannot verify the server; the warning is noise here.
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            response = pool.request(method, url, body=encoded, timeout=timeout)
    except urllib3.exceptions.HTTPError as exc:
        raise NotReadyError(f"{what}: {exc}") from exc
    if response.status == 404 and "/v2/" in url:
        raise NotReadyError(f"{what}: 404 (is the v2 API enabled?)")
    if response.status != 200:
        raise NotReadyError(f"{what}: HTTP {response.status}")
    try:
        decoded = json.loads(response.data)
    except ValueError as exc:
        raise NotReadyError(f"{what}: not JSON: {response.data[:200]!r}") from exc
    if not isinstance(decoded, dict):
        raise NotReadyError(f"{what}: not a JSON object: {response.data[:200]!r}")
    return decoded


def member_status(
    pool: urllib3.PoolManager, base_url: str, timeout: urllib3.Timeout
) -> tuple[str, str | None, int]:
    """Ask the member at ``base_url`` for ``POST /v3/maintenance/status``.

    Returns:
        The id of the member that answered, the id of the leader it knows (``None``
        if it knows none: etcd leaves out a zero ``leader``), and its raft term. The
        gateway gives these 64-bit numbers as decimal strings.

    Raises:
        NotReadyError: if the member does not answer, or answers something else.
    """
    url = base_url + "/v3/maintenance/status"
    status = request_json(pool, "POST", url, timeout, {})
    header = status.get("header")
    member_id = header.get("member_id") if isinstance(header, dict) else None
    if not isinstance(member_id, str):
        raise NotReadyError(f"POST {url}: no header.member_id in {status!r}")
    leader = str(status.get("leader") or "0")
    try:
        term = int(status.get("raftTerm") or 0)
    except (TypeError, ValueError):
        raise NotReadyError(f"POST {url}: raftTerm is not a number in {status!r}") from None
    return member_id, (None if leader == "0" else leader), term


def probe_member(
    pool: urllib3.PoolManager,
    base_url: str,
    name: str,
    timeout: urllib3.Timeout,
    enable_v2: bool,
) -> str:
    """Check that the etcd at ``base_url`` is ready; return its version.

    Ready means: it is the member called ``name`` (after a port race the port may be
    answered by somebody else's etcd), it knows a leader, ``GET /health`` says it
    serves requests and, with ``enable_v2``, ``GET /v2/keys/`` answers.

    Raises:
        NotReadyError: naming the first check that failed.
    """
    members = request_json(pool, "POST", base_url + "/v3/cluster/member/list", timeout, {})
    header = members.get("header")
    member_id = header.get("member_id") if isinstance(header, dict) else None
    listed = members.get("members")
    answered_by = next(
        (
            member.get("name")
            for member in (listed if isinstance(listed, list) else [])
            if isinstance(member, dict) and member.get("ID") == member_id
        ),
        None,
    )
    if answered_by != name:
        raise NotReadyError(f"{base_url} is answered by another etcd ({answered_by!r})")
    if member_status(pool, base_url, timeout)[1] is None:
        raise NotReadyError(f"{base_url}: no leader elected yet")
    health = request_json(pool, "GET", base_url + "/health", timeout)
    if health.get("health") != "true":
        raise NotReadyError(f"GET {base_url}/health: {health!r}")
    if enable_v2:
        request_json(pool, "GET", base_url + "/v2/keys/", timeout)
    version = request_json(pool, "GET", base_url + "/version", timeout).get("etcdserver")
    if not isinstance(version, str):
        raise NotReadyError(f"GET {base_url}/version: no etcdserver version")
    return version
