"""The ``allocator_keys`` table (migration 0009): writing, reading and copying an epoch's stored keys.

What the rows mean is ``key_refs``'s; this module is how they reach the
store and come back: ``insert_keys`` in a group commit's transaction,
``stored_keys`` for a reader (rows read as packed rows ask for ids, never the
whole epoch at once), ``rows_holding`` for an archive that carries the rows
its events refer to.
"""

from __future__ import annotations

import itertools
import weakref

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from nanoserve.allocator.log.key_refs import KEY_BYTES, KeyChunks
from nanoserve.allocator.log.schema import allocator_keys

__all__ = ["KEY_COLUMNS", "MAX_KEYS_PER_ROW", "has_key_table", "insert_keys", "rows_holding", "stored_keys"]

# the columns of one row, in insert order
KEY_COLUMNS = ("pool_id", "epoch", "first_key_id", "block_keys")
# a reader that misses a key id reads the rows up to this many ids past it too: the next packed rows
# name the keys their commits stored next
_READ_AHEAD_IDS = 1024
# keys per row at most: a longer run of new keys is cut into rows of this many, so that a row (1.5 KB)
# stays within an 8 KiB page of the table stored by its key (SQLite keeps a row above about 2 KB of
# such a table partly on an overflow page of its own)
MAX_KEYS_PER_ROW = 48
# engine -> whether it has allocator_keys (migration 0009), looked up once
_HAS_TABLE: weakref.WeakKeyDictionary[Engine, bool] = weakref.WeakKeyDictionary()


def has_key_table(conn: sa.Connection) -> bool:
    """Whether the log has ``allocator_keys`` (migration 0009; a log or archive file from before lacks it)."""
    found = _HAS_TABLE.get(conn.engine)
    if found is None:
        found = _HAS_TABLE[conn.engine] = sa.inspect(conn).has_table(allocator_keys.name)
    return found


def insert_keys(conn: sa.Connection, pool_id: str, epoch: int, first_key_id: int, keys: bytes) -> None:
    """Store keys ``first_key_id, ...`` (32 bytes each, back to back) inside ``conn``'s transaction (that of
    the packed rows that refer to them), in rows of MAX_KEYS_PER_ROW keys at most."""
    step = MAX_KEYS_PER_ROW * KEY_BYTES
    rows = [
        {
            "pool_id": pool_id,
            "epoch": epoch,
            "first_key_id": first_key_id + start // KEY_BYTES,
            "block_keys": keys[start : start + step],
        }
        for start in range(0, len(keys), step)
    ]
    conn.execute(sa.insert(allocator_keys), rows)


def stored_keys(conn: sa.Connection, pool_id: str, epoch: int) -> KeyChunks:
    """The keys of one epoch for a reader: rows read from ``conn`` as expanded records name their ids."""
    return KeyChunks(lambda key_ids: _fetch(conn, pool_id, epoch, key_ids))


def rows_holding(conn: sa.Connection, pool_id: str, epoch: int, key_ids: set[int]) -> list[tuple[int, bytes]]:
    """The epoch's rows ``(first_key_id, keys)`` that hold any of ``key_ids``, by first key id."""
    chunks = KeyChunks()
    for first_key_id, keys in _fetch(conn, pool_id, epoch, sorted(key_ids)):
        chunks.add(first_key_id, keys)
    wanted = set()
    for row_first, keys in chunks.rows():
        row_ids = range(row_first, row_first + len(keys) // KEY_BYTES)
        if any(key_id in key_ids for key_id in row_ids):
            wanted.add(row_first)
    return [row for row in chunks.rows() if row[0] in wanted]


def _fetch(conn: sa.Connection, pool_id: str, epoch: int, key_ids: list[int]) -> list[tuple[int, bytes]]:
    """Rows holding ``key_ids`` (ascending): for each run of ids near each other, the row holding its first
    and every row after it up to _READ_AHEAD_IDS past its last."""
    if not key_ids or not has_key_table(conn):
        return []
    table = allocator_keys.c
    in_epoch = (table.pool_id == pool_id, table.epoch == epoch)
    rows: list[tuple[int, bytes]] = []
    for ids in _runs(key_ids):
        start = conn.execute(sa.select(sa.func.max(table.first_key_id)).where(*in_epoch, table.first_key_id <= ids[0]))
        first = start.scalar()
        query = (
            sa.select(table.first_key_id, table.block_keys)
            .where(*in_epoch, table.first_key_id >= (ids[0] if first is None else first))
            .where(table.first_key_id <= ids[-1] + _READ_AHEAD_IDS)
            .order_by(table.first_key_id)
        )
        rows += [(int(first_key_id), bytes(keys)) for first_key_id, keys in conn.execute(query) if keys is not None]
    return rows


def _runs(key_ids: list[int]) -> list[list[int]]:
    """Ascending ids cut where two are more than _READ_AHEAD_IDS apart."""
    runs = [[key_ids[0]]]
    for before, key_id in itertools.pairwise(key_ids):
        if key_id - before > _READ_AHEAD_IDS:
            runs.append([])
        runs[-1].append(key_id)
    return runs
