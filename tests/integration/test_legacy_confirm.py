"""The legacy backend's confirmation of a frozen version against a real etcd, when
another of our members confirms first and its hint comes late (or never).

A state frozen by a PyTorch worker lists no keep-alive key: our lowest-ranked
unconfirmed member confirms all of ours, and the others take over after the grace
(:func:`~etcd_rendezvous._legacy.admission.grace`), leaving the lower ranks out. One
that takes over just as the lower one's confirmation lands finds itself confirmed
already: it must stay in the version, not start over.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from etcd_rendezvous._legacy.feed import StateFeed
from etcd_rendezvous._legacy.join import BatchJoin
from etcd_rendezvous._legacy.lease_keeper import LeaseKeeper
from etcd_rendezvous._legacy.state import parse_state
from etcd_rendezvous._transport.interface import Transport
from etcd_rendezvous.api import Deadline
from etcd_rendezvous.layout import LegacyLayout, new_member_name
from support.wait import wait_until

PREFIX = "/torchelastic/p2p"


def test_a_member_confirmed_by_a_lower_one_while_it_takes_over_stays_in_the_version(
    run_id: str, conn: Transport
) -> None:
    """Members 0 and 1 are ours, 2 is PyTorch's, which froze the version. Member 1 saw
    member 0 unconfirmed and takes over after the grace; member 0's confirmation of both
    lands first, without a hint (it comes late). Member 1 must then wait for PyTorch's
    member to confirm, and complete with the version, not start over (it would then wait
    on its own version as a late worker, and its agent would never start its workers)."""
    layout = LegacyLayout(PREFIX, run_id)
    version = "1"
    keepers: list[LeaseKeeper] = []

    def keep_alive(key: str, lease: int) -> LeaseKeeper:
        keepers.append(LeaseKeeper(conn, key, 10, lease=lease))
        return keepers[-1]

    feed = StateFeed(conn, layout.state_key, parse_state)
    join = BatchJoin(
        conn,
        layout,
        feed,
        min_workers=3,
        max_workers=3,
        keep_alive=keep_alive,
        timeout_error=lambda: AssertionError("the rendezvous deadline passed"),
    )
    try:
        # Member 0 (ours, its worker elsewhere) created the version and is admitted.
        name0 = new_member_name(0x1234)
        key0 = layout.member_key(version, name0)
        conn.mkdir(layout.version_dir(version))
        conn.set(key0, "{}", ttl=60)
        state: dict[str, Any] = {
            "status": "joinable",
            "version": version,
            "participants": [0],
            "members": {name0: 0},
        }
        conn.set(layout.state_key, json.dumps(state))
        join.begin(Deadline(60))
        assert join.admit(version) == 1
        member_key = join.member_key
        assert member_key is not None
        name1 = member_key.rsplit("/", 1)[1]

        # A PyTorch worker joins as rank 2, the maximum: it freezes the version.
        node = conn.get(layout.state_key)
        state = json.loads(node.value or "")
        assert state["members"] == {name0: 0, name1: 1}
        state.update(participants=[0, 1, 2], status="frozen", keep_alives=[])
        frozen = conn.compare_and_swap(layout.state_key, json.dumps(state), node)

        with ThreadPoolExecutor(1) as pool:
            confirming = pool.submit(join.confirm, version, 1)
            wait_until(
                lambda: (feed.last_state or {}).get("status") == "frozen",
                what="member 1 to see the frozen version",
            )
            # Member 0 confirms both of ours; its hint has not come yet.
            confirmed = {**state, "keep_alives": [key0, member_key], "tag": "member0"}
            node = conn.compare_and_swap(layout.state_key, json.dumps(confirmed), frozen)
            # Member 1 reads it when the grace is over (or after a silence).
            wait_until(
                lambda: (
                    feed.last_state is not None and len(feed.last_state.get("keep_alives", [])) == 2
                ),
                what="member 1 to read member 0's confirmation",
            )
            assert not confirming.done() or confirming.exception() is None, confirming.exception()
            # PyTorch's member confirms last: the version is final.
            rank2 = layout.keep_alive_key(version, 2)
            conn.set(rank2, "", ttl=60)
            final = {
                **confirmed,
                "status": "final",
                "keep_alives": [key0, member_key, rank2],
                "num_workers_waiting": 0,
            }
            conn.compare_and_swap(layout.state_key, json.dumps(final), node)
            assert confirming.result(timeout=30) == 3
        assert conn.get(member_key).value is not None  # still ours, alive
    finally:
        for keeper in keepers:
            keeper.stop()
        feed.close()
