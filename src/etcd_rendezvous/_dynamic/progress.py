"""The progress key of the dynamic rendezvous: a small summary of the last state write.

A backend that keeps one (a :class:`~etcd_rendezvous._dynamic.keys.KeyedBackend`,
this package's ``etcd-v2`` backend) lets the nodes that wait for their admission follow
the summary instead of the state, and read the state only when the summary says
something concerns them, or after a silence. The summary is a hint: the state stays
the authority. See docs/how-it-works.rst, "The progress key".

A batch whose state write etcd refused for its size (a
:class:`~etcd_rendezvous.api.RequestTooLargeError`) is reported in the key by its maker:
the summary of the state the write would have replaced, with a
:class:`~etcd_rendezvous._transport.limits.Refusal` (the index of the listing the batch
came from, the participants it would have had, etcd's answer). The nodes waiting to join
raise the same error as soon as a report concerns them (:func:`refusal_verdict`), instead
of waiting for their timeout. A report concerns a node of the round it is about when:

* the round cannot complete: it is incomplete and needs at least ``min_nodes``
  participants, no fewer than the refused write had (each node adds to the state); or
* the node's key was in the refused batch (created at or before its listing) and no
  batch decided it since: every later batch lists it again, as large.

A report about another round (one that completed, or a later one) is stale and ignored,
and one written before the node's key was created (it arrived later, maybe after etcd's
limit was raised) is verified first: a write of the same size that cannot apply
(:meth:`~etcd_rendezvous._dynamic.keys.KeyedBackend.check_size`). If etcd refuses that
too, the node raises and writes the report again, so that the nodes that arrived with
it need not check; if not, it replaces the report with the summary alone. A report that
cannot be read, or claims an index written after the report itself, is ignored like a
garbled summary; a well-formed one is taken at its word by the nodes that were there
(whoever may write the key may as well close the rendezvous).

PyTorch's workers never read the key, so no report reaches them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .._transport.limits import Refusal, Verdict
from .._transport.retry import Deadline
from ..api import RendezvousError, RequestTooLargeError
from ..metrics import record_metric
from .keys import KeyedBackend, Progress
from .state import NodeDesc, RendezvousState

__all__ = [
    "PROGRESS_SILENCE",
    "Heard",
    "ProgressKey",
    "concerns",
    "refusal_verdict",
]

logger = logging.getLogger(__name__)

#: Seconds a node that follows the progress key waits without hearing of a change (on
#: the progress key, or in a read of the state) before it reads the key, then the state,
#: anyway: a state written by PyTorch's workers, or by a node that died before its
#: summary. After the first silence, each node draws its next between this and twice it.
PROGRESS_SILENCE = 2.0


class Heard(enum.Enum):
    """What a follower's wait on the progress key ended with."""

    READ = "read"
    """The progress key names a change that concerns the node (or it was silent too
    long): read the state."""
    KEEP = "keep"
    """Nothing that concerns the node: the state it holds stands."""


def concerns(
    progress: Progress,
    token: int,
    state: RendezvousState,
    node: NodeDesc,
    created: int | None,
    min_nodes: int,
) -> bool:
    """Whether a follower holding ``state`` (read with ``token``) must read the state that
    ``progress`` describes: the round ended, completed or closed, its own key (created at
    ``created``) was decided, or the participants reached ``min_nodes`` (the last call
    started). Never trusted over the state: it only tells when to read it."""
    if progress.token <= token:
        return False
    if (progress.round, progress.complete, progress.closed) != (
        state.round,
        state.complete,
        state.closed,
    ):
        return True
    if len(state.participants) < min_nodes <= progress.participants:
        return True
    # A node whose key was decided learns how once the round completes (or the last
    # call starts); before that, only a node left waiting in a complete round reads it.
    admitted = node in state.participants or node in state.wait_list
    decided = created is not None and progress.decided_upto >= created
    return not admitted and decided and state.complete


