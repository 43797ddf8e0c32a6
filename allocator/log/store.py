"""The event log's database: engines (SQLite WAL by default, PostgreSQL in production) and bulk inserts."""

from __future__ import annotations

import os
import sqlite3
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from nanoserve.allocator.log.key_refs import KeyIds
from nanoserve.allocator.log.key_table import has_key_table, insert_keys
from nanoserve.allocator.log.packed_rows import STORED_COLUMNS, pack_rows
from nanoserve.allocator.log.schema import allocator_events

# one stored event: (pool_id, epoch, seq, kind, owner, record, hash, block_key), in ROW_COLUMNS order
Row = tuple[str, int, int, str, "str | None", str, bytes, "str | None"]
ROW_COLUMNS = ("pool_id", "epoch", "seq", "kind", "owner", "record", "hash", "block_key")

# The server's default log: a SQLite file in the working directory.
DEFAULT_EVENT_LOG_URL = "sqlite:///nanoserve-log.db"


# seconds a PostgreSQL connection attempt may take before it fails (and is retried by the writer)
PG_CONNECT_TIMEOUT_S = 5
SQLITE_BUSY_TIMEOUT_MS = 10_000
# bytes per page of a new SQLite log (SQLite's default is 4096): the journal's step rows with
# logprobs are 1.5-2.7 KB, of which a 4 KB page holds one, leaving a third of the file empty; an
# existing file keeps the size it was created with (the pragma is a no-op once a table exists)
SQLITE_PAGE_SIZE = 8192


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # The busy timeout first, so that switching to WAL waits for another process's
    # transaction instead of failing at once. WAL lets readers (audit, replay, the CLI)
    # run beside the writer; synchronous=FULL makes a commit durable before durable_seq advances.
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")  # before WAL, which fixes a new file's page size
    _while_busy(cursor, "PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _while_busy(cursor: Any, sql: str) -> None:
    """``cursor.execute(sql)``, again while SQLite says the database is locked, up to the busy timeout.

    Setting the journal mode is answered "database is locked" at once, without
    the busy handler, while another process opens the same file's WAL (its
    recovery holds the WAL index): two servers starting on one fresh log met it.
    """
    deadline_s = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute(sql)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline_s:
                raise
            time.sleep(0.01)


def _sqlite_read_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.close()


def sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///FILE`` URL; None for other databases and in-memory SQLite."""
    parsed = sa.engine.make_url(url)
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def create_private_file(path: Path | str) -> None:
    """Create the file at ``path`` empty with mode 0600 (owner read/write) when there is none.

    The log holds the users' requests and outputs: SQLite would create its file
    with 0666 less the process's umask (0644 under the usual 022). SQLite gives
    the database's ``-wal`` and ``-shm`` files the database file's own mode, so
    they are 0600 too. An existing file keeps its mode (the operator's choice).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except FileNotFoundError:  # no such folder: SQLite names the error when it opens the file
        return
    os.close(fd)


def create_log_engine(url: str, *, read_only: bool = False) -> Engine:
    """An engine for ``url`` (``sqlite:///file.db`` or ``postgresql+psycopg://...``).

    A SQLite file that does not exist yet is created 0600 (``create_private_file``).
    SQLite connections get a 10 s busy timeout, WAL journaling and
    synchronous=FULL; with ``read_only`` they open the file read-only
    (``mode=ro``; on media nobody can write, such as a read-only mount, as
    ``immutable``) and change nothing in it. PostgreSQL connections give up
    connecting after PG_CONNECT_TIMEOUT_S. Raises ValueError for a URL
    SQLAlchemy cannot parse.
    """
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ValueError(f"event log url {url!r} is not a database URL: {exc}") from exc
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_file(url)
        if read_only and path is not None:
            # the URL still names the file (replay hands it to the chain verifier); the creator opens it
            engine = sa.create_engine(parsed, creator=lambda: _connect_read_only(path))
            sa.event.listen(engine, "connect", _sqlite_read_pragmas)
            return engine
        if path is not None:
            create_private_file(path)
        engine = sa.create_engine(parsed, connect_args={"check_same_thread": False})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {"connect_timeout": PG_CONNECT_TIMEOUT_S} if parsed.get_backend_name() == "postgresql" else {}
    return sa.create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to an SQLite file.

    ``mode=ro`` reads beside a live writer. A WAL file on media nobody can
    write (its ``-shm`` cannot be created) opens only as ``immutable``, which
    is exact there because nothing can change the file.
    """
    uri = f"file:{quote(str(path.resolve()))}"
    connection = sqlite3.connect(f"{uri}?mode=ro", uri=True, check_same_thread=False)
    try:
        connection.execute("PRAGMA schema_version").fetchone()  # opens the file (and its -shm) now
    except sqlite3.OperationalError:
        connection.close()
        if os.access(path.parent, os.W_OK) or not path.is_file():
            raise
        return sqlite3.connect(f"{uri}?immutable=1", uri=True, check_same_thread=False)
    return connection


def insert_rows(conn: sa.Connection, rows: list[Row], key_ids: KeyIds | None = None) -> None:
    """Store event rows (seqs in a run) inside ``conn``'s transaction through the driver itself
    (``insert_through_driver``), each run of block events packed into one row (``packed_rows``).

    key_ids: the writer's keys of this epoch (``key_refs``): the packed
    records name their keys by id, and the keys stored first here go into
    ``allocator_keys`` in this transaction. The attempt starts over in
    ``key_ids`` (``KeyIds.begin``); its caller commits them once the
    transaction is committed. A log whose schema predates migration 0009
    stores the keys in the records, as before; one that predates 0008 (its
    operator migrates it, not the writer) is written one row per event."""
    if _stores_packed_rows(conn):
        keyed = key_ids if key_ids is not None and has_key_table(conn) else None
        if keyed is not None:
            keyed.begin()
        stored = pack_rows(rows, keyed)
        staged = None if keyed is None else keyed.staged_row()
        if staged is not None:
            insert_keys(conn, rows[0][0], rows[0][1], *staged)
        insert_through_driver(conn, allocator_events, STORED_COLUMNS, stored)
    else:
        insert_through_driver(conn, allocator_events, ROW_COLUMNS, rows)


# engine -> whether its allocator_events has the packed rows' columns, looked up at its first insert
_PACKED_SCHEMA: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def _stores_packed_rows(conn: sa.Connection) -> bool:
    packed = _PACKED_SCHEMA.get(conn.engine)
    if packed is None:
        columns = sa.inspect(conn).get_columns(allocator_events.name)
        packed = _PACKED_SCHEMA[conn.engine] = any(column["name"] == "records" for column in columns)
    return packed


def insert_through_driver(
    conn: sa.Connection, table: sa.Table, columns: Sequence[str], rows: Sequence[Sequence[Any]]
) -> None:
    """Insert ``rows`` (values in ``columns`` order) into ``table`` inside ``conn``'s transaction.

    PostgreSQL gets COPY, SQLite one executemany of a prepared INSERT: SQLAlchemy's
    per-row parameter processing cost more than the database's own work here.
    """
    if not rows:
        return
    driver = conn.connection.driver_connection
    assert driver is not None, "a connection inside a transaction has its driver connection"
    cursor = driver.cursor()
    names = ", ".join(columns)
    try:
        if conn.dialect.name == "postgresql":
            with cursor.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            marker = "?" if conn.dialect.paramstyle == "qmark" else "%s"
            placeholders = ", ".join([marker] * len(columns))
            cursor.executemany(f"INSERT INTO {table.name} ({names}) VALUES ({placeholders})", rows)
    finally:
        cursor.close()
