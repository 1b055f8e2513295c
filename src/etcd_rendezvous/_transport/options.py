"""Parsing of the backend options shared by the ``etcd`` and ``etcd-v2`` backends.

Values may arrive as strings (torchrun's ``--rdzv-conf key=value``) or as Python
values; every bad value raises :class:`ValueError` naming the option at fault.
"""

from __future__ import annotations

import logging
import math
import os

from ..api import Deadline, RendezvousParameters
from ..utils import parse_rendezvous_endpoints
from .connect import check_etcd_api, open_transport
from .interface import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SILENCE_TIMEOUT,
    Transport,
)

__all__ = [
    "DEFAULT_PORT",
    "PASSWORD_ENV",
    "create_etcd_connection",
    "etcd_password",
    "existing_file",
    "seconds",
]

logger = logging.getLogger(__name__)

#: The etcd client port used for endpoints that do not give one.
DEFAULT_PORT = 2379


def seconds(
    params: RendezvousParameters, key: str, default: float, *, allow_zero: bool = False
) -> float:
    """The option ``key`` as a number of seconds (``default`` if absent).

    Raises:
        ValueError: the value is not a number, is negative, or is zero and
            ``allow_zero`` is false; the message names ``key``.
    """
    value = params.get(key, default)
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected a number of seconds, got {value!r}.") from None
    if math.isnan(result) or result < 0 or (result == 0 and not allow_zero):
        raise ValueError(f"{key}: must be positive, got {value!r}.")
    return result


def existing_file(params: RendezvousParameters, key: str) -> str | None:
    """The option ``key`` as the path of an existing file, or ``None`` if absent or empty.

    Raises:
        ValueError: the path does not name an existing file; the message names ``key``.
    """
    path = params.get(key)
    if path is None or path == "":
        return None
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"{key}: {path!r} is not an existing file.")
    return path


#: The environment variable holding the etcd password when neither ``password`` nor
#: ``password_file`` is given (torchrun logs ``--rdzv-conf``, so a password given there
#: would be in the agent's log).
PASSWORD_ENV = "ETCD_RENDEZVOUS_PASSWORD"


def etcd_password(params: RendezvousParameters) -> str | None:
    """The etcd password: the ``password`` option, or else the first line of the file
    named by ``password_file``, or else the environment variable :data:`PASSWORD_ENV`
    (when ``username`` is given); ``None`` if there is none.

    Raises:
        ValueError: both ``password`` and ``password_file`` are given, or the file
            cannot be read or is empty; the message names the option (never the
            password).
    """
    password = params.get("password")
    path = params.get("password_file")
    if password is not None and path:
        raise ValueError("password, password_file: give one of them, not both.")
    if path:
        try:
            with open(str(path), encoding="utf-8") as file:
                first_line = file.readline().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"password_file: cannot read {str(path)!r}: {exc.strerror}.") from None
        if not first_line:
            raise ValueError(f"password_file: {str(path)!r} is empty.")
        return first_line
    if password is None and params.get("username") is not None:
        return os.environ.get(PASSWORD_ENV) or None
    return None if password is None else str(password)


def create_etcd_connection(
    params: RendezvousParameters,
    *,
    cert_option: str = "cert",
    key_option: str = "key",
    cacert_option: str = "cacert",
    deadline: Deadline | None = None,
    quorum_reads: bool = False,
) -> Transport:
    """Open the etcd connection described by ``params``, over the API it chooses.

    ``params.endpoint`` may list several endpoints, comma-separated. The options read
    are ``etcd_api`` (``auto``, ``v2`` or ``v3``; see :mod:`etcd_rendezvous._transport.connect`),
    ``protocol``, ``username``, ``password`` (or ``password_file``, or the environment
    variable :data:`PASSWORD_ENV`: see :func:`etcd_password`), ``read_timeout``,
    ``connect_timeout``, ``request_timeout``, ``silence_timeout`` and the TLS files, whose
    option names differ between backends (``cert``/``key``/``cacert`` for ``etcd``,
    ``ssl_cert``/``ssl_cert_key``/``ca_cert`` for ``etcd-v2``) and are given by the
    ``*_option`` arguments. ``quorum_reads``: see
    :class:`~etcd_rendezvous._transport.interface.Transport`.

    The server is asked once which API it serves, for at most ``connect_timeout``
    seconds and never past ``deadline`` (the caller's, e.g. the rendezvous timeout):
    an endpoint that refuses or never answers is reported within that time.

    Raises:
        ValueError: an option or the endpoint list is invalid; the message names it.
        RendezvousConnectionError: etcd cannot be reached, or does not serve the API
            ``etcd_api`` insists on.
    """
    etcd_api = check_etcd_api(params.get("etcd_api", "auto"))
    endpoints = parse_rendezvous_endpoints(params.endpoint, DEFAULT_PORT)
    protocol, cert, key, cacert = _tls_options(params, cert_option, key_option, cacert_option)
    username, password = _credentials(params)
    read_timeout = seconds(params, "read_timeout", DEFAULT_READ_TIMEOUT)
    connect_timeout = seconds(params, "connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    request_timeout = seconds(params, "request_timeout", DEFAULT_REQUEST_TIMEOUT)
    silence_timeout = seconds(params, "silence_timeout", DEFAULT_SILENCE_TIMEOUT)
    probe = Deadline(connect_timeout) if deadline is None else deadline.earliest(connect_timeout)
    return open_transport(
        endpoints,
        etcd_api=etcd_api,
        protocol=protocol,
        cert=cert,
        key=key,
        cacert=cacert,
        username=username,
        password=password,
        read_timeout=read_timeout,
        connect_timeout=connect_timeout,
        request_timeout=request_timeout,
        silence_timeout=silence_timeout,
        quorum_reads=quorum_reads,
        deadline=probe,
    )


def _tls_options(
    params: RendezvousParameters, cert_option: str, key_option: str, cacert_option: str
) -> tuple[str, str | None, str | None, str | None]:
    """The protocol and the TLS files (under the backend's option names):
    ``(protocol, cert, key, cacert)``."""
    protocol = str(params.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"protocol: the etcd protocol must be http or https, got {protocol!r}.")
    cert = existing_file(params, cert_option)
    key = existing_file(params, key_option)
    cacert = existing_file(params, cacert_option)
    if key is not None and cert is None:
        raise ValueError(f"{key_option}: a client key needs a client certificate ({cert_option}).")
    if protocol == "http" and (cert or cacert):
        logger.warning(
            "%s/%s are ignored with protocol=http; did you mean https?", cert_option, cacert_option
        )
    return protocol, cert, key, cacert


def _credentials(params: RendezvousParameters) -> tuple[str | None, str | None]:
    """``(username, password)``: both or neither (see :func:`etcd_password`)."""
    username = params.get("username")
    password = etcd_password(params)
    if (username is None) != (password is None):
        missing = "password" if password is None else "username"
        raise ValueError(f"{missing}: username and password must be given together.")
    return (
        None if username is None else str(username),
        None if password is None else str(password),
    )
