"""Journal steps: one binary, hash-chained row per step (journal_steps) and an admissions index.

Self-contained: two new tables; ``request_journal`` stays, so logs written
before keep reading (the journal's readers read both). New records go to
``journal_steps`` only.

Revision ID: 0005
Revises: 0003
Create Date: 2026-12-06 05:15:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "journal_steps",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("wall_ns", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("hash", sa.LargeBinary(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_journal_steps_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "first_seq", name=op.f("pk_journal_steps")),
    )
    op.create_table(
        "journal_requests",
        sa.Column("pool_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("journal_seq", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.String(length=256), nullable=False),
        sa.ForeignKeyConstraint(
            ["pool_id", "epoch"],
            ["pool_epochs.pool_id", "pool_epochs.epoch"],
            name=op.f("fk_journal_requests_pool_id_pool_epochs"),
        ),
        sa.PrimaryKeyConstraint("pool_id", "epoch", "journal_seq", name=op.f("pk_journal_requests")),
    )
    op.create_index("ix_journal_requests_pool_id_request_id", "journal_requests", ["pool_id", "request_id"])


def downgrade() -> None:
    op.drop_index("ix_journal_requests_pool_id_request_id", table_name="journal_requests")
    op.drop_table("journal_requests")
    op.drop_table("journal_steps")
