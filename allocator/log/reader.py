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

from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.errors import (
    LogDamagedError,
    LogFileMissingError,
    LogNotFoundError,
    LogReadError,
    is_store_unavailable,
    safe_url,
    store_error,
)
from nanoserve.allocator.log.packed_rows import UnreadableRecords
from nanoserve.allocator.log.record_codec import decode_event, split_record
from nanoserve.allocator.log.row_scan import (
    EVENT_COLUMNS,
    MAX_SEQ,
    DamagedChunk,
    compile_for_driver,
    event_rows,
    has_packed_rows,
    last_stored_seq,
    latest_snapshot_seq,
    rows_query,
    stored_hash,
)
from nanoserve.allocator.log.schema import archived_epochs, pool_epochs
from nanoserve.allocator.log.snapshot_codec import decode_snapshot
from nanoserve.allocator.log.store import create_log_engine
from nanoserve.allocator.log.stored_event import Event

# the row machinery lives in row_reader; these names stay importable from here
__all__ = [
    "EVENT_COLUMNS",
    "MAX_SEQ",
    "Damage",
    "DamagedChunk",
    "EpochInfo",
    "LogNotFoundError",
    "compile_for_driver",
    "connect",
    "event_rows",
    "has_packed_rows",
    "last_stored_seq",
    "latest_snapshot_seq",
    "list_epochs",
    "read_events",
    "resolve_epoch",
    "rows_query",
    "scan_events",
    "stored_hash",
    "to_event",
]

_SNAPSHOT = EventKind.SNAPSHOT.value  # the kind whose data show checks is a pool


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
        raise LogFileMissingError(f"no event log at {url!r}: file {database!r} does not exist")
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
        raise LogNotFoundError(
            f"the log holds several pools, choose one (--pool on the command line, pool_id in Python): {pools}"
        )
    if epoch is None:
        return epochs[-1]
    for info in epochs:
        if info.epoch == epoch:
            return info
    message = f"pool {pools[0]!r} has no epoch {epoch}; epochs: {[info.epoch for info in epochs]}"
    path = dict(archived_epoch_files(conn, pools[0])).get(epoch)
    if path is not None:
        message += f"; epoch {epoch} is archived in {path}: read it there (--url sqlite:///{path})"
    raise LogNotFoundError(message)


def archived_epoch_files(conn: sa.Connection, pool_id: str) -> list[tuple[int, str]]:
    """(epoch, file) of each epoch of ``pool_id`` the manifest ``archived_epochs`` names, by epoch:
    archived whole (``archive``), so gone from this log. Empty before migration 0004 (its table)."""
    if not sa.inspect(conn).has_table(archived_epochs.name):
        return []
    table = archived_epochs
    query = sa.select(table.c.epoch, table.c.path).where(table.c.pool_id == pool_id).order_by(table.c.epoch)
    return [(int(row.epoch), str(row.path)) for row in conn.execute(query)]


def to_event(pool_id: str, epoch: int, row: tuple[Any, ...]) -> Event:
    """An ``Event`` from one EVENT_COLUMNS row. LogDamagedError (a ValueError) naming the seq and what
    is wrong when the row cannot be read as one (a malformed record, a column of the wrong type)."""
    seq, _kind, _owner, record, hash_ = row
    try:
        if type(seq) is not int:
            raise ValueError(f"the seq column holds {seq!r}, not an integer")
        if type(record) is UnreadableRecords:
            raise ValueError(f"seqs {seq}..{record.last_seq} (one packed row): {record.cause}")
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
