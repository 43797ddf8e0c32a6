"""Prefix caching: the block key of REGISTER, SHARE, RELEASE, EVICT and CACHE_RESET events.

Adds ``allocator_events.block_key``: the key (hex sha256) of the first block a
prefix-cache event names, indexed, so that SQL can find every event of one
cached block (``WHERE block_key = ...``) without parsing records. The record
itself (which the hash chain covers) carries every key; rows written before
this migration, and rows of the other kinds, hold NULL. Old logs replay
unchanged: their kinds and records are the same.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 23:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("allocator_events") as batch:
        batch.add_column(sa.Column("block_key", sa.String(length=64), nullable=True))
        batch.create_index(batch.f("ix_allocator_events_block_key"), ["block_key"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("allocator_events") as batch:
        batch.drop_index(batch.f("ix_allocator_events_block_key"))
        batch.drop_column("block_key")
