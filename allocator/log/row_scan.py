"""An epoch's stored rows, straight from the driver: what replay, audit and the log tools walk.

Rows come in seq order and in chunks from the DBAPI cursor itself (a server-side
cursor on PostgreSQL), skipping SQLAlchemy's per-row processing: replay reads
millions. Damage does not stop the reading early and never escapes as the
driver's own error: text the store cannot decode is read again as bytes
(``DamagedChunk``); a page it cannot read is found row by row and raised as
``LogReadError`` with the first seq not read, after every row before it; a
store that cannot be reached raises the driver's error for ``connect`` to
name. Every seq that reaches a query is within the column's range first
(``MAX_SEQ``): a range beyond it holds no rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.log.errors import LogReadError, is_decode_error, is_store_unavailable, store_cause
from nanoserve.allocator.log.schema import allocator_events

__all__ = [
    "EVENT_COLUMNS",
    "MAX_SEQ",
    "DamagedChunk",
    "compile_for_driver",
    "event_rows",
    "last_stored_seq",
    "latest_snapshot_seq",
    "rows_query",
    "stored_hash",
]

# the largest seq a BigInteger column holds; a query for more finds nothing
MAX_SEQ = 2**63 - 1
# columns replay reads, in this order
EVENT_COLUMNS = (
    allocator_events.c.seq,
    allocator_events.c.kind,
    allocator_events.c.owner,
    allocator_events.c.record,
    allocator_events.c.hash,
)


class DamagedChunk(list[tuple[Any, ...]]):
    """Rows re-read after the store could not decode their text: text columns that are not valid
    UTF-8 come as ``bytes``. Only the checked replay takes them."""


def event_rows(
    conn: sa.Connection,
    pool_id: str,
    epoch: int,
    from_seq: int = 1,
    until_seq: int | None = None,
    *,
    owner: str | None = None,
    kind: str | None = None,
    columns: tuple[sa.ColumnElement[Any], ...] = EVENT_COLUMNS,
    num_rows_per_chunk: int = 10_000,
) -> Generator[list[tuple[Any, ...]], None, None]:
    """Stored rows (``columns``, EVENT_COLUMNS by default) of one epoch in seq order, in chunks.

    ``owner`` and ``kind`` filter on the indexed-for-display columns (replay
    never filters: it needs every row).

    Rows come straight from the driver's cursor (a server-side cursor on
    PostgreSQL), skipping SQLAlchemy's per-row result processing: replay and
    audit read millions of them. Damage does not stop the reading early: text
    the store cannot decode makes the rest come as ``DamagedChunk``s (such
    text as bytes); a page the store cannot read raises ``LogReadError`` with
    the first seq not read, after every row before it.
    """
    dbapi_error = conn.dialect.loaded_dbapi.Error
    next_seq = max(from_seq, 1)
    raw_text = False
    one_by_one = 0  # rows still to read one at a time, by primary key, to find the first unreadable one
    while True:
        selected = _as_bytes(columns) if raw_text else columns
        seq = next_seq
        if one_by_one:
            stored = _next_stored_seq(conn, pool_id, epoch, next_seq, until_seq)
            if stored is None:
                return
            seq = stored
            query = rows_query(pool_id, epoch, seq, seq, selected)
        else:
            query = rows_query(pool_id, epoch, next_seq, until_seq, selected)
        if owner is not None:
            query = query.where(allocator_events.c.owner == owner)
        if kind is not None:
            query = query.where(allocator_events.c.kind == kind)
        cursor = _cursor(conn)
        try:
            try:
                cursor.execute(*compile_for_driver(conn, query))
                while chunk := cursor.fetchmany(num_rows_per_chunk):
                    if raw_text:
                        chunk = DamagedChunk(_decoded(row, columns) for row in chunk)
                    yield chunk
                    next_seq = _seq_after(chunk, next_seq)
                if not one_by_one:
                    return
                next_seq = max(next_seq, seq + 1)
                one_by_one -= 1
            except dbapi_error as exc:
                if is_decode_error(exc) and not raw_text:
                    raw_text = True  # read again from the first row not yet handed out, text as bytes
                elif is_store_unavailable(exc):
                    raise
                elif not one_by_one:
                    one_by_one = num_rows_per_chunk  # a chunk failed: find the row that does
                else:
                    raise LogReadError(seq, store_cause(exc)) from exc
        finally:
            cursor.close()


def _next_stored_seq(conn: sa.Connection, pool_id: str, epoch: int, from_seq: int, until_seq: int | None) -> int | None:
    """The first stored seq at or after ``from_seq``, read from the primary key's index alone."""
    query = sa.select(sa.func.min(allocator_events.c.seq)).where(
        allocator_events.c.pool_id == pool_id,
        allocator_events.c.epoch == epoch,
        allocator_events.c.seq >= min(from_seq, MAX_SEQ),
    )
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= max(min(until_seq, MAX_SEQ), 0))
    if from_seq > MAX_SEQ:
        return None
    value = conn.execute(query).scalar()
    return value if type(value) is int else None


