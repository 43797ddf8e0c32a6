"""Replay: the pool of one epoch as of any seq, rebuilt from the log by ``Replayer``.

``replay_epoch`` decides how an epoch's rows are read and checked: in one
process, or, for a large SQLite epoch on a machine with an idle core, with the
hash chain verified by a second process (``chain_verifier``) at the same time.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Callable

import sqlalchemy as sa

from nanoserve.allocator.log import hash_chain_verifier as chain_verifier
from nanoserve.allocator.log.errors import LogNotFoundError, LogReadError, is_store_unavailable
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.key_table import has_key_table
from nanoserve.allocator.log.reader import (
    DamagedChunk,
    EpochInfo,
    compile_for_driver,
    connect,
    event_rows,
    has_packed_rows,
    last_stored_seq,
    latest_snapshot_seq,
    resolve_epoch,
    rows_query,
    stored_hash,
)
from nanoserve.allocator.log.record_codec import NUM_FIELDS, split_record
from nanoserve.allocator.log.replay_state import Replayer
from nanoserve.allocator.log.schema import allocator_events, allocator_keys
from nanoserve.allocator.log.segment import Cut, cut_start, epoch_cut, segment_path
from nanoserve.allocator.pool_state import PoolState

__all__ = ["checkpoint_start", "replay", "replay_epoch"]

# an epoch with at least this many rows to replay has its hash chain verified in a second process
# (when a core is idle: the split costs more CPU in all than one process reading once)
NUM_EVENTS_FOR_VERIFIER = 100_000
# rows per chunk of the one-process replay: small chunks stay in the CPU's caches (3-5 % less CPU than 10,000)
_CHUNK_ROWS = 1_000
# what the verifier reads: seq, record as UTF-8, hash, and a packed row's last seq and records
_CHAIN_COLUMNS = (
    allocator_events.c.seq,
    sa.cast(allocator_events.c.record, sa.LargeBinary),
    allocator_events.c.hash,
    allocator_events.c.last_seq,
    allocator_events.c.records,
)
_digest = operator.methodcaller("digest")
# seq, record, hash of an EVENT_COLUMNS row: what the hash chain covers
_seq_of, _record_of, _hash_of = operator.itemgetter(0), operator.itemgetter(3), operator.itemgetter(4)


def replay(
    url: str,
    pool_id: str | None = None,
    epoch: int | None = None,
    until_seq: int | None = None,
    *,
    from_snapshot: bool = True,
    verify_chain: bool = True,
) -> PoolState:
    """The pool of ``(pool_id, epoch)`` as of ``until_seq`` (default: the last stored event).

    ``pool_id`` None means the log's only pool, ``epoch`` None its newest
    epoch. With ``from_snapshot`` replay starts at the newest SNAPSHOT at or
    before ``until_seq``, once the hash chain of every record before it is
    verified (``verify_chain``; off: they are trusted unread); a snapshot
    behind a broken chain is not started from, and the replay from genesis
    names the break. An epoch whose older part is archived (``segment``)
    starts at its cut at the earliest. Broken rules are in ``PoolState.violations``.
    Raises LogNotFoundError (a ValueError) for an unknown log, pool or epoch,
    and for an ``until_seq`` before the cut (replay the archive file instead).
    """
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        cut = epoch_cut(conn, info.pool_id, info.epoch)
        if cut is not None and until_seq is not None and until_seq < cut.first_seq:
            path = segment_path(conn, info.pool_id, info.epoch, until_seq)
            raise LogNotFoundError(
                f"seqs 1..{cut.num_archived} of pool {info.pool_id!r} epoch {info.epoch} are archived: seq "
                f"{until_seq} is in {path or 'a segment file (the manifest table archived_segments names it)'}; "
                f"read it there (--url sqlite:///FILE)"
            )
        replayer = replay_epoch(
            conn, info, until_seq, lambda: _start(conn, info, until_seq, from_snapshot, verify_chain)
        )
        if until_seq is None:
            replayer.finish()
        return replayer.state()


def replay_epoch(
    conn: sa.Connection, info: EpochInfo, until_seq: int | None, start: Callable[[], Replayer]
) -> Replayer:
    """Apply the epoch's rows up to ``until_seq`` to the replayer ``start()`` makes, checking everything.

    Rows are read here in chunks; a chunk whose seqs are in line and whose
    hashes chain is applied by ``apply_intact_rows``, any other row by row
    with every check, which names what is wrong (``apply_chunks``).

    A large SQLite epoch (NUM_EVENTS_FOR_VERIFIER rows or more), on a machine
    with an idle core, is read twice at once instead: a second process
    verifies the hash chain (chain_verifier) while this one applies the rows
    with ``apply_intact_rows``; the state is kept only when both agree that
    the chain is whole and every seq in line, else the epoch is replayed
    again the first way. Both reads stop at the highest seq stored when
    replay began, so the two see the same rows of an append-only log even
    beside a live writer.
    """
    replayer = start()
    database = conn.engine.url.database or ""
    if conn.dialect.name == "sqlite" and database not in ("", ":memory:"):
        last_seq = _or_none_if_damaged(lambda: last_stored_seq(conn, info.pool_id, info.epoch, until_seq))
        num_rows = 0 if last_seq is None else last_seq - replayer.expected_seq + 1
        if (
            last_seq is not None
            and num_rows >= NUM_EVENTS_FOR_VERIFIER
            and _has_idle_core()
            and replayer.invariant_holds()
        ):
            if _replay_verified(conn, database, info, replayer, last_seq):
                return replayer
            replayer = start()
            until_seq = last_seq
    rows = event_rows(conn, info.pool_id, info.epoch, replayer.expected_seq, until_seq, num_rows_per_chunk=_CHUNK_ROWS)
    try:
        replayer.apply_chunks(rows)
    except LogReadError as exc:  # a damaged page: everything before it is applied, the rest cannot be
        replayer.violate(exc.seq, "unreadable", f"the store cannot read the rows from here on: {exc.cause}")
    return replayer


def _or_none_if_damaged(query: Callable[[], int | None]) -> int | None:
    """A seq from the store, None when the store cannot read it (replay then takes the careful way)."""
    try:
        return query()
    except sa.exc.DBAPIError as exc:
        if is_store_unavailable(exc):
            raise
        return None


def _has_idle_core() -> bool:
    """Whether a core is free for the verifier: on a busy machine a second process only adds CPU time."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return False
    return load <= (os.cpu_count() or 1) - 1.5


