"""One worker's side of the batched join of the legacy ``etcd`` backend.

:class:`BatchJoin` carries out the decisions of :mod:`etcd_rendezvous._legacy.admission`:
it announces the worker's member key, lists the keys, admits or confirms them by
compare-and-swap on the state, writes the version's progress hint, and waits on a
:class:`~etcd_rendezvous._legacy.feed.StateFeed`. See docs/how-it-works.rst, section
"Joining in a few requests".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .._transport.interface import CompareFailedError, KeyNotFoundError, Node, Transport
from .._transport.limits import Refusal, Verdict
from ..api import Deadline, RendezvousError, RendezvousStateError, RequestTooLargeError
from ..layout import LegacyLayout, new_member_name, normalize_key
from ..metrics import record_metric
from .admission import (
    ADMIT_GATHER,
    AdmissionStep,
    Admit,
    Admitted,
    Announced,
    Complete,
    Confirm,
    Leave,
    Read,
    Wait,
    Write,
    admission_step,
    announced,
    confirmation_step,
    plan_admission,
    plan_confirmation,
    plan_freeze,
    refusal_verdict,
)
from .feed import Observed, StateFeed
from .state import (
    CONST_WORKER_KEEPALIVE_TTL,
    LOGGER_NAME,
    Hint,
    describe,
    members_of,
    supersedes,
)

__all__ = ["BatchJoin", "KeepAlive", "RestartAttempt"]

logger = logging.getLogger(LOGGER_NAME)


class RestartAttempt(Exception):  # noqa: N818 (a signal, as PyTorch's retry exceptions)
    """The state left the version being joined: start the attempt over at once."""


class KeepAlive(Protocol):
    """What :class:`BatchJoin` needs of the thread that keeps a key alive."""

    def stop(self, timeout: float = ...) -> None: ...


@dataclass(frozen=True)
class _Member:
    """Our member key in one version, and what keeps it alive."""

    version: str
    entry: Announced
    keeper: KeepAlive


class BatchJoin:
    """One worker's side of the batched join (docs/how-it-works.rst, "Joining in a few
    requests").

    Args:
        conn: the etcd connection.
        layout: the run's keys.
        feed: the state feed of the barrier in progress.
        min_workers, max_workers: the rendezvous' bounds.
        keep_alive: starts keeping a key alive (every TTL/2), given the key and the v3
            lease of our write of it (0 on v2); returns the keeper.
        timeout_error: the error to raise when the rendezvous deadline passes.
    """

    def __init__(
        self,
        conn: Transport,
        layout: LegacyLayout,
        feed: StateFeed,
        *,
        min_workers: int,
        max_workers: int,
        keep_alive: Callable[[str, int], KeepAlive],
        timeout_error: Callable[[], Exception],
    ) -> None:
        self._conn = conn
        self._layout = layout
        self._feed = feed
        self._min = min_workers
        self._max = max_workers
        self._keep_alive = keep_alive
        self._timeout_error = timeout_error
        self._deadline = Deadline.never()
        self._member: _Member | None = None
        #: The newest index up to which member keys were decided by our own writes.
        self._decided = 0

    @property
    def member_key(self) -> str | None:
        """Our member key in the version being joined (or joined), if any."""
        return None if self._member is None else self._member.entry.key

    def begin(self, deadline: Deadline) -> None:
        """Start a barrier ending at ``deadline``: every request of the join, its
        admissions, confirmations and waits, ends by it. The member key of the previous
        one is left to lapse (its keeper was stopped)."""
        self._deadline = deadline
        self._member = None
        self._decided = 0

    def opening_state(self, version: str) -> Write:
        """Announce ourselves in the new ``version`` we are creating: its first joinable
        state, with us admitted."""
        me = self._announce(version)
        self._decided = me.created_index
        opening = {"status": "joinable", "version": version, "participants": []}
        write = plan_admission(opening, [me], min_workers=self._min, max_workers=self._max)
        if write is None:  # pragma: no cover (an empty state has room for us)
            raise RendezvousStateError(f"Could not admit ourselves into version {version}.")
        return write

    def admit(self, version: str) -> int:
        """Announce ourselves in the joinable ``version`` (once) and wait until we are
        admitted, admitting others when it is our turn. Returns our rank.

        Raises:
            RestartAttempt: the version ended, or froze without us (our key is deleted).
        """
        observed = self._feed.current(self._deadline)
        members = members_of(observed.state or {}) if observed.status_in(version) else {}
        mine = self._member
        if mine is not None and mine.version == version and mine.entry.name in members:
            return members[mine.entry.name]  # we created the version
        # Hints from before our announce on: none that decides our key is missed.
        self._feed.follow_hints(self._layout.progress_key(version), self._deadline)
        self._announce(version)
        since = time.monotonic()
        while True:
            self.act_on_report(version)
            observed = self._feed.current(self._deadline)
            match self._admission_step(version, observed, since):
                case Admitted(rank):
                    return rank
                case Leave(reason):
                    self.discard()
                    raise RestartAttempt(reason)
                case Read(silence):
                    self._read(version, silence=silence)
                case Admit():
                    self._batch(version, observed)
                case Wait(timeout):
                    self._wait(timeout)

    def _admission_step(self, version: str, observed: Observed, since: float) -> AdmissionStep:
        """:func:`admission_step` on what the feed knows now (waiting since ``since``)."""
        feed = self._feed
        return admission_step(
            observed,
            feed.news,
            self._decided_upto(),
            version,
            self._require_member(version).entry,
            self._quiet(since),
            (observed.index, feed.hint_written_at),
            min_workers=self._min,
            unheard=feed.silence - feed.silent_for,
        )

    def confirm(self, version: str, rank: int) -> int:
        """Wait until ``version`` is final, confirming our members if it was frozen
        without them. Returns the world size.

        Raises:
            RestartAttempt: the version ended.
        """
        me = self._require_member(version).entry
        version_dir = self._layout.version_dir(version)
        self._feed.follow_hints(self._layout.progress_key(version), self._deadline)
        since = time.monotonic()
        while True:
            self.act_on_report(version)
            observed = self._feed.current(self._deadline)
            feed = self._feed
            unheard = feed.silence - feed.silent_for
            quiet = self._quiet(since)
            match confirmation_step(
                observed, feed.news, version, me.name, version_dir, quiet, unheard
            ):
                case Complete(world_size):
                    return world_size
                case Leave(reason):
                    raise RestartAttempt(f"{reason} Must re-enter.")
                case Read(silence):
                    self._read(version, silence=silence)
                case Confirm(without_lower):
                    self._confirm(version, me, rank if without_lower else None)
                case Wait(timeout):
                    self._wait(timeout)

    def _confirm(self, version: str, me: Announced, skip_below_rank: int | None) -> None:
        """Our turn to confirm the members of the frozen ``version`` (see
        :func:`plan_confirmation`), on the state read now (unless it is no longer
        frozen, or another member confirmed ours meanwhile: decide again).

        Raises:
            RestartAttempt: our member key ``me`` is gone.
        """
        observed = self._read(version, relay=False)
        if observed.status_in(version) != "frozen" or observed.state is None:
            return
        listed_at, entries = self._list(version)  # (raises if our key is gone)
        write = plan_confirmation(
            observed.state, entries, min_workers=self._min, skip_below_rank=skip_below_rank
        )
        if write is None:
            # Our key is listed, so it is confirmed already (by a lower member whose
            # write came after our decision, its hint later still): nothing to do.
            logger.debug("Our member key %s was confirmed meanwhile", me.key)
            return
        self._swap(version, observed, write, listed_at)

    def freeze(self, version: str) -> bool:
        """Freeze the joinable ``version`` at the end of the last call, our live members
        confirmed. Returns whether our write won (if not, the state changed: decide again)."""
        observed = self._feed.current(self._deadline)
        if observed.status_in(version) != "joinable" or observed.state is None:
            return False
        listed_at, entries = self._list(version)
        write = plan_freeze(observed.state, entries, min_workers=self._min)
        return self._swap(version, observed, write, listed_at)

    def publish(self, version: str, node: Node, state: dict[str, Any]) -> None:
        """Write the ``progress`` hint of ``version`` for our write ``node`` of ``state``
        (one we made outside the batches: the opening state, a TTL refresh)."""
        self._hint(version, describe(state, node.modified_index, self._decided_upto()))

    def act_on_report(self, version: str) -> None:
        """Raise the :class:`~etcd_rendezvous.api.RequestTooLargeError` of the newest
        report of a refused write in ``version``'s hint key that the feed brought, if it
        concerns us (see :func:`refusal_verdict`); a report older than our member key is
        checked first against etcd's limit: confirmed, it is written again (for the
        workers that came with us); if etcd accepts the size now, it is dropped."""
        found = self._feed.report
        if found is None or self._member is None or self._member.version != version:
            return
        report, written_at = found
        me = self._member.entry
        observed = self._feed.current(self._deadline)
        verdict = refusal_verdict(report, written_at, observed, version, me, min_workers=self._min)
        if verdict is Verdict.IGNORE or report.refused is None:
            return
        key = self._layout.progress_key(version)
        if verdict is Verdict.VERIFY:
            try:
                version_dir = self._layout.version_dir(version)
                self._conn.check_size(version_dir, report.refused.size, deadline=self._deadline)
            except RequestTooLargeError:
                self._rewrite_report(key, report, written_at, report)
            else:
                logger.info("etcd now accepts the write reported refused in %s; dropping it", key)
                self._feed.drop_report()
                self._rewrite_report(
                    key, report, written_at, dataclasses.replace(report, refused=None)
                )
                return
        raise report.refused.error(f"The worker with member key {me.key}")

    def _rewrite_report(self, key: str, report: Hint, written_at: int, hint: Hint) -> None:
        """Write ``hint`` in place of ``report`` (written at ``written_at`` in ``key``), unless
        the key changed since (a failure is only logged)."""
        try:
            self._conn.advance(
                key,
                hint.encode(),
                holds_newer=lambda stored: stored.modified_index != written_at,
                deadline=self._deadline,
            )
        except RendezvousError as exc:
            logger.info("Could not rewrite the report in %s: %s", key, exc)

    def check_reports(self, version: str) -> None:
        """Read ``version``'s hint key and act on a report of a refused write it holds
        (see :meth:`act_on_report`): for a worker that follows the state itself (the
        last-call worker)."""
        try:
            node = self._conn.try_get(self._layout.progress_key(version), deadline=self._deadline)
        except RendezvousError as exc:
            logger.info("Could not read the hint of version %s: %s", version, exc)
            return
        self._note_report(node)
        self.act_on_report(version)

    def _note_report(self, node: Node | None) -> None:
        """Take in the hint key ``node`` (read, or listed) if it reports a refused write."""
        hint = None if node is None else Hint.decode(node.value)
        if node is not None and hint is not None and hint.refused is not None:
            self._feed.note_report(hint, node.modified_index)

    def discard(self) -> None:
        """Stop keeping our member key alive and delete it (a failure is only logged).

        Past the rendezvous deadline the key is left to lapse (within its TTL) instead,
        and the keeper is not waited for: the caller is due to return. (A refresh still
        in flight cannot bring a deleted key back: it requires the key to exist.)
        """
        member, self._member = self._member, None
        if member is None:
            return
        if self._deadline.expired():
            member.keeper.stop(timeout=0.0)
            return
        member.keeper.stop()
        try:
            self._conn.delete(member.entry.key, deadline=self._deadline)
        except RendezvousError as exc:
            logger.info("Could not delete our member key %s (it lapses): %s", member.entry.key, exc)

    # -- the requests ------------------------------------------------------------------

    def _announce(self, version: str) -> Announced:
        """Write our member key in ``version`` unless we did; keep it alive from now on."""
        if self._member is not None:
            if self._member.version == version:
                return self._member.entry
            self.discard()
        self._decided = 0
        key = self._layout.member_key(version, new_member_name(secrets.randbits(64)))
        # The value says who we are, for operators (``etcd-rendezvous status -v``); no
        # worker reads it.
        who = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        node = self._conn.set(key, who, ttl=CONST_WORKER_KEEPALIVE_TTL, deadline=self._deadline)
        entry = Announced(node.created_index, key.rsplit("/", 1)[1], normalize_key(key))
        self._member = _Member(version, entry, self._keep_alive(key, node.lease))
        logger.info("Announced ourselves in rendezvous version %s as %s", version, key)
        return entry

    def _require_member(self, version: str) -> _Member:
        if self._member is None or self._member.version != version:
            raise RestartAttempt(f"We hold no member key in version {version}.")
        return self._member

    def _list(self, version: str) -> tuple[int, list[Announced]]:
        """The member keys of ``version`` and the store index at which they were listed
        (every key created at or before it is among them)."""
        listing = self._conn.list_dir(self._layout.version_dir(version), deadline=self._deadline)
        progress_key = normalize_key(self._layout.progress_key(version))
        hint = next((c for c in listing.children if normalize_key(c.key) == progress_key), None)
        self._note_report(hint)
        self.act_on_report(version)
        entries = announced(listing)
        member = self._require_member(version)
        listed = [e for e in entries if e.name == member.entry.name]
        if not listed:
            self.discard()
            raise RestartAttempt(f"Our member key {member.entry.key} is gone; must re-enter.")
        # The listing has the key's creation index for sure (the answer to our write may
        # have been to a second copy of it, sent after a connection failure).
        self._member = dataclasses.replace(member, entry=listed[0])
        listed_at = max([listing.etcd_index, *(e.created_index for e in entries)])
        return listed_at, entries

    def _decided_upto(self) -> int:
        """The newest index up to which member keys are known decided (0: unknown)."""
        hint = self._feed.hint
        return max(self._decided, hint.decided_upto if hint is not None else 0)

    def _read(self, version: str, *, relay: bool = True, silence: bool = False) -> Observed:
        """Read the state; if it is newer than the hint says (a write by PyTorch's
        workers, or by one of ours that died before its hint), pass the word on, unless
        not to ``relay`` (a candidate's read, which may come between a write and its
        hint: the others hear of the write from its writer, or read after a silence).
        ``silence``: no hint called for the read (counted as
        ``rendezvous.silence_reads``)."""
        if silence:
            record_metric("rendezvous.silence_reads", backend="etcd")
        observed = self._feed.refresh(self._deadline)
        hint = self._feed.hint
        if (
            relay
            and observed.state is not None
            and observed.status_in(version) is not None
            and (hint is None or hint.index < observed.index)
        ):
            self._hint(version, describe(observed.state, observed.index, self._decided_upto()))
        return observed

    def _batch(self, version: str, seen: Observed) -> None:
        """Our turn to admit: read the state (unless it changed meanwhile, as a hint
        might not have said), list the member keys, admit every announced one."""
        observed = self._read(version, relay=False)
        if observed.index != seen.index or observed.status_in(version) != "joinable":
            return  # decide again on what we read
        if observed.state is None:  # pragma: no cover (checked by status_in)
            return
        listed_at, entries = self._list(version)
        write = plan_admission(
            observed.state, entries, min_workers=self._min, max_workers=self._max
        )
        self._swap(version, observed, write, listed_at)

    def _swap(self, version: str, observed: Observed, write: Write | None, listed_at: int) -> bool:
        """Compare-and-swap ``write`` (made from a listing at ``listed_at``) in place of
        ``observed``, then write the hint. Returns whether ours won (if not, the caller
        decides again: the next hint, or read, tells what came first)."""
        if write is None or observed.node is None:
            self._wait(self._feed.silence)
            return False
        # A tag (which PyTorch's workers ignore and carry along) makes the swap ours
        # alone: a retry that finds another admitter's identical state is not misled.
        state = {**write.state, "tag": secrets.token_hex(8)}
        try:
            node = self._conn.compare_and_swap(
                self._layout.state_key,
                json.dumps(state),
                observed.node,
                ttl=write.ttl,
                deadline=self._deadline,
            )
        except (CompareFailedError, KeyNotFoundError):
            logger.debug("Rendezvous state CAS unsuccessful; deciding again")
            self._wait(ADMIT_GATHER)
            return False
        except RequestTooLargeError as exc:
            self._report(version, observed, write, listed_at, exc)
            raise
        self._decided = max(self._decided, listed_at)
        self._feed.note(node, self._deadline)
        self._hint(version, describe(write.state, node.modified_index, self._decided))
        return True

    def _report(
        self,
        version: str,
        observed: Observed,
        write: Write,
        listed_at: int,
        error: RequestTooLargeError,
    ) -> None:
        """etcd refused ``write`` (made from a listing at ``listed_at``, in place of
        ``observed``) for its size: report it in the hint key, for the workers that wait
        for it (see :func:`refusal_verdict`)."""
        state = write.state
        me = self._require_member(version).entry
        completing = state["status"] in ("frozen", "final")
        by = f"the worker with member key {me.key}"
        refusal = Refusal.of(error, listed_at, len(state["participants"]), completing, by)
        described = describe(observed.state or {}, observed.index, self._decided_upto())
        self._hint(version, dataclasses.replace(described, refused=refusal))

    def _hint(self, version: str, hint: Hint) -> None:
        """Write ``hint`` in ``version``'s ``progress`` key, unless it holds a hint of a
        newer state already (a failure is only logged: the others then read the state
        after a silence).

        Two writers may hint at once, the older state's last: the key is advanced
        (:meth:`~etcd_rendezvous._transport.interface.Transport.advance`), so it never
        goes back to an older state. A stored hint of an index etcd has not reached yet
        is a lie, and is replaced."""

        key = self._layout.progress_key(version)
        try:
            self._conn.advance(
                key,
                hint.encode(),
                holds_newer=lambda node: supersedes(node, hint),
                deadline=self._deadline,
            )
        except RendezvousError as exc:
            logger.info("Could not write the progress hint of version %s: %s", version, exc)

    def _quiet(self, since: float) -> float:
        """Seconds the state has been unchanged while we waited (since ``since``)."""
        return min(self._feed.quiet_for, time.monotonic() - since)

    def _wait(self, timeout: float | None = None) -> bool:
        """Wait for a change of the state, at most ``timeout`` seconds and never past the
        rendezvous deadline."""
        remaining = self._deadline.remaining()
        if remaining <= 0:
            raise self._timeout_error()  # (not even a stream opened past the deadline)
        changed = self._feed.wait(remaining if timeout is None else timeout, self._deadline)
        if self._deadline.expired():
            raise self._timeout_error()
        return changed