def _cursor(conn: sa.Connection) -> Any:
    driver = conn.connection.driver_connection
    assert driver is not None, "an open connection has its driver connection"
    if conn.dialect.name == "postgresql":
        return driver.cursor(name=f"nanoserve_replay_{uuid.uuid4().hex[:12]}")
    return driver.cursor()


def _as_bytes(columns: tuple[sa.ColumnElement[Any], ...]) -> tuple[sa.ColumnElement[Any], ...]:
    """The columns with every text column read as bytes (the store then decodes nothing)."""
    return tuple(
        sa.cast(column, sa.LargeBinary) if isinstance(column.type, sa.String) else column for column in columns
    )


def _decoded(row: tuple[Any, ...], columns: tuple[sa.ColumnElement[Any], ...]) -> tuple[Any, ...]:
    """A row whose text columns were read as bytes, each turned back into text where it is valid UTF-8."""
    return tuple(
        _text_or_bytes(value) if isinstance(column.type, sa.String) else value
        for value, column in zip(row, columns, strict=True)
    )


def _text_or_bytes(value: Any) -> Any:
    if not isinstance(value, (bytes, memoryview)):
        return value
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        return bytes(value)


def _seq_after(chunk: list[tuple[Any, ...]], previous: int) -> int:
    last = chunk[-1][0]
    return last + 1 if type(last) is int else previous


def rows_query(
    pool_id: str, epoch: int, from_seq: int, until_seq: int | None, columns: tuple[sa.ColumnElement[Any], ...]
) -> sa.Select[Any]:
    """SELECT ``columns`` of one epoch's rows with ``from_seq <= seq <= until_seq``, in seq order.

    Seqs beyond MAX_SEQ select nothing (they never reach the database)."""
    query = (
        sa.select(*columns)
        .where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.seq >= min(max(from_seq, 1), MAX_SEQ),
        )
        .order_by(allocator_events.c.seq)
    )
    if from_seq > MAX_SEQ:
        query = query.where(sa.false())
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= max(min(until_seq, MAX_SEQ), 0))
    return query


def compile_for_driver(conn: sa.Connection, query: sa.Select[Any]) -> tuple[str, Any]:
    """``query`` as the DBAPI driver takes it: SQL text and its parameters."""
    compiled = query.compile(dialect=conn.dialect)
    params: Any = compiled.construct_params()
    if compiled.positional:
        params = tuple(params[name] for name in compiled.positiontup or ())
    return str(compiled), params


def last_stored_seq(conn: sa.Connection, pool_id: str, epoch: int, until_seq: int | None) -> int | None:
    """The highest stored seq of the epoch at or below ``until_seq`` (any when None); None without rows."""
    query = sa.select(sa.func.max(allocator_events.c.seq)).where(
        allocator_events.c.pool_id == pool_id, allocator_events.c.epoch == epoch
    )
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= max(min(until_seq, MAX_SEQ), 0))
    value = conn.execute(query).scalar()
    return value if type(value) is int else None


def latest_snapshot_seq(conn: sa.Connection, pool_id: str, epoch: int, until_seq: int | None) -> int | None:
    """Seq of the newest SNAPSHOT at or before ``until_seq`` (any when None).

    Walks the primary key backwards from ``until_seq`` and stops at the first
    SNAPSHOT (``ORDER BY seq DESC LIMIT 1``): it reads the rows since the last
    snapshot, not the epoch (``max(seq) WHERE kind = ...`` scans every row, as
    ``kind`` has no index), so recovery finds its checkpoint in constant time.
    """
    query = (
        sa.select(allocator_events.c.seq)
        .where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.kind == "snapshot",
        )
        .order_by(allocator_events.c.seq.desc())
        .limit(1)
    )
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= max(min(until_seq, MAX_SEQ), 0))
    value = conn.execute(query).scalar()
    return value if type(value) is int else None


def stored_hash(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bytes | None:
    """The stored hash of one event, None when the row is missing (or its hash is not bytes)."""
    if not 1 <= seq <= MAX_SEQ:
        return None
    value = conn.execute(
        sa.select(allocator_events.c.hash).where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.seq == seq,
        )
    ).scalar()
    return bytes(value) if isinstance(value, (bytes, memoryview)) else None
