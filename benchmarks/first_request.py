"""Print the call chain from ``next_rendezvous()`` to the first etcd request.

Usage::

    python benchmarks/first_request.py [--backend etcd|etcd-v2] [--etcd-api v2|v3]

One node joins a fresh run on a throw-away etcd; at the first HTTP request its thread
sends (urllib3's ``urlopen``, which python-etcd and the v3 transport both end in), the
stack is taken. Printed: each call from the handler's ``next_rendezvous()`` down to the
first call that leaves the package (python-etcd's or urllib3's), with its file, then
the number of calls and the turn-backs (a call into a module already on the chain
above, after another module: ``a → b → a``), in all and down to the transport's
interface (the first call into ``_transport/``). See docs/architecture.rst, "From
next_rendezvous() to the first request".
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
import uuid
from pathlib import Path

import urllib3.connectionpool

from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.registry import get_rendezvous_handler

_PACKAGE = str(Path(__import__("etcd_rendezvous").__file__).parent)


class _FirstRequest(BaseException):
    """Raised at the first request, to stop the rendezvous there."""

    def __init__(self, stack: traceback.StackSummary) -> None:
        super().__init__("first request")
        self.stack = stack


def _chain(stack: traceback.StackSummary) -> list[tuple[str, str]]:
    """``(file, function)`` of each call from ``next_rendezvous`` to the first call
    that leaves the package (inclusive)."""
    frames = list(stack)
    start = max(i for i, f in enumerate(frames) if f.name == "next_rendezvous")
    chain = []
    for frame in frames[start:]:
        inside = frame.filename.startswith(_PACKAGE)
        where = os.path.relpath(frame.filename, _PACKAGE) if inside else frame.filename
        chain.append((where, frame.name))
        if not inside:
            break
    return chain


def _turn_backs(chain: list[tuple[str, str]]) -> int:
    """Calls into a module already left higher up the chain."""
    seen: list[str] = []
    turns = 0
    for where, _ in chain:
        if seen and where == seen[-1]:
            continue
        turns += where in seen
        seen.append(where)
    return turns


def main() -> None:
    """Join one node, stop it at its first request and print the chain."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("etcd", "etcd-v2"), default="etcd-v2")
    parser.add_argument("--etcd-api", choices=("v2", "v3"), default="v2")
    args = parser.parse_args()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with EtcdServer() as server:
        params = RendezvousParameters(
            backend=args.backend,
            endpoint=server.get_endpoint(),
            run_id=f"chain-{uuid.uuid4().hex[:8]}",
            min_nodes=2,
            max_nodes=2,
            local_addr="127.0.0.1",
            etcd_api=args.etcd_api,
            torch_store="false",
            timeout="10",
            join_timeout="10",
        )
        handler = get_rendezvous_handler(params)
        joining = threading.current_thread()
        original = urllib3.connectionpool.HTTPConnectionPool.urlopen

        def urlopen(self: object, *a: object, **kw: object) -> object:
            stack = traceback.extract_stack()
            if threading.current_thread() is joining and any(
                f.name == "next_rendezvous" for f in stack
            ):
                raise _FirstRequest(stack)
            return original(self, *a, **kw)  # type: ignore[arg-type]

        urllib3.connectionpool.HTTPConnectionPool.urlopen = urlopen  # type: ignore[method-assign]
        try:
            handler.next_rendezvous()
            raise SystemExit("next_rendezvous() returned without a request")
        except _FirstRequest as first:
            chain = _chain(first.stack)
        finally:
            urllib3.connectionpool.HTTPConnectionPool.urlopen = original  # type: ignore[method-assign]
            handler.close()  # type: ignore[attr-defined]
    print(f"{args.backend} over the {args.etcd_api} API:")
    for where, name in chain:
        print(f"  {name:<28} {where}")
    files = {where for where, _ in chain[:-1]}
    # The calls down to the transport's interface (the first call into _transport/).
    entry = next(i for i, (where, _) in enumerate(chain) if where.startswith("_transport"))
    above = chain[: entry + 1]
    print(
        f"{len(chain) - 1} calls in {len(files)} files of the package, "
        f"{_turn_backs(chain)} turn-backs; to the transport's interface: {entry} calls in "
        f"{len({where for where, _ in above[:-1]})} files, {_turn_backs(above)} turn-backs"
    )


if __name__ == "__main__":
    sys.exit(main())
