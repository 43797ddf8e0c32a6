"""The pool's epoch rows: the arguments of a new epoch, the newest epoch, a new one inserted with its first batch.

``EventLog.open`` picks the pool's newest epoch + 1 and inserts its row in the
transaction that commits POOL_INIT (and the companion rows handed to ``open``):
the epoch exists with its first records or not at all, and the row's primary
key refuses a second server that picked the same epoch at the same moment.
"""

from __future__ import annotations

import sqlalchemy as sa

from nanoserve.allocator.log.batch import Companions
from nanoserve.allocator.log.errors import SecondWriterError
from nanoserve.allocator.log.schema import pool_epochs
from nanoserve.allocator.log.store import Row, insert_rows
from nanoserve.allocator.log.writer import LogWriter


def check_open_args(
    pool_id: str,
    num_blocks: int,
    block_size: int,
    num_events_per_snapshot: int,
    max_pending_batches: int,
    epoch: int | None,
) -> None:
    """ValueError, naming the argument and its allowed range, for a bad argument of ``EventLog.open``."""
    if type(pool_id) is not str or not 0 < len(pool_id) <= 128:
        raise ValueError(f"pool_id must be a str of 1..128 characters, got {pool_id!r}")
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_events_per_snapshot", num_events_per_snapshot),
        ("max_pending_batches", max_pending_batches),
    ):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if epoch is not None and (type(epoch) is not int or epoch < 1):
        raise ValueError(f"epoch must be an int >= 1 or None, got {epoch!r}")


def newest_epoch(engine: sa.Engine, pool_id: str) -> int:
    """The newest epoch of ``pool_id`` in the log (0: none yet)."""
    with engine.connect() as conn:
        newest = conn.execute(
            sa.select(sa.func.max(pool_epochs.c.epoch)).where(pool_epochs.c.pool_id == pool_id)
        ).scalar()
    return newest or 0


def insert_epoch(
    engine: sa.Engine,
    writer: LogWriter,
    num_blocks: int,
    block_size: int,
    model: str | None,
    rows: list[Row],
    head_hash: bytes,
    opened_wall_ns: int,
    companions: Companions,
) -> None:
    """Insert the epoch row of ``writer``'s epoch with its first batch (``rows``, ``companions``) in one
    transaction. Raises SecondWriterError when that epoch already exists (another server opened it)."""
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(pool_epochs).values(
                    pool_id=writer.pool_id,
                    epoch=writer.epoch,
                    writer_id=writer.writer_id,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    model=model,
                    opened_wall_ns=opened_wall_ns,
                    durable_seq=rows[-1][2],
                    head_hash=head_hash,
                    closed_seq=None,
                )
            )
            insert_rows(conn, rows)
            if companions.table is not None:
                companions.table.insert(conn, companions.rows)
    except sa.exc.IntegrityError as exc:
        raise SecondWriterError(
            f"pool {writer.pool_id!r} epoch {writer.epoch} already has a writer: another server opened it at "
            f"the same moment and is writing pool {writer.pool_id!r} to this log. Give each server its own "
            "pool (--pool-id), or stop the other server, then start this one again"
        ) from exc
