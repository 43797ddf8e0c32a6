"""Journal checkpoints: journal_checkpoints (the requests live at a journal seq, every few thousand records).

Self-contained: one new table, nothing of the existing tables changes. An epoch
written before it has no checkpoint, and recovery reads its whole journal as
before; an older nanoserve ignores the table.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 23:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "journal_checkpoints",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("hash", sa.LargeBinary(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_journal_checkpoints_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "last_seq", name=op.f("pk_journal_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("journal_checkpoints")
