"""The audit's speculative-decoding rule: a verify pass gives back only its own step's draft slots.

Speculative decoding takes its draft tokens' slots by an ALLOCATE_FOR with reason ``draft``
and, in the same step, after the verify pass, frees the blocks only rejected drafts needed
(FREE_ALL with reason ``rejected_draft``); blocks the accepted drafts fill stay. So the blocks
of a ``rejected_draft`` free are always blocks that a ``draft`` allocation of the same owner
took in the same step. A rollback that names any other block gave back slots that accepted
or earlier tokens hold (the truncation cut too far), or rolled back drafts across steps.

Which drafts were accepted is not in the allocation log (the journal holds the tokens), so
the log cannot tell a draft block kept for accepted drafts from one kept by mistake; a block
kept that way is held as any other, and a leak of it is named at POOL_CLOSE
(``leaked_block``). What this rule adds is the other half: the rollback never takes back too
much, and never a block it did not take for drafts in that step.

Only the rows whose record names one of the two reasons are read (a SQL filter on the
record text, then the codec decides), and the packed rows (``packed_rows``), whose events
are filtered alike once inflated, so an epoch without speculation costs one indexed
query and no decoding but the inflating. The fold itself is ``DraftSlots`` (no SQL, testable on events).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.events import EventKind, FreeReason
from nanoserve.allocator.log.key_table import stored_keys
from nanoserve.allocator.log.packed_rows import PACKED_KIND, expand_packed, may_hold
from nanoserve.allocator.log.reader import EpochInfo, to_event
from nanoserve.allocator.log.row_scan import EVENT_COLUMNS, has_packed_rows
from nanoserve.allocator.log.schema import allocator_events
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.pool_state import Violation

_DRAFT = FreeReason.DRAFT.value
_REJECTED = FreeReason.REJECTED_DRAFT.value
_FREES = (EventKind.FREE.value, EventKind.FREE_ALL.value)
_KINDS = (EventKind.ALLOCATE_FOR.value, *_FREES)
# what a packed row's records hold when one of them names either reason
_REASON_MARKS = (f"|{_DRAFT}|".encode(), f"|{_REJECTED}|".encode())


class DraftSlots:
    """Folds the ``draft`` allocations and ``rejected_draft`` frees of one epoch, in seq order.

    Keeps, per owner, the step of its latest draft allocation and the blocks it took
    (``owner -> (step, block ids)``), and names each block of a rollback that is not among them
    (rule ``rollback_of_non_draft``, at the rollback's seq).
    """

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self._drafts: dict[str, tuple[int | None, set[int]]] = {}  # owner -> (step, blocks its drafts took then)

    def apply(self, event: Event) -> None:
        """Take one event; events of other kinds or reasons change nothing."""
        if event.kind == EventKind.ALLOCATE_FOR.value and event.reason == _DRAFT and event.owner is not None:
            step, taken = self._drafts.get(event.owner, (None, set()))
            if step != event.step:
                taken = set()
            self._drafts[event.owner] = (event.step, taken | set(event.block_ids))
        elif event.kind in _FREES and event.reason == _REJECTED and event.owner is not None:
            step, taken = self._drafts.get(event.owner, (None, set()))
            for block_id in event.block_ids:
                if step != event.step or block_id not in taken:
                    self.violate(
                        event.seq,
                        "rollback_of_non_draft",
                        f"a rejected_draft free gave back a block no draft allocation of the owner took in step "
                        f"{event.step}",
                        block_id,
                        event.owner,
                    )
            taken.difference_update(event.block_ids)

    def violate(self, seq: int, rule: str, message: str, block_id: int | None, owner: str | None) -> None:
        self.violations.append(Violation(seq, rule, message, block_id, owner))


def draft_violations(conn: sa.Connection, info: EpochInfo, from_seq: int = 1) -> list[Violation]:
    """The ``rollback_of_non_draft`` violations of one epoch from ``from_seq`` on (see the module).

    A row the codec cannot read is skipped, and rows the store cannot read end the check with
    what it found before them: replay names both (damage is a value there, never a traceback).
    """
    slots = DraftSlots()
    try:
        for event in _speculative_events(conn, info, from_seq):
            slots.apply(event)
    except sa.exc.SQLAlchemyError:
        pass
    return slots.violations


def _speculative_events(conn: sa.Connection, info: EpochInfo, from_seq: int) -> Iterator[Event]:
    table = allocator_events.c
    packed = has_packed_rows(conn)
    names_reason = sa.or_(table.record.contains(f"|{_DRAFT}|"), table.record.contains(f"|{_REJECTED}|"))
    wanted = sa.and_(table.kind.in_(_KINDS), names_reason)
    query = (
        sa.select(*EVENT_COLUMNS, *((table.last_seq, table.records) if packed else (sa.null(), sa.null())))
        .where(
            table.pool_id == info.pool_id,
            table.epoch == info.epoch,
            table.seq >= from_seq,
            sa.or_(wanted, table.kind == PACKED_KIND) if packed else wanted,
        )
        .order_by(table.seq)
    )
    keys = stored_keys(conn, info.pool_id, info.epoch)
    for row in conn.execute(query):
        if row[5] is None:
            yield from _decoded(info, [tuple(row)[:5]])
        elif may_hold(row[6], _REASON_MARKS):  # a packed row: its events filtered here as SQL filters the others
            events = expand_packed(row[0], row[5], row[6], row[4], None, keys)
            yield from _decoded(info, [_unhashed(event) for event in events if _names_draft(event)])


def _names_draft(row: tuple[Any, ...]) -> bool:
    record = row[3]
    return row[1] in _KINDS and type(record) is str and (f"|{_DRAFT}|" in record or f"|{_REJECTED}|" in record)


def _unhashed(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An expanded row with an empty hash: this rule reads no hash (replay checks the chain)."""
    return (*row[:4], b"")


def _decoded(info: EpochInfo, rows: Iterable[Any]) -> Iterator[Event]:
    for row in rows:
        try:
            yield to_event(info.pool_id, info.epoch, tuple(row))
        except ValueError:
            continue
