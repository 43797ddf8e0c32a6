"""Which request-journal rows of the open epoch leave the live log with an archived segment.

The allocator's segment archiver (``nanoserve.allocator.log.segment_archive``)
asks its companion which of its rows no reader of the live log needs any more
(``SegmentCompanion``). For the journal that is every step row before the row
holding the ADMIT of the oldest request still unfinished: such a request's
records all lie at or after its ADMIT, so recovery and ``Resume`` of every
unfinished request read only kept rows. A request that finished has no
reader that must find it live: its rows may move, all or the part before the
cut (``Resume`` then answers NOT_FOUND, or DATA_LOSS for a partly archived
history, as for a request of an archived epoch).

``JournalSegments`` finds that row without reading the whole journal each
time: it scans each step row once, in seq order, checking the chain as it
goes (a break: nothing of the journal moves until ``log audit`` names it),
and keeps the requests admitted and not yet finished by the rows scanned.
A request that never finishes holds the journal's cut back (its rows, and
everything after them, stay live).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa

from nanoserve.allocator.log.companion import CompanionSegment
from nanoserve.allocator.log.segment import companion_cut
from nanoserve.engine.journal.journal_chain import StepRow, journal_genesis, step_hash
from nanoserve.engine.journal.records import JournalKind
from nanoserve.engine.journal.schema import journal_checkpoints, journal_requests, journal_steps
from nanoserve.engine.journal.step_codec import decode_step

# what moves: the step rows by their first seq, the ADMIT/FINISH index by its seq
# the step rows, their index, and the live-request checkpoints of the rows that move
JOURNAL_SEGMENT_TABLES = (
    (journal_steps.name, "first_seq"),
    (journal_requests.name, "journal_seq"),
    (journal_checkpoints.name, "last_seq"),
)


@dataclass
class JournalSegments:
    """The request journal as a ``SegmentCompanion``: scans one epoch's step rows once each.

    Invariant (after a scan): ``_open`` holds each request admitted in the
    epoch and not finished by the rows scanned, as request id -> (first seq
    of the row holding its ADMIT, the hash that row chains from);
    ``_next_seq`` is the first journal seq not scanned, ``_previous`` the
    hash of the last row scanned. ``damaged``: the chain broke at that seq
    (nothing moves from then on).
    """

    _epoch: int | None = None
    _next_seq: int = 1
    _previous: bytes = b""
    _open: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    damaged: int | None = None

    def segment(self, conn: sa.Connection, pool_id: str, epoch: int) -> CompanionSegment | None:
        """The journal rows of ``(pool_id, epoch)`` before the oldest unfinished request's (None: none)."""
        if not sa.inspect(conn).has_table(journal_steps.name):
            return None
        if epoch != self._epoch:
            self._begin(conn, pool_id, epoch)
        self._scan(conn, pool_id, epoch)
        if self.damaged is not None:
            return None
        end_seq, head = min(self._open.values(), default=(self._next_seq, self._previous))
        cut = companion_cut(conn, pool_id, epoch)  # read again: a segment that failed to move moved nothing
        first_seq = 1 if cut is None else cut.first_seq
        if end_seq <= first_seq:
            return None
        return CompanionSegment(first_seq, end_seq, head, JOURNAL_SEGMENT_TABLES)

    def _begin(self, conn: sa.Connection, pool_id: str, epoch: int) -> None:
        cut = companion_cut(conn, pool_id, epoch)
        self._epoch, self._open, self.damaged = epoch, {}, None
        if cut is None:
            self._next_seq, self._previous = 1, journal_genesis(pool_id, epoch)
        else:
            self._next_seq, self._previous = cut.first_seq, cut.previous_hash

    def _scan(self, conn: sa.Connection, pool_id: str, epoch: int) -> None:
        table = journal_steps
        columns = (table.c.epoch, table.c.first_seq, table.c.last_seq, table.c.step, table.c.wall_ns)
        rows = conn.execute(
            sa.select(*columns, table.c.body, table.c.hash)
            .where(table.c.pool_id == pool_id, table.c.epoch == epoch, table.c.first_seq >= self._next_seq)
            .order_by(table.c.first_seq)
        )
        for row in rows:
            if self.damaged is not None:
                return
            step_row = StepRow(*row)
            expected = step_hash(
                self._previous, step_row.first_seq, step_row.last_seq, step_row.step, step_row.wall_ns, step_row.body
            )
            if step_row.first_seq != self._next_seq or expected != bytes(step_row.hash):
                self.damaged = self._next_seq
                return
            for record in decode_step(step_row.body):  # an ADMIT or FINISH names its request
                if record.kind == JournalKind.ADMIT.value and record.request_id is not None:
                    self._open.setdefault(record.request_id, (step_row.first_seq, self._previous))
                elif record.kind == JournalKind.FINISH.value and record.request_id is not None:
                    self._open.pop(record.request_id, None)
            self._previous, self._next_seq = bytes(step_row.hash), step_row.last_seq + 1