def _replay_verified(conn: sa.Connection, database: str, info: EpochInfo, replayer: Replayer, last_seq: int) -> bool:
    """Rows from_seq..last_seq applied here while chain_verifier checks their hashes; True when both agree."""
    from_seq = replayer.expected_seq
    if not has_packed_rows(conn):
        return False  # an archive file from before migration 0008: the one-process replay reads it
    sql, params = compile_for_driver(conn, rows_query(info.pool_id, info.epoch, from_seq, last_seq, _CHAIN_COLUMNS))
    keys_sql, keys_params = None, None
    if has_key_table(conn):  # the stored keys that packed rows name by id (``key_refs``)
        keys = allocator_keys.c
        keys_query = (
            sa.select(keys.first_key_id, keys.block_keys)
            .where(keys.pool_id == info.pool_id, keys.epoch == info.epoch)
            .order_by(keys.first_key_id)
        )
        keys_sql, keys_params = compile_for_driver(conn, keys_query)
    try:
        verifier = chain_verifier.start(
            database, sql, list(params), replayer.previous_hash, from_seq, keys_sql, list(keys_params or ())
        )
    except OSError:
        return False
    in_line = True
    rows = event_rows(
        conn, info.pool_id, info.epoch, from_seq, last_seq, with_hashes=False, num_rows_per_chunk=_CHUNK_ROWS
    )
    try:
        for chunk in rows:
            if type(chunk) is DamagedChunk or not replayer.apply_intact_rows(chunk):
                in_line = False
                break
    except LogReadError:
        in_line = False  # the careful replay names the damage
    except BaseException:
        verifier.kill()
        verifier.communicate()
        raise
    finally:
        rows.close()
    if not in_line:
        verifier.kill()
    verdict = chain_verifier.result(verifier)
    if not in_line or verdict is None or not verdict.intact or verdict.num_rows != replayer.expected_seq - from_seq:
        return False
    if verdict.last_hash is None:  # no row verified: the rows vanished meanwhile; replay them the careful way
        return False
    replayer.previous_hash = verdict.last_hash
    return True


def _start(
    conn: sa.Connection, info: EpochInfo, until_seq: int | None, from_snapshot: bool, verify_chain: bool = True
) -> Replayer:
    """A replayer at the newest SNAPSHOT at or before ``until_seq``, or at genesis.

    A snapshot that cannot be read, or (with ``verify_chain``) one that the
    records before it do not chain up to, is not started from: replay then
    begins at genesis, which names what is wrong when it gets there.
    """
    if not from_snapshot:
        return cut_start(conn, info)
    snapshot_seq = _or_none_if_damaged(lambda: latest_snapshot_seq(conn, info.pool_id, info.epoch, until_seq))
    if snapshot_seq is None:
        return cut_start(conn, info)
    cut = epoch_cut(conn, info.pool_id, info.epoch)
    if verify_chain and not _chain_intact(conn, info, snapshot_seq - 1, cut):
        return cut_start(conn, info)
    try:
        previous = _hash_before(conn, info, snapshot_seq, cut)
        rows = [
            row for chunk in event_rows(conn, info.pool_id, info.epoch, snapshot_seq, snapshot_seq) for row in chunk
        ]
        fields = split_record(rows[0][3])
        if len(fields) != NUM_FIELDS:
            raise ValueError(f"record has {len(fields)} fields")
        replayer = Replayer(info, start_seq=snapshot_seq, previous_hash=previous or b"")
        replayer.load_snapshot(fields[-1])
    except (ValueError, TypeError, IndexError):  # LogReadError is a ValueError
        return cut_start(conn, info)
    replayer.apply_rows(rows)
    return replayer


