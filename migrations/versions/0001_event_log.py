"""Event log: pool_epochs and allocator_events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:28:54
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pool_epochs",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("writer_id", sa.String(length=64), nullable=False),
        sa.Column("num_blocks", sa.Integer(), nullable=False),
        sa.Column("block_size", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=True),
        sa.Column("opened_wall_ns", sa.BigInteger(), nullable=False),
        sa.Column("durable_seq", sa.BigInteger(), nullable=False),
        sa.Column("head_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("closed_seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("pool_id", "epoch", name=op.f("pk_pool_epochs")),
    )
    op.create_table(
        "allocator_events",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("owner", sa.String(length=256), nullable=True),
        sa.Column("record", sa.Text(), nullable=False),
        sa.Column("hash", sa.LargeBinary(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_allocator_events_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "seq", name=op.f("pk_allocator_events")),
    )


def downgrade() -> None:
    op.drop_table("allocator_events")
    op.drop_table("pool_epochs")
