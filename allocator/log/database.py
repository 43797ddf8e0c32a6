"""The event log's database: engines (SQLite WAL by default, PostgreSQL in production) and bulk inserts."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from nanoserve.allocator.log.schema import allocator_events

# one stored event: (pool_id, epoch, seq, kind, owner, record, hash), in ROW_COLUMNS order
Row = tuple[str, int, int, str, "str | None", str, bytes]
ROW_COLUMNS = ("pool_id", "epoch", "seq", "kind", "owner", "record", "hash")

# The server's default log: a SQLite file in the working directory.
DEFAULT_EVENT_LOG_URL = "sqlite:///nanoserve-log.db"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (audit, replay, the CLI) run beside the writer;
    # synchronous=FULL makes a commit durable before durable_seq advances.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def create_log_engine(url: str) -> Engine:
    """An engine for ``url`` (``sqlite:///file.db`` or ``postgresql+psycopg://...``).

    SQLite connections get WAL journaling, synchronous=FULL and a 10 s busy
    timeout. Raises ValueError for a URL SQLAlchemy cannot parse.
    """
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ValueError(f"event log url {url!r} is not a database URL: {exc}") from exc
    if parsed.get_backend_name() == "sqlite":
        engine = sa.create_engine(parsed, connect_args={"check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return sa.create_engine(parsed, pool_pre_ping=True)


def insert_rows(conn: sa.Connection, rows: list[Row]) -> None:
    """Insert event rows inside ``conn``'s transaction through the driver itself.

    PostgreSQL gets COPY, SQLite one executemany of a prepared INSERT: SQLAlchemy's
    per-row parameter processing cost more than the database's own work here.
    """
    driver = conn.connection.driver_connection
    assert driver is not None, "a connection inside a transaction has its driver connection"
    cursor = driver.cursor()
    columns = ", ".join(ROW_COLUMNS)
    try:
        if conn.dialect.name == "postgresql":
            with cursor.copy(f"COPY {allocator_events.name} ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            marker = "?" if conn.dialect.paramstyle == "qmark" else "%s"
            placeholders = ", ".join([marker] * len(ROW_COLUMNS))
            cursor.executemany(f"INSERT INTO {allocator_events.name} ({columns}) VALUES ({placeholders})", rows)
    finally:
        cursor.close()
