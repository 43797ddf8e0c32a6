"""Alembic environment: URL from the application's config, metadata from the models.

Imports nothing of nanoserve but the schemas: the event log's
(``nanoserve.allocator.log.schema``, whose ``Base`` holds the metadata) and the
request journal's (``nanoserve.engine.journal.schema``, declared on that
``Base``). Neither imports the migrations; the migrations need only the tables.

Migrations serialize: two servers starting on a fresh log at once must not both
create its tables. Each upgrade runs in one transaction that first takes a lock
the other waits for, and only then reads the schema's revision: on PostgreSQL a
transaction-level advisory lock of its own key (``MIGRATION_LOCK_KEY``; a pool's
own lock, if any, is another key), on SQLite the database's write lock
(``BEGIN IMMEDIATE``, waited for up to the busy timeout).
"""

from __future__ import annotations

import contextlib
import logging.config
import os
from typing import Any

import sqlalchemy as sa
from alembic import context

from nanoserve.allocator.log.schema import Base
from nanoserve.engine.journal import schema as journal_schema

config = context.config
# Only the Alembic CLI configures logging; programmatic upgrades leave the app's alone.
if config.config_file_name is not None and config.get_main_option("configure_logging", "false") == "true":
    logging.config.fileConfig(config.config_file_name)

# one metadata: the journal's table is declared on the log's Base (its rows reference the log's epochs)
target_metadata = Base.metadata
assert journal_schema.request_journal.metadata is target_metadata, "the journal's table is on the log's Base"

# pg_advisory_xact_lock key held while migrating: the bytes "nsmigrat" as a signed 64-bit integer
MIGRATION_LOCK_KEY = int.from_bytes(b"nsmigrat", "big", signed=True)
SQLITE_BUSY_TIMEOUT_S = 30.0
SQLITE_PAGE_SIZE = 8192  # bytes per page of a new file: allocator.log.store.SQLITE_PAGE_SIZE


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("NANOSERVE_EVENT_LOG_URL")
    )
    if not url:
        raise RuntimeError(
            "no database URL: pass -x url=URL or set NANOSERVE_EVENT_LOG_URL (or run nanoserve db upgrade URL)"
        )
    return url


def _include_name(name: str | None, type_: str, parent_names: object) -> bool:
    # The log may share a database with other applications: compare only our tables.
    return type_ != "table" or name in target_metadata.tables


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        include_name=_include_name,
        render_as_batch=True,  # SQLite alters tables by copying them
        **kwargs,
    )


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _create_private_file(path: str) -> None:
    """Create the SQLite file 0600 (owner only) when there is none, as ``allocator.log.store`` does:
    the migrations import only the schemas, so the three lines are repeated here."""
    # an existing file keeps its mode; a missing folder is SQLite's error to name
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _sqlite_page_size(dbapi_connection: Any, _record: Any) -> None:
    """A new SQLite file's page size, set before the first table makes it permanent: the same
    ``SQLITE_PAGE_SIZE`` as ``allocator.log.store`` (repeated here for the reason above)."""
    dbapi_connection.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")


def run_migrations_online() -> None:
    url = sa.engine.make_url(_url())
    if url.get_backend_name() == "sqlite":
        if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
            _create_private_file(url.database)
        # the driver leaves transactions to us, and each begins by taking the write lock
        engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "isolation_level": None})
        sa.event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
        sa.event.listen(engine, "connect", _sqlite_page_size)
    else:
        engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            _configure(connection=connection, transactional_ddl=True)
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