def checkpoint_start(conn: sa.Connection, info: EpochInfo) -> Replayer:
    """A replayer at the epoch's newest verified checkpoint: recovery's start, in constant time.

    A checkpoint is a SNAPSHOT record together with the stored hash of the
    row before it (the chain head it was taken at). It is trusted when its own
    hash links: ``sha256(stored_hash[seq - 1] + record) == stored_hash[seq]``,
    and its state holds every block exactly once (``load_snapshot``). The
    rows before it are not read here (``log audit``, offline, verifies the
    whole chain from genesis); the rows after it are replayed with every
    check, and ``Replayer.finish`` ties the last one to the epoch's
    ``head_hash``. So what recovery reads is the snapshot and the tail since
    it (at most ``num_events_per_snapshot`` rows and one batch), whatever the
    epoch's length. Without a checkpoint that links and loads, replay starts
    at genesis (an epoch shorter than one snapshot interval, or a damaged one),
    or at its cut (``segment.cut_start``) when its older part is archived; a
    checkpoint at the cut links to the manifest's head hash.
    """
    snapshot_seq = _or_none_if_damaged(lambda: latest_snapshot_seq(conn, info.pool_id, info.epoch, None))
    if snapshot_seq is None or snapshot_seq < 2:
        return cut_start(conn, info)
    try:
        previous = _hash_before(conn, info, snapshot_seq, epoch_cut(conn, info.pool_id, info.epoch))
        rows = [
            row for chunk in event_rows(conn, info.pool_id, info.epoch, snapshot_seq, snapshot_seq) for row in chunk
        ]
        if previous is None or len(rows) != 1 or type(rows[0][3]) is not str or type(rows[0][4]) is not bytes:
            return cut_start(conn, info)
        if hashlib.sha256(previous + rows[0][3].encode()).digest() != rows[0][4]:
            return cut_start(conn, info)  # the checkpoint's own link is broken: trust nothing, replay it all
        fields = split_record(rows[0][3])
        if len(fields) != NUM_FIELDS:
            return cut_start(conn, info)
        replayer = Replayer(info, start_seq=snapshot_seq, previous_hash=previous)
        replayer.load_snapshot(fields[-1])
    except (ValueError, TypeError, IndexError):  # LogReadError is a ValueError
        return cut_start(conn, info)
    replayer.apply_rows(rows)
    return replayer


def _hash_before(conn: sa.Connection, info: EpochInfo, seq: int, cut: Cut | None) -> bytes | None:
    """The hash ``seq``'s record chains from: the stored one of ``seq - 1``, or the manifest's at the cut."""
    if cut is not None and seq == cut.first_seq:
        return cut.previous_hash
    return stored_hash(conn, info.pool_id, info.epoch, seq - 1)


def _chain_intact(conn: sa.Connection, info: EpochInfo, last_seq: int, cut: Cut | None = None) -> bool:
    """Whether the seqs from the epoch's start as stored (1, or the cut) to last_seq are all stored, in line,
    as text, and hash-chained from the epoch's genesis (or the manifest's head hash at the cut)."""
    previous = genesis_hash(info.pool_id, info.epoch) if cut is None else cut.previous_hash
    expected = 1 if cut is None else cut.first_seq
    if last_seq < expected:
        return last_seq == expected - 1
    rows = event_rows(conn, info.pool_id, info.epoch, expected, last_seq)
    try:
        for chunk in rows:
            if list(map(_seq_of, chunk)) != list(range(expected, expected + len(chunk))):
                return False
            hashes = list(map(_hash_of, chunk))
            chained = [previous, *hashes[:-1]]
            records = list(map(str.encode, map(_record_of, chunk)))
            if list(map(_digest, map(hashlib.sha256, map(operator.add, chained, records)))) != hashes:
                return False
            previous = hashes[-1]
            expected += len(chunk)
    except (LogReadError, TypeError):  # a damaged page; text read as bytes, a hash stored as text
        return False
    finally:
        rows.close()
    return expected == last_seq + 1
