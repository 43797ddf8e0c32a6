"""PostgreSQL: the tables keyed by (pool_id, epoch) are partitioned by it, one partition per epoch.

Each table of ``EPOCH_TABLES`` becomes ``PARTITION BY RANGE (pool_id, epoch)``
with one partition per epoch, ``FOR VALUES FROM (pool, N) TO (pool, N + 1)``,
named ``<table>_p<12 hex of sha256(pool)>_e<N>`` (``schema.epoch_partition_name``),
and a DEFAULT partition ``<table>_default``, so that no row is ever refused for
want of a partition. Archiving an epoch then drops its partitions instead of
deleting its rows (``archive.archive_epoch``); ``EventLog.open`` creates a new
epoch's partitions. ``pool_epochs`` (one row per epoch, the tables' foreign key)
stays a plain table.

Each table is rebuilt: renamed aside, its primary key and indexes dropped there
(their names are taken over), created again partitioned with the same columns,
a partition made for every epoch of ``pool_epochs``, its rows copied, its
primary key (which starts with the partition key, as PostgreSQL requires),
foreign keys and indexes made again under their names, the old table dropped.
Downgrading rebuilds each as a plain table the same way, with every row.
SQLite has no partitions: there both directions do nothing.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 05:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from nanoserve.allocator.log.schema import EPOCH_PARTITION_KEY, create_epoch_partition, default_partition_name

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the tables whose primary key starts with (pool_id, epoch): one place, so that a table can be added
EPOCH_TABLES = (
    "allocator_events",
    "allocator_keys",
    "request_journal",
    "journal_steps",
    "journal_requests",
    "journal_checkpoints",
)


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        for table in EPOCH_TABLES:
            _rebuild(conn, table, partitioned=True)


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        for table in EPOCH_TABLES:
            _rebuild(conn, table, partitioned=False)


def _rebuild(conn: sa.Connection, table: str, *, partitioned: bool) -> None:
    """Create ``table`` again, partitioned by epoch or plain, with its columns, keys, indexes and rows."""
    quote = conn.dialect.identifier_preparer.quote
    inspector = sa.inspect(conn)
    primary_key = inspector.get_pk_constraint(table)
    foreign_keys = inspector.get_foreign_keys(table)
    indexes = inspector.get_indexes(table)
    old = f"{table}_before_0010"
    conn.exec_driver_sql(f"ALTER TABLE {quote(table)} RENAME TO {quote(old)}")
    # the key's and the indexes' names are relations of the schema: free them for the new table
    conn.exec_driver_sql(f"ALTER TABLE {quote(old)} DROP CONSTRAINT {quote(str(primary_key['name']))}")
    for index in indexes:
        conn.exec_driver_sql(f"DROP INDEX {quote(str(index['name']))}")
    partition_by = f" PARTITION BY {EPOCH_PARTITION_KEY}" if partitioned else ""
    conn.exec_driver_sql(
        f"CREATE TABLE {quote(table)} (LIKE {quote(old)} INCLUDING DEFAULTS INCLUDING CONSTRAINTS){partition_by}"
    )
    if partitioned:
        conn.exec_driver_sql(f"CREATE TABLE {quote(default_partition_name(table))} PARTITION OF {quote(table)} DEFAULT")
        # every epoch of the log (the rows' foreign key), so that each table has each epoch's partition
        epochs = conn.exec_driver_sql("SELECT pool_id, epoch FROM pool_epochs ORDER BY pool_id, epoch")
        for pool_id, epoch in epochs.all():
            create_epoch_partition(conn, table, pool_id, epoch)
    conn.exec_driver_sql(f"INSERT INTO {quote(table)} SELECT * FROM {quote(old)}")
    columns = ", ".join(quote(name) for name in primary_key["constrained_columns"])
    conn.exec_driver_sql(
        f"ALTER TABLE {quote(table)} ADD CONSTRAINT {quote(str(primary_key['name']))} PRIMARY KEY ({columns})"
    )
    for key in foreign_keys:
        columns = ", ".join(quote(name) for name in key["constrained_columns"])
        referred = ", ".join(quote(name) for name in key["referred_columns"])
        conn.exec_driver_sql(
            f"ALTER TABLE {quote(table)} ADD CONSTRAINT {quote(str(key['name']))} FOREIGN KEY ({columns}) "
            f"REFERENCES {quote(key['referred_table'])} ({referred})"
        )
    for index in indexes:
        columns = ", ".join(quote(str(name)) for name in index["column_names"])
        unique = "UNIQUE " if index["unique"] else ""
        conn.exec_driver_sql(f"CREATE {unique}INDEX {quote(str(index['name']))} ON {quote(table)} ({columns})")
    conn.exec_driver_sql(f"DROP TABLE {quote(old)}")
