"""Request journal: request_journal (admissions, released outputs, endings per step).

Self-contained: one new table and its index, nothing of the existing tables
changes, so logs written before it still replay.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 22:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "request_journal",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("journal_seq", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("wall_ns", sa.BigInteger(), nullable=False),
        sa.Column("record", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_request_journal_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "journal_seq", name=op.f("pk_request_journal")),
    )
    op.create_index("ix_request_journal_pool_id_request_id", "request_journal", ["pool_id", "request_id"])


def downgrade() -> None:
    op.drop_index("ix_request_journal_pool_id_request_id", table_name="request_journal")
    op.drop_table("request_journal")
