"""A step's batch of records and its sealing into stored rows (encoded, hash-chained).

The caller's thread makes one ``Batch`` per step; the writer thread seals a
group of them into event rows (``seal_event_rows``: each record encoded by
``record_codec`` and chained to the one before; ``store.insert_rows`` packs
each run of block events into one stored row, ``packed_rows``) and companion rows
(``seal_companion_rows``: handed to their own table, ``companion``) and
commits both in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.log.companion import CompanionRecord, CompanionRow, CompanionTable, seal_companions
from nanoserve.allocator.log.hash_chain import chain_hash
from nanoserve.allocator.log.record_codec import encode_block_record, encode_data_record
from nanoserve.allocator.log.store import Row


class Batch(NamedTuple):
    """Records ``first_seq..last_seq`` of one epoch, committed together or not at all.

    events: block events, seqs ``first_seq``, ``first_seq + 1``, ...
    data_kind, data: one POOL_INIT, SNAPSHOT or POOL_CLOSE record after the
        events, carrying ``data`` (JSON-serialisable); None for none.
    companions: companion records of the same step (the engine's request journal),
        companion seqs ``first_companion_seq``, ...: stored by their own table in
        the same transaction (``companion``).
    Every record of the batch carries ``step`` and the batch's two times.
    (A NamedTuple: the engine's thread makes one per step, at the cost of a tuple.)
    """

    first_seq: int
    step: int | None
    wall_time_ns: int
    monotonic_ns: int
    events: Sequence[BlockEvent] = ()
    data_kind: EventKind | None = None
    data: Any = None
    companions: Sequence[CompanionRecord] = ()
    first_companion_seq: int = 0

    @property
    def num_records(self) -> int:
        return len(self.events) + (self.data_kind is not None)

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.num_records - 1


class Companions(NamedTuple):
    """The companion rows of one commit: their table (None: no rows), rows, the last companion seq."""

    table: CompanionTable | None
    rows: list[CompanionRow]
    last_seq: int

    @property
    def num_bytes(self) -> int:
        return self.table.num_bytes(self.rows) if self.table is not None else 0


class SealedRows(NamedTuple):
    """Event rows of a group of batches: the rows, the last seq, its hash, the seq of POOL_CLOSE (None: none)."""

    rows: list[Row]
    last_seq: int
    head_hash: bytes
    closed_seq: int | None


def seal_event_rows(
    batches: Sequence[Batch], pool_id: str, epoch: int, first_seq: int, previous_hash: bytes
) -> SealedRows:
    """The rows of ``batches``' records, seqs ``first_seq``, ..., each hash chained to the one before
    (``previous_hash``: the hash of seq ``first_seq - 1``); each record's batch_seq is its batch's last seq."""
    rows: list[Row] = []
    previous = previous_hash
    closed_seq = None
    seq = first_seq
    for batch in batches:
        assert batch.first_seq == seq, f"batch from seq {batch.first_seq} sealed where seq {seq} was due"
        batch_seq, step, wall_ns, mono_ns = batch.last_seq, batch.step, batch.wall_time_ns, batch.monotonic_ns
        for event in batch.events:
            record = encode_block_record(seq, batch_seq, event, step, wall_ns, mono_ns)
            previous = chain_hash(previous, record)
            key = event.keys[0] if event.keys else None
            rows.append((pool_id, epoch, seq, event.kind.value, event.owner, record, previous, key))
            seq += 1
        if batch.data_kind is not None:
            record = encode_data_record(seq, batch_seq, batch.data_kind, batch.data, step, wall_ns, mono_ns)
            previous = chain_hash(previous, record)
            if batch.data_kind is EventKind.POOL_CLOSE:
                closed_seq = seq
            rows.append((pool_id, epoch, seq, batch.data_kind.value, None, record, previous, None))
            seq += 1
    return SealedRows(rows, seq - 1, previous, closed_seq)


def seal_companion_rows(batches: Sequence[Batch], pool_id: str, epoch: int, writer_id: str) -> Companions:
    """The companion rows of ``batches``, in companion seq order, with the one table that stores them
    (``writer_id``: the writing log's, see ``CompanionTable.rows``)."""
    table: CompanionTable | None = None
    rows: list[CompanionRow] = []
    last_seq = 0
    for batch in batches:
        if not batch.companions:
            continue
        batch_table, batch_rows = seal_companions(
            batch.companions, pool_id, epoch, batch.first_companion_seq, batch.step, batch.wall_time_ns, writer_id
        )
        assert table is None or batch_table is table, "one commit's companion records name two tables"
        table = batch_table
        rows += batch_rows
        last_seq = batch.first_companion_seq + len(batch.companions) - 1
    return Companions(table, rows, last_seq)
