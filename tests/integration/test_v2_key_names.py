"""Keys that a URL of etcd's v2 API cannot name, against a real etcd.

Over the v2 API a key is the path of a URL, sent as it is (as PyTorch's client sends
it): a ``?`` or ``#`` ends the key there, a ``%`` starts an escape, a ``.`` or ``..``
segment names a directory above. A run id holding one would read and write another
run's keys: every request on such a key is refused with a ``ValueError`` that names it,
before anything is sent.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import ETCD_V2_STATE_PREFIX, LegacyLayout, etcd_v2_state_key
from etcd_rendezvous.registry import get_rendezvous_handler

pytestmark = pytest.mark.v2_only(reason="the v2 API carries a key in the URL's path")

ALIASES = [
    pytest.param(lambda run_id: run_id + "?x", "'?'", id="query"),
    pytest.param(lambda run_id: run_id + "#x", "'#'", id="fragment"),
    pytest.param(lambda run_id: run_id.replace("-", "%2D"), "'%'", id="escape"),
]


@pytest.mark.parametrize(("alias", "culprit"), ALIASES)
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_handler_whose_run_id_a_v2_url_spells_as_another_run_is_refused(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    conn: Transport,
    backend: str,
    alias: Callable[[str], str],
    culprit: str,
) -> None:
    """A handler of run ``<victim>?x`` would read and write run ``<victim>``'s state
    (the rest is a query): making it raises, naming the key and the character, and the
    victim's state is as it was."""
    victim = f"victim-{uuid.uuid4().hex[:8]}"
    if backend == "etcd":
        state_key = LegacyLayout(etcd_prefix, victim).state_key
    else:
        state_key = etcd_v2_state_key(victim, ETCD_V2_STATE_PREFIX)
    written = conn.set(state_key, "the victim's state")
    params = RendezvousParameters(
        backend,
        etcd_server.get_endpoint(),
        alias(victim),
        1,
        1,
        etcd_api="v2",
        etcd_prefix=etcd_prefix,
        local_addr="127.0.0.1",
        torch_store="false",
    )
    with pytest.raises(ValueError, match=f"key '.*{re.escape(alias(victim))}.*': holds {culprit}"):
        get_rendezvous_handler(params)
    now = conn.get(state_key)
    assert (now.value, now.modified_index) == ("the victim's state", written.modified_index)


@pytest.mark.parametrize("prefix", ["/a?b", "/a#b", "/a%2Fb"])
def test_a_store_whose_prefix_no_v2_url_names_is_refused(conn: Transport, prefix: str) -> None:
    """A store below such a prefix would write elsewhere: its first request raises,
    naming the key. (A store's prefix is cleaned of ``.`` and ``..`` segments, as etcd
    cleans a key.)"""
    store = EtcdStore(conn, prefix)
    with pytest.raises(ValueError, match=r"key '/a"):
        store.set("k", b"v")
