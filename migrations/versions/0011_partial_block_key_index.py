"""The block_key index holds only the rows that have a key (a partial index).

``ix_allocator_events_block_key`` (migration 0002) indexed every row of
``allocator_events``. Since migration 0008 nearly every row is a packed row,
whose ``block_key`` is NULL, so nearly every entry of the index was a NULL
that no query looks for (a query for a key, ``WHERE block_key = ...``,
implies ``block_key IS NOT NULL``: SQLite and PostgreSQL both use the
partial index for it). The index is made again with ``WHERE block_key IS NOT
NULL`` under its name.

On PostgreSQL the index is made on the partitioned table (migration 0010):
PostgreSQL makes it on every partition, and on each partition made later.
Downgrading makes the full index again.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 06:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_allocator_events_block_key"
_HAS_KEY = sa.text("block_key IS NOT NULL")


def upgrade() -> None:
    op.drop_index(_INDEX, table_name="allocator_events")
    op.create_index(
        _INDEX, "allocator_events", ["block_key"], unique=False, sqlite_where=_HAS_KEY, postgresql_where=_HAS_KEY
    )


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="allocator_events")
    op.create_index(_INDEX, "allocator_events", ["block_key"], unique=False)
