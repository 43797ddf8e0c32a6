"""Reading a stored event log: epochs, events, and the rows replay walks.

Every function takes the log's SQLAlchemy URL and opens (and disposes) its own
engine, so it can run beside a live writer (SQLite WAL readers do not block it).
SQLite files are opened read-only, so a log on read-only media can be read.
A missing SQLite file, a database without the log's tables, or an unknown
pool or epoch raises ``LogNotFoundError`` (a ``ValueError``); a store that
cannot be reached ``LogUnavailableError``; damaged data ``LogDamagedError``
(``LogReadError`` where the store cannot read the rows from a seq on).
Every seq that reaches a query is within the column's range first
(``MAX_SEQ``): a range beyond it holds no rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.database import create_log_engine
from nanoserve.allocator.log.errors import (
    LogDamagedError,
    LogNotFoundError,
    LogReadError,
    is_decode_error,
    is_store_unavailable,
    safe_url,
    store_cause,
    store_error,
)
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.log.record_codec import decode_event, decode_snapshot, split_record
from nanoserve.allocator.log.schema import allocator_events, pool_epochs

# the largest seq a BigInteger column holds; a query for more finds nothing
MAX_SEQ = 2**63 - 1
_SNAPSHOT = EventKind.SNAPSHOT.value

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


@dataclass(frozen=True)
class Damage:
    """A stored row (or the rest of the rows, from ``seq`` on) that could not be read as an event."""

    seq: int
    message: str

    def __str__(self) -> str:
        return f"seq {self.seq}: {self.message}"


@dataclass(frozen=True)
class EpochInfo:
    """One epoch's row: who opened it, how far it got, whether it closed."""

    pool_id: str
    epoch: int
    num_blocks: int
    block_size: int
    model: str | None
    opened_wall_ns: int
    durable_seq: int
    head_hash: bytes
    closed_seq: int | None

    @property
    def closed(self) -> bool:
        return self.closed_seq is not None


@contextmanager
def connect(url: str) -> Iterator[sa.Connection]:
    """A read-only connection to an existing log.

    Raises LogNotFoundError when there is none, and LogUnavailableError
    (naming the store) when the store cannot be reached, here or while the
    caller reads.
    """
    parsed = sa.engine.make_url(url)
    database = parsed.database or ""
    is_sqlite_file = parsed.get_backend_name() == "sqlite" and database not in ("", ":memory:")
    if is_sqlite_file and not Path(database).is_file():
        raise LogNotFoundError(f"no event log at {url!r}: file {database!r} does not exist")
    engine = create_log_engine(url, read_only=True)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(pool_epochs.name):
                raise LogNotFoundError(f"{safe_url(url)!r} holds no event log (run `nanoserve db upgrade URL`)")
            yield conn
    except Exception as exc:
        if is_store_unavailable(exc):
            raise store_error(url, exc) from exc
        raise
    finally:
        engine.dispose()


def list_epochs(conn: sa.Connection, pool_id: str | None = None) -> list[EpochInfo]:
    """Epochs in (pool_id, epoch) order, of one pool or all. LogDamagedError for a row of the wrong types."""
    query = sa.select(pool_epochs).order_by(pool_epochs.c.pool_id, pool_epochs.c.epoch)
    if pool_id is not None:
        query = query.where(pool_epochs.c.pool_id == pool_id)
    return [_epoch_info(row) for row in conn.execute(query)]


def _epoch_info(row: Any) -> EpochInfo:
    ints = ("epoch", "num_blocks", "block_size", "opened_wall_ns", "durable_seq")
    bad = [name for name in ints if type(getattr(row, name)) is not int]
    if row.closed_seq is not None and type(row.closed_seq) is not int:
        bad.append("closed_seq")
    if not isinstance(row.head_hash, (bytes, memoryview)):
        bad.append("head_hash")
    if type(row.pool_id) is not str or (row.model is not None and type(row.model) is not str):
        bad.append("pool_id or model")
    if bad or row.num_blocks < 1 or row.block_size < 1:
        raise LogDamagedError(
            f"the pool_epochs row of pool {row.pool_id!r} epoch {row.epoch!r} is damaged: "
            f"{', '.join(bad) or 'num_blocks or block_size'} hold(s) values of the wrong type or range"
        )
    return EpochInfo(
        pool_id=row.pool_id,
        epoch=row.epoch,
        num_blocks=row.num_blocks,
        block_size=row.block_size,
        model=row.model,
        opened_wall_ns=row.opened_wall_ns,
        durable_seq=row.durable_seq,
        head_hash=bytes(row.head_hash),
        closed_seq=row.closed_seq,
    )


