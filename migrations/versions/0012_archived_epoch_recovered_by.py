"""The manifest says which epoch recovered a crashed epoch it names (``archived_epochs.recovered_by``).

An archive file holds one epoch's rows, its ``pool_epochs`` row without POOL_CLOSE
when the epoch crashed; the RECOVER record that says which epoch took it over is
in the next epoch's rows, not there, so a reader of the file alone named it
``open (running, or crashed)``. Since this revision ``archive_epoch`` writes the
epoch's manifest row into the file as well, with ``recovered_by`` (the epoch whose
RECOVER record names it, read from the live log when the file is written; NULL:
it closed, or no RECOVER names it): a file's readers know it holds a finished
epoch, and who recovered it. The live log's manifest rows carry the same value.
Downgrading drops the column (the archives' own rows stay, without it).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 13:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("archived_epochs", sa.Column("recovered_by", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("archived_epochs") as batch:
        batch.drop_column("recovered_by")
