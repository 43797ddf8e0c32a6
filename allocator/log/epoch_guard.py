"""The epoch row's guard: how a group commit proves it is this writer's next one.

Each commit first moves the epoch row's ``(durable_seq, head_hash)`` from the
values this writer last wrote to the new ones, where ``writer_id`` is still
this writer's, and inserts its rows in the same transaction. A second writer
therefore cannot interleave, and a retry after a lost acknowledgement finds
the guard already moved and recognises its own group by the stored hash of
its last seq (``check_own_commit``). On PostgreSQL the same update carries the
pool lock's ``fence`` (``pool_lock``): a writer whose lock session died commits
nothing, even to its own epoch, until it holds the lock again.
"""

from __future__ import annotations

from typing import NamedTuple

import sqlalchemy as sa

from nanoserve.allocator.log.batch import Companions
from nanoserve.allocator.log.errors import EventLogError, SecondWriterError
from nanoserve.allocator.log.key_refs import KeyIds
from nanoserve.allocator.log.row_scan import stored_hash
from nanoserve.allocator.log.schema import pool_epochs
from nanoserve.allocator.log.store import Row, insert_rows


class GuardMoved(Exception):
    """The epoch row no longer holds what this writer last wrote."""


class EpochGuard(NamedTuple):
    """What the epoch row must hold for this writer's next commit: its id and the durable_seq it last wrote."""

    pool_id: str
    epoch: int
    writer_id: str
    written_seq: int


def commit_group(
    engine: sa.Engine,
    guard: EpochGuard,
    rows: list[Row],
    last_seq: int,
    head_hash: bytes,
    closed_seq: int | None,
    companions: Companions,
    fence: sa.ColumnElement[bool] | sa.TextClause | None = None,
    key_ids: KeyIds | None = None,
) -> None:
    """Move the guard to ``(last_seq, head_hash, closed_seq)`` and insert ``rows`` and ``companions``
    in one transaction. Raises GuardMoved (nothing committed) when the row no longer holds ``guard``
    or ``fence`` (the pool lock's, when given) is false. ``key_ids``: the writer's stored keys
    (``store.insert_rows``), whose staged keys its caller commits once this returns, or once a
    GuardMoved proves this attempt's earlier try committed (``check_own_commit``)."""
    table = pool_epochs
    move = (
        sa.update(table)
        .where(
            table.c.pool_id == guard.pool_id,
            table.c.epoch == guard.epoch,
            table.c.writer_id == guard.writer_id,
            table.c.durable_seq == guard.written_seq,
        )
        .values(durable_seq=last_seq, head_hash=head_hash, closed_seq=closed_seq)
    )
    if fence is not None:
        move = move.where(fence)
    with engine.begin() as conn:
        if conn.execute(move).rowcount != 1:
            raise GuardMoved
        if rows:
            insert_rows(conn, rows, key_ids)
        if companions.table is not None:
            companions.table.insert(conn, companions.rows)


def check_own_commit(engine: sa.Engine, guard: EpochGuard, last_seq: int, head_hash: bytes, durable_seq: int) -> None:
    """After GuardMoved: returns when the stored group is this writer's own earlier attempt (the
    epoch still its, seq ``last_seq`` stored with ``head_hash``). Raises SecondWriterError when
    another writer holds the epoch, EventLogError when the stored log diverged."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(pool_epochs.c.writer_id, pool_epochs.c.durable_seq).where(
                pool_epochs.c.pool_id == guard.pool_id, pool_epochs.c.epoch == guard.epoch
            )
        ).one_or_none()
        head_stored = stored_hash(conn, guard.pool_id, guard.epoch, last_seq)
    if row is None or row.writer_id != guard.writer_id:
        raise SecondWriterError(
            f"pool {guard.pool_id!r} epoch {guard.epoch} is held by another writer; "
            f"this writer ({guard.writer_id}) stops at seq {durable_seq}"
        )
    if head_stored != head_hash:
        raise EventLogError(
            f"pool {guard.pool_id!r} epoch {guard.epoch}: stored log diverged at seq <= {last_seq} "
            f"(durable_seq in the database is {row.durable_seq})"
        )
