"""Keys that a URL of etcd's v2 API cannot name, against a real etcd.

Over the v2 API a key is the path of a URL, sent as it is (as PyTorch's client sends
it): a ``?`` or ``#`` ends the key there, a ``%`` starts an escape, a ``.`` or ``..``
segment names a directory above. A run id holding one would read and write another
run's keys: every request on such a key is refused with a ``ValueError`` that names it,
before anything is sent.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Callable

import pytest

from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import RendezvousParameters
from etcd_rendezvous.etcd_server import EtcdServer
from etcd_rendezvous.etcd_store import EtcdStore
from etcd_rendezvous.layout import ETCD_V2_STATE_PREFIX, LegacyLayout, etcd_v2_state_key
from etcd_rendezvous.registry import get_rendezvous_handler
from support.cli import run_main

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


@pytest.mark.parametrize(
    ("backend", "run_key", "foreign"),
    [
        pytest.param(
            "etcd", "run_{}/rdzv/active_version", "run_a%3Fb/rdzv/active_version", id="etcd"
        ),
        pytest.param("etcd-v2", "{}", "a%2541b", id="etcd-v2"),
    ],
)
def test_a_run_whose_key_no_v2_url_names_is_left_out_of_the_listing(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    conn: Transport,
    backend: str,
    run_key: str,
    foreign: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another client (etcdctl, a Go program, PyTorch's worker with an escape in its run
    id) wrote a key below the runs' prefix whose name holds a ``?`` or a ``%`` (escaped
    in its URL): no request of ours can name it over v2. ``list`` (``gc`` and the
    dashboard list the same way) leaves that run out, with a warning naming its key, and
    lists the others; it raised a ``ValueError`` and listed nothing."""
    run_id = f"named-{uuid.uuid4().hex[:8]}"
    conn.set(f"{etcd_prefix}/{run_key.format(run_id)}", "{}")
    url = f"{etcd_server.client_url}/v2/keys{etcd_prefix}/{foreign}"
    request = urllib.request.Request(url, data=b"value=x", method="PUT")
    request.add_header("Content-Type", "application/x-www-form-urlencoded")
    with urllib.request.urlopen(request, timeout=10) as answer:
        written = json.load(answer)["node"]["key"]
    assert "%" in written or "?" in written, written
    args = ["--endpoint", etcd_server.get_endpoint(), "--backend", backend]
    code, out, err = run_main(capsys, "list", *args, "--prefix", etcd_prefix, "--json")
    assert code == 0, err
    assert [run["run_id"] for run in json.loads(out)] == [run_id]
    assert written.rsplit("/rdzv/", 1)[0] in caplog.text
