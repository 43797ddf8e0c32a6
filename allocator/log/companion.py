"""Companion rows: another table's rows that commit in the log's own transactions.

The engine keeps its request journal beside the allocator's events: a step's
journal records must be durable exactly when the step's block events are, so
the writer inserts them in the transaction that commits the events (one group
commit, one watermark). The log knows nothing of what they hold. It numbers
the records of an epoch 1, 2, 3, ... on the caller's thread (the companion
seq), hands each batch's records with the batch's step and wall time to the
records' ``table``, which builds their stored rows (as many as it likes: the
journal stores a step's records in one row), inserts and finds them. Everything else (the
table, its columns, the payload's codec) belongs to the records' owner.

A companion-only commit (a step that took no block) moves the epoch row's
guard to where it was, so a retry after a lost acknowledgement cannot
recognise itself by the guard: it meets its own rows' unique key, and
``CompanionTable.holds`` tells whether the group's last row is the one stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import sqlalchemy as sa

# one stored companion row, in its table's column order; the log never looks inside
CompanionRow = Sequence[Any]


class CompanionTable(Protocol):
    """Where companion records are stored: builds their rows, inserts them, finds them again."""

    def rows(
        self,
        records: Sequence[Any],
        pool_id: str,
        epoch: int,
        first_seq: int,
        step: int | None,
        wall_ns: int,
        writer_id: str,
    ) -> list[CompanionRow]:
        """The stored rows of one batch's ``records``, companion seqs ``first_seq``, ... of ``(pool_id,
        epoch)``; ``step`` and ``wall_ns`` are the batch's (None: outside any step). Called once per
        batch, in companion seq order, on the writer's thread. ``writer_id`` names the log that
        writes them (its writer's id, unique per ``EventLog.open``): a table that keeps state between
        batches (a chain's head) keys it by the writer too, since one process may write two logs
        whose pool ids and epochs are the same (two ``LLM``s, each with its own file)."""
        ...

    def insert(self, conn: sa.Connection, rows: Sequence[CompanionRow]) -> None:
        """Insert ``rows`` inside ``conn``'s transaction (the one that commits their events)."""
        ...

    def holds(self, conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bool:
        """Whether companion seq ``seq`` of ``(pool_id, epoch)`` is stored (an earlier attempt's)."""
        ...

    def num_bytes(self, rows: Sequence[CompanionRow]) -> int:
        """The bytes ``rows`` take in the store, near enough for the log's pending-bytes figure."""
        ...


class CompanionRecord(Protocol):
    """One record the caller hands ``EventLog.append_batch`` beside its events; ``table`` stores it."""

    @property
    def table(self) -> CompanionTable: ...


def seal_companions(
    records: Sequence[CompanionRecord],
    pool_id: str,
    epoch: int,
    first_seq: int,
    step: int | None,
    wall_ns: int,
    writer_id: str,
) -> tuple[CompanionTable | None, list[CompanionRow]]:
    """The stored rows of one batch's ``records`` (seqs ``first_seq``, ...) and the table that holds
    them; (None, []) for none. Every record of a batch must name the same table."""
    if not records:
        return None, []
    table = records[0].table
    for seq, record in enumerate(records, first_seq):
        assert record.table is table, f"companion seq {seq} names another table than seq {first_seq}"
    return table, table.rows(records, pool_id, epoch, first_seq, step, wall_ns, writer_id)


class CompanionSegment(NamedTuple):
    """The companion rows that move with an archived segment of an open epoch (``segment_archive``).

    Every row of ``tables`` (each with the column holding its companion seq)
    of the epoch whose seq is below ``end_seq`` moves; the kept rows' chain
    starts at ``end_seq`` from ``head_hash`` (the chain's hash at
    ``end_seq - 1``, 32 bytes); ``first_seq`` is the first seq that moves.
    """

    first_seq: int
    end_seq: int
    head_hash: bytes
    tables: tuple[tuple[str, str], ...]  # (table name, its companion seq column)


class SegmentCompanion(Protocol):
    """The companion's owner deciding which of its rows may leave the live log with a segment."""

    def segment(self, conn: sa.Connection, pool_id: str, epoch: int) -> CompanionSegment | None:
        """The rows of ``(pool_id, epoch)`` that no reader of the live log needs any more (None: none);
        called on ``conn`` just before the segment's rows are copied."""
        ...
