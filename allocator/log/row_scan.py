"""An epoch's stored rows, straight from the driver: what replay, audit and the log tools walk.

Every reader sees one row per event: a packed row (``packed_rows``) is
expanded here into the rows of its events, with their seqs and chained
hashes (and the keys its records name by id, ``key_refs``, read from the
epoch's stored keys as they are needed), so nothing above this module knows
how events are stored. Queries
by seq find the row that holds the seq (a packed row's key is its first seq).

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

import operator
import uuid
from collections.abc import Generator
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator.log.errors import LogReadError, is_decode_error, is_store_unavailable, store_cause
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.key_refs import KeyChunks
from nanoserve.allocator.log.key_table import stored_keys
from nanoserve.allocator.log.packed_rows import PACKED_KIND, UnreadableRecords, expand_packed, is_keyed
from nanoserve.allocator.log.schema import allocator_events

__all__ = [
    "EVENT_COLUMNS",
    "MAX_SEQ",
    "DamagedChunk",
    "compile_for_driver",
    "event_rows",
    "last_stored_seq",
    "has_packed_rows",
    "packed_row_holding",
    "latest_snapshot_seq",
    "record_at",
    "rows_query",
    "stored_hash",
    "stored_rows",
]

# the largest seq a BigInteger column holds; a query for more finds nothing
MAX_SEQ = 2**63 - 1
# columns of the rows readers get, in this order
EVENT_COLUMNS = (
    allocator_events.c.seq,
    allocator_events.c.kind,
    allocator_events.c.owner,
    allocator_events.c.record,
    allocator_events.c.hash,
)
# the two columns of a packed row (migration 0008), read after EVENT_COLUMNS
_PACKED_COLUMNS = (allocator_events.c.last_seq, allocator_events.c.records)
_last_seq_of, _event_columns = operator.itemgetter(5), operator.itemgetter(0, 1, 2, 3, 4)
# a table before migration 0008 (an old archive file) has no packed rows: these stand in for their columns
_NO_PACKED_COLUMNS = (sa.null(), sa.null())


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
    with_hashes: bool = True,
    num_rows_per_chunk: int = 10_000,
) -> Generator[list[tuple[Any, ...]], None, None]:
    """One epoch's events ``from_seq..until_seq`` in seq order, in chunks of EVENT_COLUMNS rows
    (``(seq, kind, owner, record, hash)``), one row per event: packed rows come expanded.

    ``owner`` and ``kind`` keep only matching events (replay never filters:
    it needs every row); without ``with_hashes`` every row's hash is None
    (replay's second process verifies them).

    Rows come straight from the driver's cursor (a server-side cursor on
    PostgreSQL), skipping SQLAlchemy's per-row result processing: replay and
    audit read millions of them. Damage does not stop the reading early: text
    the store cannot decode makes the rest come as ``DamagedChunk``s (such
    text as bytes), as does a packed row whose records cannot be read (its one
    row's record an ``UnreadableRecords``); a page the store cannot read raises
    ``LogReadError`` with the first seq not read, after every row before it.
    """
    dbapi_error = conn.dialect.loaded_dbapi.Error
    packed = has_packed_rows(conn)
    columns = (*EVENT_COLUMNS[:4], EVENT_COLUMNS[4] if with_hashes else sa.null())
    columns += _PACKED_COLUMNS if packed else _NO_PACKED_COLUMNS
    expander = _Expander(conn, pool_id, epoch, from_seq, until_seq, owner, kind, with_hashes)
    # a packed row holding from_seq starts before it
    next_seq = _row_start(conn, pool_id, epoch, from_seq) if packed else max(from_seq, 1)
    raw_text = False
    num_stored = num_rows_per_chunk  # stored rows to fetch at a time
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
        table = allocator_events.c
        if owner is not None:
            query = query.where(
                sa.or_(table.owner == owner, table.kind == PACKED_KIND) if packed else table.owner == owner
            )
        if kind is not None:
            query = query.where(sa.or_(table.kind == kind, table.kind == PACKED_KIND) if packed else table.kind == kind)
        cursor = _cursor(conn)
        try:
            try:
                cursor.execute(*compile_for_driver(conn, query))
                while chunk := cursor.fetchmany(num_stored):
                    if raw_text:
                        chunk = DamagedChunk(_decoded(row, columns) for row in chunk)
                    rows = expander.expand(chunk, raw_text)
                    if len(rows) <= num_rows_per_chunk:
                        if rows:
                            yield rows
                    else:  # a DamagedChunk's parts stay DamagedChunks
                        for start in range(0, len(rows), num_rows_per_chunk):
                            yield type(rows)(rows[start : start + num_rows_per_chunk])
                    next_seq = _seq_after(chunk, next_seq)
                    # packed rows hold many events: fetch about num_rows_per_chunk events at a time
                    num_stored = max(1, num_rows_per_chunk * len(chunk) // max(len(rows), len(chunk)))
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


def stored_rows(
    conn: sa.Connection, pool_id: str, epoch: int, num_rows_per_chunk: int = 64
) -> Generator[list[tuple[Any, ...]], None, None]:
    """Every stored row of one epoch in seq order, in chunks, as stored: ``(seq, kind, owner, record, hash,
    last_seq, records)``, a packed row not expanded (``last_seq`` and ``records`` None for a row of its own,
    and for every row of a table before migration 0008).

    For the audit's C fold (``intact_fold``), which expands and checks them itself. The driver's
    errors come as they are: the caller falls back to ``event_rows``, which names the damage.
    """
    columns = (*EVENT_COLUMNS, *(_PACKED_COLUMNS if has_packed_rows(conn) else _NO_PACKED_COLUMNS))
    cursor = _cursor(conn)
    try:
        cursor.execute(*compile_for_driver(conn, rows_query(pool_id, epoch, 1, None, columns)))
        while chunk := cursor.fetchmany(num_rows_per_chunk):
            yield chunk
    finally:
        cursor.close()


class _Expander:
    """Turns chunks of stored rows (EVENT_COLUMNS, last_seq, records) into rows of one event each.

    A packed row's records chain from the stored hash of the row before it:
    the row read just before (when nothing is filtered out), else the one the
    primary key finds (the epoch's genesis when none is stored).
    """

    def __init__(
        self,
        conn: sa.Connection,
        pool_id: str,
        epoch: int,
        from_seq: int,
        until_seq: int | None,
        owner: str | None,
        kind: str | None,
        with_hashes: bool,
    ) -> None:
        self._conn, self._pool_id, self._epoch = conn, pool_id, epoch
        self._from_seq = from_seq
        self._until_seq = MAX_SEQ if until_seq is None else until_seq
        self._owner, self._kind = owner, kind
        self._with_hashes = with_hashes
        self._filtered = owner is not None or kind is not None
        self._previous_hash: Any = None  # stored hash of the row read last (None: none read yet)
        self._keys: KeyChunks = stored_keys(conn, pool_id, epoch)

    def expand(self, chunk: list[tuple[Any, ...]], damaged: bool) -> list[tuple[Any, ...]]:
        """The event rows of a chunk of stored rows, those outside the range or the filter left out."""
        last_seqs = list(map(_last_seq_of, chunk))
        if last_seqs.count(None) == len(chunk):  # no packed row: the rows as they are
            self._previous_hash = chunk[-1][4]
            rows = list(map(_event_columns, chunk))
            return DamagedChunk(rows) if damaged else rows
        rows = []
        for row, last_seq in zip(chunk, last_seqs, strict=True):
            if last_seq is None:
                rows.append(row[:5])
            else:
                rows += self._expanded(row)
            self._previous_hash = row[4]
        first, last = self._from_seq, self._until_seq
        if rows and not first <= rows[0][0] <= rows[-1][0] <= last:
            rows = [row for row in rows if first <= row[0] <= last]
        if self._filtered:
            rows = [row for row in rows if self._matches(row)]
        if damaged or any(type(row[3]) is UnreadableRecords for row in rows):
            return DamagedChunk(rows)
        return rows

    def _expanded(self, row: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        seq, _, _, _, stored_hash, last_seq, records = row
        previous: bytes | None = None
        if self._with_hashes:
            previous = self._previous_hash if not self._filtered else None
            if not isinstance(previous, (bytes, memoryview)):
                previous = _hash_of_row_before(self._conn, self._pool_id, self._epoch, seq)
            previous = bytes(previous)
        return expand_packed(seq, last_seq, records, stored_hash, previous, self._keys)

    def _matches(self, row: tuple[Any, ...]) -> bool:
        return (self._owner is None or row[2] == self._owner) and (self._kind is None or row[1] == self._kind)


def has_packed_rows(conn: sa.Connection) -> bool:
    """Whether the log's ``allocator_events`` has the packed rows' columns (migration 0008; an archive
    file written before lacks them)."""
    columns = sa.inspect(conn).get_columns(allocator_events.name)
    return any(column["name"] == "records" for column in columns)


def packed_row_holding(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> tuple[int, int, bool] | None:
    """(first seq, last seq, whether it names stored keys) of the packed row that holds ``seq``; None when
    a row of its own holds it, or none does."""
    if not has_packed_rows(conn):
        return None
    table = allocator_events.c
    found = _row_at_or_before(conn, pool_id, epoch, seq, table.last_seq, sa.func.substr(table.records, 1, 1))
    if found is None or type(found[1]) is not int or found[1] < seq:
        return None
    return found[0], found[1], is_keyed(found[2])


def _row_start(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> int:
    """The first seq of the stored row that holds ``seq`` (``seq`` itself when none does, or when it is 1)."""
    if seq <= 1:
        return 1
    found = _row_at_or_before(conn, pool_id, epoch, seq, allocator_events.c.last_seq)
    if found is None:
        return seq
    start, last_seq = found
    return start if type(last_seq) is int and last_seq >= seq else seq


def _row_at_or_before(
    conn: sa.Connection, pool_id: str, epoch: int, seq: int, *columns: sa.ColumnElement[Any]
) -> tuple[Any, ...] | None:
    """(seq, ``columns``...) of the stored row with the highest seq at or before ``seq``, None when none is."""
    if seq < 1:
        return None
    query = (
        sa.select(allocator_events.c.seq, *columns)
        .where(
            allocator_events.c.pool_id == pool_id,
            allocator_events.c.epoch == epoch,
            allocator_events.c.seq <= min(seq, MAX_SEQ),
        )
        .order_by(allocator_events.c.seq.desc())
        .limit(1)
    )
    row = conn.execute(query).first()
    return None if row is None else tuple(row)


def _hash_of_row_before(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bytes:
    """The stored hash a packed row at ``seq`` chains from: the row before's, the genesis hash when none
    is stored (or its hash is not bytes)."""
    found = _row_at_or_before(conn, pool_id, epoch, seq - 1, allocator_events.c.hash)
    if found is None or not isinstance(found[1], (bytes, memoryview)):
        return genesis_hash(pool_id, epoch)
    return bytes(found[1])


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
    """The seq after a chunk of stored rows: after its last row's last seq."""
    last = chunk[-1][5] if type(chunk[-1][5]) is int else chunk[-1][0]
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
    limit = MAX_SEQ if until_seq is None else max(min(until_seq, MAX_SEQ), 0)
    if not has_packed_rows(conn):
        query = sa.select(sa.func.max(allocator_events.c.seq)).where(
            allocator_events.c.pool_id == pool_id, allocator_events.c.epoch == epoch, allocator_events.c.seq <= limit
        )
        value = conn.execute(query).scalar()
        return value if type(value) is int else None
    found = _row_at_or_before(conn, pool_id, epoch, limit, allocator_events.c.last_seq)
    if found is None or type(found[0]) is not int:
        return None
    seq, last_seq = found
    return min(last_seq, limit) if type(last_seq) is int and last_seq > seq else seq


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
    """The stored hash of one event, None when the row is missing (or its hash is not bytes).

    An event inside a packed row has the hash its record chains to (``packed_rows``)."""
    if not 1 <= seq <= MAX_SEQ:
        return None
    if not has_packed_rows(conn):
        value = conn.execute(
            sa.select(allocator_events.c.hash).where(
                allocator_events.c.pool_id == pool_id,
                allocator_events.c.epoch == epoch,
                allocator_events.c.seq == seq,
            )
        ).scalar()
    else:
        row = _row_at_or_before(conn, pool_id, epoch, seq, allocator_events.c.hash, allocator_events.c.last_seq)
        if row is None:
            return None
        start, value, last_seq = row
        end = last_seq if type(last_seq) is int else start
        if end < seq:
            return None
        if end > seq:
            rows = [row for chunk in event_rows(conn, pool_id, epoch, seq, seq) for row in chunk]
            value = rows[0][4] if rows and rows[0][0] == seq else None
    return bytes(value) if isinstance(value, (bytes, memoryview)) else None


def record_at(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> Any:
    """The stored record of one event (str, or what the column holds when damaged); None when missing."""
    rows = [row for chunk in event_rows(conn, pool_id, epoch, seq, seq, with_hashes=False) for row in chunk]
    return rows[0][3] if rows and rows[0][0] == seq else None
