"""Archive manifest: archived_epochs (one row per epoch moved into an archive file).

Self-contained: one new table, nothing of the existing tables changes, so logs
written before it still replay; an older nanoserve ignores the table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06 05:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "archived_epochs",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("head_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("archived_wall_ns", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("pool_id", "epoch", name=op.f("pk_archived_epochs")),
    )


def downgrade() -> None:
    op.drop_table("archived_epochs")