def refusal_verdict(
    report: Progress,
    written_at: int,
    token: int,
    state: RendezvousState,
    node: NodeDesc,
    created: int | None,
    min_nodes: int,
) -> Verdict:
    """What ``node``, waiting to join with its key created at ``created`` and holding
    ``state`` (read with ``token``), does about ``report``, a report of a refused write
    written at ``written_at`` (see the module's docs). The report's own summary stands
    for a state the node has not read yet."""
    refusal = report.refused
    if refusal is None or created is None:
        return Verdict.IGNORE
    if report.token >= token:
        decided = created <= report.decided_upto
    elif (report.round, report.complete, report.closed) != (
        state.round,
        state.complete,
        state.closed,
    ):
        return Verdict.IGNORE  # the round moved on since
    else:
        decided = node in state.participants or node in state.wait_list
        decided = decided or node in state.redundancy_list
    stuck = not (report.complete or report.closed) and min_nodes >= refusal.count
    if not stuck and (decided or created > refusal.upto):
        return Verdict.IGNORE
    return Verdict.FAIL if created < written_at else Verdict.VERIFY


@dataclass(eq=False)
class ProgressKey:
    """One node's view of the progress key: the newest summary heard, the decided index
    it learnt, and the node's own writes of the key (see docs/how-it-works.rst, "Our
    nodes: node keys, batched admission, one heartbeat writer", the progress key).
    Without a board (a backend that keeps no progress key) the node never knows it.
    Every method may raise :class:`~etcd_rendezvous.api.RendezvousConnectionError`.
    """

    board: KeyedBackend | None
    node: NodeDesc
    min_nodes: int
    clock: Callable[[], float]
    #: The node's heartbeat lifetime in whole seconds, published with every summary it
    #: writes (see :attr:`Progress.lifetime`).
    lifetime: int = 0
    #: The newest summary heard (``None``: none yet, or it was found false).
    hint: Progress | None = field(default=None, init=False)
    #: Every node key created at or before this etcd index was decided, as far as the
    #: node heard; and when that last grew (``clock()``).
    decided_upto: int = field(default=0, init=False)
    decided_at: float = field(default=-math.inf, init=False)
    # The etcd index to watch the key from (``None``: the node never read it); the key's
    # modification index as last heard (0: none), on which our writes of it
    # compare-and-swap; the version of the last summary found false (logged once).
    _index: int | None = field(default=None, init=False)
    _version: int = field(default=0, init=False)
    _lie_version: int = field(default=0, init=False)
    # When the node last heard of a change (from the key or a read of the state), the
    # silence after which it looks itself, and the index the batch being written
    # decided up to.
    _heard_at: float = field(default=-math.inf, init=False)
    _silence: float = field(default=PROGRESS_SILENCE, init=False)
    _deciding: int | None = field(default=None, init=False)
    # The summary of the state the node last read or wrote (what a report of a refused
    # write made on it says besides); the newest report of a refused write heard, with
    # the key's modification index that brought it (``None``: none, or it was dropped),
    # and the newest such index (a report is taken in once).
    _held: Progress | None = field(default=None, init=False)
    _report: tuple[Progress, int] | None = field(default=None, init=False)
    _report_at: int = field(default=0, init=False)

    @property
    def known(self) -> bool:
        """Whether the node read the key: it can follow it, and knows what was decided."""
        return self.board is not None and self._index is not None

    def newer_than(self, token: int) -> bool:
        """Whether the summary heard describes a newer state than the one of ``token``."""
        return self.hint is not None and self.hint.token > token

    def admitted_since(self, token: int, state: RendezvousState) -> bool:
        """Whether the summary heard describes a newer state than ``state`` (read with
        ``token``) with other admissions: a batch took nodes out of the round or admitted
        some since. A fold of heartbeats changes neither count."""
        hint = self.hint
        if hint is None or hint.token <= token:
            return False
        held = (state.round, state.complete, state.closed)
        heard = (hint.round, hint.complete, hint.closed)
        counts = (len(state.participants), len(state.wait_list))
        return heard != held or (hint.participants, hint.waiting) != counts

    def batch_listed(self) -> None:
        """The node makes a batch from the listing just taken: its write decides the keys
        up to that listing's index."""
        if self.board is not None:
            self._deciding = self.board.listed_at

    def stop_waiting(self) -> None:
        """Close the watches (see :meth:`.KeyedBackend.stop_waiting`)."""
        if self.board is not None:
            self.board.stop_waiting()

    def read(self, deadline: Deadline) -> None:
        """Read the progress key before announcing (creating it if there is none), so that
        our key is younger than the decided index it holds (see
        :func:`~etcd_rendezvous._dynamic.admission.stagger_wait`).
        A node that loses the race to create it learns what the winner wrote from its
        watch, which starts before the winner's write."""
        board = self.board
        if board is None:
            return
        # The silence counts from now: the node starts listening (a node that loses the
        # race to create the key has heard nothing yet, and has nothing to look for).
        self._heard_at = self.clock()
        progress, version, index = board.read_progress(deadline)
        if progress is not None:
            self._hear(progress, version, index)
            return
        first = Progress(0, 0, False, False, index, 0, 0, self.lifetime)
        if version is not None:  # garbage: start afresh
            written = board.write_progress(first, version, deadline)
            if written is not None:
                self._hear(first, written)
                return
        else:
            created = board.create_progress(first, deadline)
            if created is not None:
                self._hear(first, created)
                return
        self._index = max(index, self._index or 0)

    def _hear(self, progress: Progress | None, version: int | None, index: int = 0) -> bool:
        """Note a summary read or watched: the key's modification index ``version``
        (``None``: unknown) and the etcd index ``index`` of the read (a watched change:
        its version). Whether it tells something new: a newer state than the last one
        seen, or more keys decided (a batch's summary after a relay of its state, which
        moves the candidates' turns); a summary that cannot be true (see :meth:`_false`)
        is not heard at all."""
        if version is not None:
            self._version = max(version, self._version)
        self._index = max(index, version or 0, self._index or 0)
        if progress is None or self._false(progress, version):
            return False
        self._heard_at = self.clock()  # Someone is at work (or checked, see state_read).
        if progress.refused is not None and version is not None and version > self._report_at:
            self._report, self._report_at = (progress, version), version
        decided = progress.decided_upto > self.decided_upto
        if decided:
            self.decided_upto, self.decided_at = progress.decided_upto, self.clock()
        if self.hint is not None and progress.token <= self.hint.token:
            return decided
        self.hint = progress
        return True

    def _false(self, progress: Progress, version: int | None) -> bool:
        """Whether ``progress``, written at ``version``, claims a state or a decided
        index written after it: garbage that reads as a summary (logged once per
        version)."""
        upto = 0 if progress.refused is None else progress.refused.upto
        if version is None or max(progress.token, progress.decided_upto, upto) < version:
            return False
        if version != self._lie_version:
            self._lie_version = version
            logger.warning(
                "The progress key of the node '%s' holds a summary that cannot be true "
                "(token %d, decided index %d, written at %d); ignoring it.",
                self.node,
                progress.token,
                progress.decided_upto,
                version,
            )
        return True

    def await_change(
        self,
        timeout: float,
        token: int,
        state: RendezvousState,
        created: int | None,
        deadline: Deadline,
    ) -> Heard:
        """Wait up to ``timeout`` seconds on the progress key for a change of the state
        that concerns this node (see :func:`concerns`), holding ``state`` read with
        ``token``. Returns :attr:`Heard.KEEP` as soon as a change that does not concern
        it is heard (to look at its turn again), or at the timeout; :attr:`Heard.READ`
        for a change that does, or after a silence (see :data:`PROGRESS_SILENCE`)."""
        board = self.board
        if board is None or self._index is None:
            return Heard.READ
        self._act_on_report(board, token, state, created, deadline)
        until = self.clock() + max(timeout, 0.0)
        while True:
            now = self.clock()
            silence_at = self._heard_at + self._silence
            if now >= silence_at:
                return self._after_silence(board, token, state, created, deadline)
            if now >= until:
                return Heard.KEEP
            changes = board.wait_progress(self._index, min(until, silence_at) - now, deadline)
            newer = [self._hear(p, version) for p, version in changes]
            self._act_on_report(board, token, state, created, deadline)
            heard = [p for p, _ in changes if p is not None]
            node, least = self.node, self.min_nodes
            if any(concerns(p, token, state, node, created, least) for p in heard):
                return Heard.READ
            if any(newer):
                return Heard.KEEP

    def _after_silence(
        self,
        board: KeyedBackend,
        token: int,
        state: RendezvousState,
        created: int | None,
        deadline: Deadline,
    ) -> Heard:
        """Nothing heard for the silence (spread out over the nodes, drawn afresh here):
        read the key itself (our watch may lag behind it), then the state unless the key
        names a change that does not concern us (the key may miss a state write)."""
        record_metric("rendezvous.silence_reads", backend="etcd-v2")
        logger.debug(
            "The node '%s' heard of no change for %.1f s; reading the progress key.",
            self.node,
            self.clock() - self._heard_at,
        )
        self._heard_at = self.clock()
        self._silence = PROGRESS_SILENCE * (1.0 + random.random())
        progress, version, index = board.read_progress(deadline)
        heard = progress is not None and self._hear(progress, version, index)
        self._act_on_report(board, token, state, created, deadline)
        if progress is None or not heard:
            return Heard.READ
        if concerns(progress, token, state, self.node, created, self.min_nodes):
            return Heard.READ
        return Heard.KEEP

    def _act_on_report(
        self,
        board: KeyedBackend,
        token: int,
        state: RendezvousState,
        created: int | None,
        deadline: Deadline,
    ) -> None:
        """Raise the :class:`~etcd_rendezvous.api.RequestTooLargeError` of the newest
        report of a refused write heard, if it concerns the node (see
        :func:`refusal_verdict`; ``token``, ``state``, ``created`` as there), checking
        etcd's limit first if the report is older than the node's key."""
        if self._report is None:
            return
        report, written_at = self._report
        verdict = refusal_verdict(
            report, written_at, token, state, self.node, created, self.min_nodes
        )
        if verdict is Verdict.IGNORE or report.refused is None:
            return
        if verdict is Verdict.VERIFY:
            try:
                board.check_size(report.refused.size, deadline)
            except RequestTooLargeError:
                # Confirmed: written again, for the nodes that arrived with us.
                written = board.replace_progress(report, written_at, deadline)
                if written is not None:
                    self._report = (report, written)
                    self._report_at = max(self._report_at, written)
            else:
                logger.info(
                    "etcd now accepts a write as large as the one the progress key of "
                    "the node '%s' reports refused; dropping that report.",
                    self.node,
                )
                self._report = None
                dropped = dataclasses.replace(report, refused=None)
                board.replace_progress(dropped, written_at, deadline)
                return
        raise report.refused.error(f"The node '{self.node}'")

    def refused(
        self,
        error: RequestTooLargeError,
        token: int,
        count: int,
        completing: bool,
        deadline: Deadline,
    ) -> None:
        """etcd refused our write of the state, made on the state of ``token``, for its
        size (it would have had ``count`` participants, and ``completing``: completed
        the round): if it was a batch, report it in the key (with the summary of the
        state it would have replaced). A failure to write the report is only logged
        (the others then meet the limit themselves)."""
        board, deciding, self._deciding = self.board, self._deciding, None
        if board is None or self._index is None or deciding is None:
            return
        held = next(
            (p for p in (self._held, self.hint) if p is not None and p.token == token), None
        )
        if held is None:
            logger.info(
                "The node '%s' does not know the summary of the state its refused write "
                "would have replaced; not reporting the refusal.",
                self.node,
            )
            return
        report = Refusal.of(error, deciding, count, completing, f"the node '{self.node}'")
        try:
            board.write_progress(dataclasses.replace(held, refused=report), self._version, deadline)
        except RendezvousError as exc:
            logger.info("The node '%s' could not report the refusal: %s", self.node, exc)

    def state_read(
        self,
        token: int,
        state: RendezvousState,
        written: bool,
        joining: bool,
        deadline: Deadline,
    ) -> None:
        """The node read (``written``: wrote) the state ``state`` with ``token``: after a
        write of ours, summarise it in the progress key; after a read that finds a state
        the key does not describe, write the summary ourselves (relay: see
        docs/how-it-works.rst, "The progress key"). Never lowers the decided index."""
        self._held = Progress.of(token, state, self.decided_upto)
        board = self.board
        if board is None or self._index is None:
            return  # We never read the key: we do not know what it says is decided.
        self._heard_at = self.clock()
        deciding, self._deciding = self._deciding, None
        hint = self.hint
        if written:
            if deciding is not None and deciding > self.decided_upto:
                self.decided_upto, self.decided_at = deciding, self.clock()
            self._summarise(board, token, state, board.write_progress, deadline)
        elif hint is not None and hint.token > token:
            self._forget_hint(hint, token)
            self._summarise(board, token, state, board.replace_progress, deadline)
        elif joining and hint is not None and token > hint.token:
            # Only a node that follows the key knows what it misses.
            self._summarise(board, token, state, board.replace_progress, deadline)

    def absence_is_news(self) -> bool:
        """Whether a read that found no state tells of a state deleted since the
        summary held was written: it was served at an etcd index no older than that
        write (a member behind the others, which has not seen the state yet, answers
        from an older one: that proves nothing, and forgetting the summary would roll
        the key back for everyone)."""
        hint, board = self.hint, self.board
        if hint is None or board is None:
            return True
        absent_at = board.absent_at
        return absent_at is None or absent_at >= hint.token

    def _forget_hint(self, hint: Progress, token: int) -> None:
        """The state read with ``token`` is older than ``hint`` describes: the state is
        the authority, so forget the hint (a candidate would wait for it for ever) and
        what it said was decided beyond the state read; the relay replaces it."""
        logger.warning(
            "The node '%s' read the state written at %d, but the progress key "
            "described one written at %d; ignoring that summary.",
            self.node,
            token,
            hint.token,
        )
        self.hint = None
        self.decided_upto = min(self.decided_upto, token)

    def _summarise(
        self,
        board: KeyedBackend,
        token: int,
        state: RendezvousState,
        write: Callable[[Progress, int, Deadline], int | None],
        deadline: Deadline,
    ) -> None:
        """Write the summary of ``state`` (read with ``token``) by ``write`` (one of
        ``board``'s, on the key's version last heard); if someone wrote the key since
        we heard it, leave it: its summary may know more."""
        progress = Progress.of(token, state, self.decided_upto, self.lifetime)
        index = write(progress, self._version, deadline)
        if index is None:
            return
        self._version = max(index, self._version)
        self._index = max(index, self._index or 0)
        if self.hint is None or token > self.hint.token:
            self.hint = progress

    def waiting_hint(self, token: int, deadline: Deadline) -> Progress | None:
        """The progress key's summary (one small read), if it describes the state held
        (``token``) or a newer one, else ``None`` (read the state)."""
        board = self.board
        if board is None:
            return None
        progress, version, index = board.read_progress(deadline)
        if progress is None or progress.token < token:
            return None
        self._hear(progress, version, index)
        return progress
