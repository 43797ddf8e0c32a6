"""Segment manifest: archived_segments (one row per older part of an open epoch moved into an archive file,
with the companion (request journal) rows moved beside it).

Self-contained: one new table, nothing of the existing tables changes, so logs
written before it still replay; an older nanoserve ignores the table (and would
audit a cut epoch from genesis: missing seqs).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "archived_segments",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("head_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("archived_wall_ns", sa.BigInteger(), nullable=False),
        sa.Column("companion_first_seq", sa.BigInteger(), nullable=True),
        sa.Column("companion_last_seq", sa.BigInteger(), nullable=True),
        sa.Column("companion_head_hash", sa.LargeBinary(length=32), nullable=True),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "first_seq", name=op.f("pk_archived_segments")),
    )


def downgrade() -> None:
    op.drop_table("archived_segments")
