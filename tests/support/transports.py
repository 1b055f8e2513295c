"""The etcd APIs a transport test runs on (the ``api`` fixture's parameters)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous._transport.v2 import EtcdConnection
from etcd_rendezvous._transport.v3 import EtcdV3Connection

__all__ = ["APIS", "TRANSPORTS", "V2", "V3", "Connect", "only_v2"]

#: The ``connect`` fixture's type: ``connect(*endpoints, **kwargs)`` -> a connection.
Connect = Callable[..., Transport]
#: The transport class of each API.
TRANSPORTS: dict[str, Callable[..., Transport]] = {"v2": EtcdConnection, "v3": EtcdV3Connection}
#: v2 runs only where the server serves it (the ``v2_only`` mark skips it on v3-only etcd).
V2 = pytest.param("v2", marks=pytest.mark.v2_only(reason="the v2 transport"), id="v2")
V3 = pytest.param("v3", id="v3")
APIS = [V2, V3]
#: For a test whose subject exists on v2 only: run it with the v2 transport alone.
only_v2 = pytest.mark.parametrize("api", [V2], indirect=True)
