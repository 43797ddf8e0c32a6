"""Packed event rows: one ``allocator_events`` row may hold a run of block events.

Adds ``allocator_events.last_seq`` and ``allocator_events.records``. A packed
row (``kind`` 'packed') holds seqs ``seq..last_seq``: ``records`` is their
record lines, each exactly the text the hash chain covers, joined by ``\\n``
and compressed with zlib; ``hash`` is the chain's hash at ``last_seq``;
``record`` is empty and ``owner``/``block_key`` NULL. Rows written before
(and every POOL_INIT, SNAPSHOT and POOL_CLOSE row) keep both columns NULL and
read exactly as before, so old logs replay unchanged; an older nanoserve
reading a packed row would see an unknown kind (``packed_rows``).

Downgrading unpacks every packed row into one row per event first, each with
its chained hash, so no event is lost (their ``block_key`` stays NULL, as in
rows written before 0002: the record holds every key).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 02:40:00
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocator_events") as batch:
        batch.add_column(sa.Column("last_seq", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("records", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    _unpack_rows()
    with op.batch_alter_table("allocator_events") as batch:
        batch.drop_column("records")
        batch.drop_column("last_seq")


def _unpack_rows() -> None:
    """Replace each packed row by one row per event (seq, kind, owner, record, chained hash)."""
    conn = op.get_bind()
    events = sa.table(
        "allocator_events",
        *(sa.column(name) for name in ("pool_id", "epoch", "seq", "kind", "owner", "record", "hash")),
        sa.column("last_seq"),
        sa.column("records", sa.LargeBinary()),
    )
    packed = conn.execute(
        sa.select(events.c.pool_id, events.c.epoch, events.c.seq, events.c.last_seq, events.c.records)
        .where(events.c.last_seq.is_not(None))
        .order_by(events.c.pool_id, events.c.epoch, events.c.seq)
    ).fetchall()
    for pool_id, epoch, first_seq, last_seq, blob in packed:
        previous = conn.execute(
            sa.select(events.c.hash)
            .where(events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq < first_seq)
            .order_by(events.c.seq.desc())
            .limit(1)
        ).scalar()
        assert previous is not None, f"packed row at seq {first_seq} has no row before it"  # POOL_INIT is one
        records = zlib.decompress(blob).decode().split("\n")
        assert len(records) == last_seq - first_seq + 1, f"packed row at seq {first_seq} is damaged"
        rows = []
        for offset, record in enumerate(records):
            previous = hashlib.sha256(bytes(previous) + record.encode()).digest()
            fields = record.split("|", 8)
            rows.append(
                {
                    "pool_id": pool_id,
                    "epoch": epoch,
                    "seq": first_seq + offset,
                    "kind": fields[2],
                    "owner": fields[8],
                    "record": record,
                    "hash": previous,
                }
            )
        conn.execute(
            sa.delete(events).where(events.c.pool_id == pool_id, events.c.epoch == epoch, events.c.seq == first_seq)
        )
        conn.execute(sa.insert(events), rows)
