"""Parsing of rendezvous endpoints and configuration strings.

Ported from ``torch.distributed.elastic.rendezvous.utils`` with the same semantics and
messages, plus :func:`parse_rendezvous_endpoints` for comma-separated etcd cluster lists.
"""

from __future__ import annotations

import re

__all__ = ["parse_rendezvous_endpoint", "parse_rendezvous_endpoints"]


def _parse_rendezvous_config(config_str: str) -> dict[str, str]:
    """Extract key-value pairs from a rendezvous configuration string.

    This is the format of torchrun's ``--rdzv-conf``; values stay strings.

    Args:
        config_str: A string in format <key1>=<value1>,...,<keyN>=<valueN>.

    Raises:
        ValueError: A key is empty, or a key has no value.
    """
    config: dict[str, str] = {}

    config_str = config_str.strip()
    if not config_str:
        return config

    for kv in config_str.split(","):
        key, *values = kv.split("=", 1)

        key = key.strip()
        if not key:
            raise ValueError(
                "The rendezvous configuration string must be in format "
                "<key1>=<value1>,...,<keyN>=<valueN>."
            )

        value = values[0].strip() if values else None
        if not value:
            raise ValueError(
                f"The rendezvous configuration option '{key}' must have a value specified."
            )

        config[key] = value
    return config


def _try_parse_port(port_str: str) -> int | None:
    """Try to extract the port number from ``port_str``."""
    if port_str and re.match(r"^[0-9]{1,5}$", port_str):
        return int(port_str)
    return None


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """Extract the hostname and the port number from a rendezvous endpoint.

    An empty or missing endpoint means ``localhost``. IPv6 addresses must be written
    in brackets (``[::1]:2379``); the brackets are stripped from the result.

    Args:
        endpoint: A string in format <hostname>[:<port>].
        default_port: The port number to use if the endpoint does not include one.

    Returns:
        A tuple of hostname and port number.

    Raises:
        ValueError: The port or the hostname is malformed; the message names the
            endpoint.
    """
    if endpoint is not None:
        endpoint = endpoint.strip()

    if not endpoint:
        return ("localhost", default_port)

    # An endpoint that starts and ends with brackets represents an IPv6 address.
    rest: list[str]
    if endpoint[0] == "[" and endpoint[-1] == "]":
        host, rest = endpoint, []
    else:
        host, *rest = endpoint.rsplit(":", 1)

    # Sanitize the IPv6 address.
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]

    if len(rest) == 1:
        port = _try_parse_port(rest[0])
        if port is None or port >= 2**16:
            raise ValueError(
                f"The port number of the rendezvous endpoint '{endpoint}' must be an integer "
                "between 0 and 65536."
            )
    else:
        port = default_port

    if not re.match(r"^[\w\.:-]+$", host):
        raise ValueError(
            f"The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated list "
            "of labels, an IPv4 address, or an IPv6 address."
        )

    return host, port


def parse_rendezvous_endpoints(endpoints: str | None, default_port: int) -> list[tuple[str, int]]:
    """Parse a comma-separated list of rendezvous endpoints, such as an etcd cluster.

    Each entry is parsed by :func:`parse_rendezvous_endpoint`, so ``host1:2379,
    [::1]:2379, host3`` is accepted. Like the single-endpoint parser, an empty or
    missing list means ``[("localhost", default_port)]``.

    Args:
        endpoints: A string in format <hostname>[:<port>],...,<hostname>[:<port>].
        default_port: The port number to use for entries that do not include one.

    Returns:
        The (hostname, port) tuples, in the order given.

    Raises:
        ValueError: An entry is empty (``"a,,b"`` or a trailing comma), or an entry is
            malformed; the message names the entry.
    """
    if endpoints is None or not endpoints.strip():
        return [("localhost", default_port)]

    parsed: list[tuple[str, int]] = []
    for position, entry in enumerate(endpoints.split(","), start=1):
        if not entry.strip():
            raise ValueError(
                f"The rendezvous endpoint list '{endpoints}' has an empty entry at position "
                f"{position}."
            )
        parsed.append(parse_rendezvous_endpoint(entry, default_port))
    return parsed
