"""Reading a stored event log: epochs, events, and the rows replay walks.

Every function takes the log's SQLAlchemy URL and opens (and disposes) its own
engine, so it can run beside a live writer (SQLite WAL readers do not block it).
A missing SQLite file, a database without the log's tables, or an unknown
pool or epoch raises ``LogNotFoundError`` (a ``ValueError``).
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.log.database import create_log_engine
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.log.record_codec import decode_event
from nanoserve.allocator.log.schema import allocator_events, pool_epochs

# columns replay reads, in this order
EVENT_COLUMNS = (
    allocator_events.c.seq,
    allocator_events.c.kind,
    allocator_events.c.owner,
    allocator_events.c.record,
    allocator_events.c.hash,
)


class LogNotFoundError(ValueError):
    """The URL, pool or epoch names no stored log."""


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
    """A read connection to an existing log; LogNotFoundError when there is none."""
    parsed = sa.engine.make_url(url)
    database = parsed.database or ""
    is_sqlite_file = parsed.get_backend_name() == "sqlite" and database not in ("", ":memory:")
    if is_sqlite_file and not Path(database).is_file():
        raise LogNotFoundError(f"no event log at {url!r}: file {database!r} does not exist")
    engine = create_log_engine(url)
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table(pool_epochs.name):
                raise LogNotFoundError(f"{url!r} holds no event log (run `nanoserve db upgrade {url}`)")
            yield conn
    finally:
        engine.dispose()


def list_epochs(conn: sa.Connection, pool_id: str | None = None) -> list[EpochInfo]:
    """Epochs in (pool_id, epoch) order, of one pool or all."""
    query = sa.select(pool_epochs).order_by(pool_epochs.c.pool_id, pool_epochs.c.epoch)
    if pool_id is not None:
        query = query.where(pool_epochs.c.pool_id == pool_id)
    return [
        EpochInfo(
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
        for row in conn.execute(query)
    ]


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
    audit read millions of them.
    """
    query = rows_query(pool_id, epoch, from_seq, until_seq, columns)
    if owner is not None:
        query = query.where(allocator_events.c.owner == owner)
    if kind is not None:
        query = query.where(allocator_events.c.kind == kind)
    sql, params = compile_for_driver(conn, query)
    driver = conn.connection.driver_connection
    assert driver is not None, "an open connection has its driver connection"
    if conn.dialect.name == "postgresql":
        cursor = driver.cursor(name=f"nanoserve_replay_{uuid.uuid4().hex[:12]}")
    else:
        cursor = driver.cursor()
    try:
        cursor.execute(sql, params)
        while chunk := cursor.fetchmany(num_rows_per_chunk):
            yield chunk
    finally:
        cursor.close()


def rows_query(
    pool_id: str, epoch: int, from_seq: int, until_seq: int | None, columns: tuple[sa.ColumnElement[Any], ...]
) -> sa.Select[Any]:
    """SELECT ``columns`` of one epoch's rows with ``from_seq <= seq <= until_seq``, in seq order."""
    query = (
        sa.select(*columns)
        .where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.seq >= from_seq,
        )
        .order_by(allocator_events.c.seq)
    )
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= until_seq)
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
        query = query.where(allocator_events.c.seq <= until_seq)
    return conn.execute(query).scalar()


def latest_snapshot_seq(conn: sa.Connection, pool_id: str, epoch: int, until_seq: int | None) -> int | None:
    """Seq of the newest SNAPSHOT at or before ``until_seq`` (any when None)."""
    query = sa.select(sa.func.max(allocator_events.c.seq)).where(
        allocator_events.c.pool_id == pool_id,
        allocator_events.c.epoch == epoch,
        allocator_events.c.kind == "snapshot",
    )
    if until_seq is not None:
        query = query.where(allocator_events.c.seq <= until_seq)
    return conn.execute(query).scalar()


def stored_hash(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bytes | None:
    """The stored hash of one event, None when the row is missing."""
    value = conn.execute(
        sa.select(allocator_events.c.hash).where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.seq == seq,
        )
    ).scalar()
    return None if value is None else bytes(value)


def to_event(pool_id: str, epoch: int, row: tuple[Any, ...]) -> Event:
    """An ``Event`` from one EVENT_COLUMNS row. ValueError when its record is malformed."""
    seq, _kind, _owner, record, hash_ = row
    return decode_event(pool_id, epoch, seq, record, hash_)


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
    an unknown log, pool or epoch.
    """
    events: list[Event] = []
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        for chunk in event_rows(conn, info.pool_id, info.epoch, from_seq, until_seq, owner=owner, kind=kind):
            for row in chunk:
                event = to_event(info.pool_id, info.epoch, row)
                if block_id is None or block_id in event.block_ids:
                    events.append(event)
                    if limit is not None and len(events) >= limit:
                        return events
    return events