def resolve_epoch(conn: sa.Connection, pool_id: str | None, epoch: int | None) -> EpochInfo:
    """The epoch meant: ``pool_id`` None means the log's only pool, ``epoch`` None its newest."""
    epochs = list_epochs(conn, pool_id)
    if not epochs:
        raise LogNotFoundError("the log holds no pools" if pool_id is None else f"the log holds no pool {pool_id!r}")
    pools = sorted({info.pool_id for info in epochs})
    if len(pools) > 1:
        raise LogNotFoundError(f"the log holds several pools, choose one with pool_id: {pools}")
    if epoch is None:
        return epochs[-1]
    for info in epochs:
        if info.epoch == epoch:
            return info
    raise LogNotFoundError(f"pool {pools[0]!r} has no epoch {epoch}; epochs: {[info.epoch for info in epochs]}")


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
    """Seq of the newest SNAPSHOT at or before ``until_seq`` (any when None)."""
    query = sa.select(sa.func.max(allocator_events.c.seq)).where(
        allocator_events.c.pool_id == pool_id,
        allocator_events.c.epoch == epoch,
        allocator_events.c.kind == "snapshot",
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


def to_event(pool_id: str, epoch: int, row: tuple[Any, ...]) -> Event:
    """An ``Event`` from one EVENT_COLUMNS row. LogDamagedError (a ValueError) naming the seq and what
    is wrong when the row cannot be read as one (a malformed record, a column of the wrong type)."""
    seq, _kind, _owner, record, hash_ = row
    try:
        if type(seq) is not int:
            raise ValueError(f"the seq column holds {seq!r}, not an integer")
        if type(record) is not str:
            raise ValueError(f"the record is not valid UTF-8 text: {_excerpt(record)}")
        if not isinstance(hash_, (bytes, memoryview)):
            raise ValueError(f"the hash column holds {type(hash_).__name__} {_excerpt(hash_)}, not bytes")
        return decode_event(pool_id, epoch, seq, record, bytes(hash_))
    except LogDamagedError:
        raise
    except ValueError as exc:
        message = str(exc).removeprefix(f"seq {seq}: ")
        raise LogDamagedError(f"seq {seq}: {message}") from None


def _check_snapshot(record: str, info: EpochInfo) -> None:
    """LogDamagedError when a SNAPSHOT record's data is not a pool (replay could not start from it)."""
    try:
        decode_snapshot(split_record(record)[-1], info.num_blocks, info.block_size)
    except ValueError as exc:
        raise LogDamagedError(f"snapshot data unreadable: {exc}") from None


def _excerpt(value: Any) -> str:
    return repr(value[:60] if isinstance(value, (str, bytes)) else value)


def scan_events(
    url: str,
    pool_id: str | None = None,
    epoch: int | None = None,
    from_seq: int = 1,
    until_seq: int | None = None,
    *,
    owner: str | None = None,
    kind: str | None = None,
    block_id: int | None = None,
) -> Generator[Event | Damage, None, None]:
    """Like ``read_events``, but damage does not stop it: each row that cannot be read as an event is a
    ``Damage`` in its place, and rows the store cannot read end the scan with a ``Damage`` naming the
    first seq not read. For tools that show what they can (``nanoserve log show``)."""
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        rows = event_rows(conn, info.pool_id, info.epoch, from_seq, until_seq, owner=owner, kind=kind)
        try:
            for chunk in rows:
                for row in chunk:
                    try:
                        event = to_event(info.pool_id, info.epoch, row)
                        if event.kind == _SNAPSHOT:
                            _check_snapshot(row[3], info)
                    except LogDamagedError as exc:
                        seq = row[0] if type(row[0]) is int else 0
                        yield Damage(seq, str(exc).removeprefix(f"seq {seq}: "))
                        continue
                    if block_id is None or block_id in event.block_ids:
                        yield event
        except LogReadError as exc:
            yield Damage(exc.seq, f"this row and the rest could not be read: {exc.cause}")
        finally:
            rows.close()


def read_events(
    url: str,
    pool_id: str | None = None,
    epoch: int | None = None,
    from_seq: int = 1,
    until_seq: int | None = None,
    *,
    owner: str | None = None,
    kind: str | None = None,
    block_id: int | None = None,
    limit: int | None = None,
) -> list[Event]:
    """Committed events of one epoch with ``from_seq <= seq <= until_seq``, in seq order.

    ``pool_id`` None means the log's only pool, ``epoch`` None its newest
    epoch. ``owner``, ``kind`` and ``block_id`` keep only matching events;
    ``limit`` stops after that many. Raises LogNotFoundError (a ValueError) for
    an unknown log, pool or epoch, LogUnavailableError when the store cannot be
    reached, LogDamagedError (a ValueError) at the first row that cannot be
    read as an event.
    """
    events: list[Event] = []
    with closing(
        scan_events(url, pool_id, epoch, from_seq, until_seq, owner=owner, kind=kind, block_id=block_id)
    ) as scan:
        for item in scan:
            if isinstance(item, Damage):
                raise LogDamagedError(str(item))
            events.append(item)
            if limit is not None and len(events) >= limit:
                break
    return events
