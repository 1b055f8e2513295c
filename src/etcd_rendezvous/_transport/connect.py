"""Choosing the etcd API: the one place that decides between the v2 and v3 transports.

``etcd_api`` is ``auto`` (the default), ``v2`` or ``v3``:

* ``auto`` asks the server once, when the connection is opened: v2 where the server
  serves the v2 API (etcd 3.4/3.5 started with ``--enable-v2``), so a fleet mixing
  PyTorch's workers and ours keeps meeting on the same keys; v3 where it does not
  (etcd 3.6, or 3.4/3.5 without ``--enable-v2``). The choice is logged.
* ``v2`` / ``v3`` insist, and fail at once with an error naming the option and the
  server's version if the server does not serve that API.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..api import Deadline, RendezvousConnectionError
from .interface import ETCD_APIS, ConnectionOptions, Transport
from .v2 import EtcdConnection
from .v3 import EtcdV3Connection

if TYPE_CHECKING:
    from typing_extensions import Unpack  # Python 3.10 has no typing.Unpack

__all__ = ["ETCD_APIS", "as_transport", "check_etcd_api", "open_transport"]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


def check_etcd_api(value: Any, option: str = "etcd_api") -> str:
    """``value`` as one of ``auto``, ``v2``, ``v3`` (``None`` or empty: ``auto``).

    Raises:
        ValueError: anything else; the message names ``option``.
    """
    text = str(value).strip().lower() if value is not None else ""
    text = text or "auto"  # empty, as from ``--rdzv-conf etcd_api=``, means absent
    if text not in ETCD_APIS:
        raise ValueError(f"{option}: must be one of auto, v2, v3; got {value!r}.")
    return text


def as_transport(client: Any, *, param: str = "client") -> Transport:
    """``client`` as a transport: a :class:`~etcd_rendezvous._transport.interface.Transport`
    as it is, a python-etcd ``etcd.Client`` as a hardened v2 connection with the same
    endpoints and credentials (:meth:`EtcdConnection.from_client
    <etcd_rendezvous._transport.v2.EtcdConnection.from_client>`; ``client`` is not
    modified, and the caller owns the new connection).

    Raises:
        TypeError: ``client`` is neither; the message names ``param``, the caller's
            name for it.
        ValueError: an endpoint of ``client`` cannot be parsed.
    """
    if isinstance(client, Transport):
        return client
    return EtcdConnection.from_client(client, param=param)


def open_transport(
    endpoints: Sequence[Endpoint],
    *,
    etcd_api: str = "auto",
    deadline: Deadline | None = None,
    **options: Unpack[ConnectionOptions],
) -> Transport:
    """Open a connection to the etcd cluster at ``endpoints`` over the chosen API, with
    ``options`` (:class:`~etcd_rendezvous._transport.interface.Transport`'s).

    The server is asked which APIs it serves (one ``GET /version`` and one
    ``GET /v2/keys/``) within ``deadline`` (default: ``connect_timeout`` plus one
    attempt per endpoint). The caller owns the returned transport and closes it.

    Raises:
        ValueError: an option is invalid; the message names it.
        RendezvousConnectionError: no endpoint answered, or the server does not serve
            the API that ``etcd_api`` insists on.
    """
    api = check_etcd_api(etcd_api)
    probe = EtcdV3Connection(endpoints, **options)
    try:
        deadline = deadline if deadline is not None else Deadline(probe.connect_timeout)
        version, serves_v2 = probe.probe(deadline)
        _check_served(probe, api, version, serves_v2, deadline)
        chosen = api if api != "auto" else "v2" if serves_v2 else "v3"
    except BaseException:
        probe.close()
        raise
    logger.info(
        "etcd %s at %s: using the %s API%s",
        version,
        ", ".join(probe.endpoints),
        chosen,
        " (etcd_api=auto)" if api == "auto" else "",
    )
    if chosen == "v3":
        return probe
    probe.close()
    return EtcdConnection(endpoints, **options)


def _check_served(
    probe: EtcdV3Connection, api: str, version: str, serves_v2: bool, deadline: Deadline
) -> None:
    """Refuse an ``etcd_api`` the server does not serve, naming the option and version."""
    endpoint = ", ".join(probe.endpoints)
    if api == "v2" and not serves_v2:
        raise RendezvousConnectionError(
            f"etcd_api=v2, but etcd {version} at {endpoint} does not serve the v2 API "
            "(etcd 3.6 removed it; 3.4/3.5 serve it only with --enable-v2). Use "
            "etcd_api=v3 or auto."
        )
    if api == "v3" and not probe.gateway_available(deadline):
        raise RendezvousConnectionError(
            f"etcd_api=v3, but etcd {version} at {endpoint} does not serve the v3 API's "
            "JSON gateway (etcd 3.4 or later does, unless started with "
            "--enable-grpc-gateway=false). Use etcd_api=v2 or auto."
        )
