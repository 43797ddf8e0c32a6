"""Replay: rebuild a pool from its log, checking every event against the state.

``Replayer`` walks an epoch's rows in seq order and applies each to a free
stack and owner map exactly as ``BlockAllocator`` did. On the way it checks
the log's rules and collects every break as a ``Violation`` (never raising
half-way): sequence numbers contiguous, hash chain intact, batches whole,
allocate only free blocks, free only allocated blocks of the named owner,
POOL_INIT first, nothing after POOL_CLOSE, snapshots equal to the replayed state.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from nanoserve.allocator import chain_verifier
from nanoserve.allocator.event_chain import DATA_KINDS, genesis_hash
from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log_reader import (
    EVENT_COLUMNS,
    EpochInfo,
    compile_for_driver,
    connect,
    event_rows,
    last_stored_seq,
    latest_snapshot_seq,
    resolve_epoch,
    rows_query,
    stored_hash,
)
from nanoserve.allocator.schema import allocator_events
from nanoserve.allocator.pool_state import PoolState, Violation

_ALLOCATE_KINDS = frozenset((EventKind.ALLOCATE.value, EventKind.ALLOCATE_FOR.value))
_FREE_KINDS = frozenset((EventKind.FREE.value, EventKind.FREE_ALL.value))
_BLOCK_KINDS = _ALLOCATE_KINDS | _FREE_KINDS
_INIT = EventKind.POOL_INIT.value
_digest = operator.methodcaller("digest")
# columns of an EVENT_COLUMNS row, taken out of a whole chunk at C speed (zip(*chunk) is ten times slower)
_seq_of, _record_of, _hash_of = operator.itemgetter(0), operator.itemgetter(3), operator.itemgetter(4)
_SNAPSHOT = EventKind.SNAPSHOT.value
_CLOSE = EventKind.POOL_CLOSE.value

# kind -> small int for the replay loop: block kinds <= _FREE_CODE < unknown kinds < data kinds (>= _DATA)
_ALLOCATE_CODE, _FREE_CODE, _UNKNOWN, _SNAPSHOT_CODE, _INIT_CODE, _CLOSE_CODE = range(6)
_DATA = _SNAPSHOT_CODE
_KIND_CODES = {
    EventKind.ALLOCATE.value: _ALLOCATE_CODE,
    EventKind.ALLOCATE_FOR.value: _ALLOCATE_CODE,
    EventKind.FREE.value: _FREE_CODE,
    EventKind.FREE_ALL.value: _FREE_CODE,
    _SNAPSHOT: _SNAPSHOT_CODE,
    _INIT: _INIT_CODE,
    _CLOSE: _CLOSE_CODE,
}

# an epoch with at least this many rows to replay has its hash chain verified in a second process
# (when a core is idle: the split costs more CPU in all than one process reading once)
NUM_EVENTS_FOR_VERIFIER = 100_000
# rows per chunk of the one-process replay: small chunks stay in the CPU's caches (3-5 % less CPU than 10,000)
_CHUNK_ROWS = 1_000
# seq, kind, owner, record, NULL: the hash is the verifier's to read
_REPLAY_COLUMNS = (*EVENT_COLUMNS[:4], sa.null())
_CHAIN_COLUMNS = (allocator_events.c.seq, sa.cast(allocator_events.c.record, sa.LargeBinary), allocator_events.c.hash)


class Replayer:
    """The pool state of one epoch, advanced one stored row at a time.

    Start from the epoch's genesis (``start_seq=1``) or from a SNAPSHOT row
    (``start_seq`` its seq, ``previous_hash`` the stored hash of the row
    before it).
    """

    def __init__(self, info: EpochInfo, start_seq: int = 1, previous_hash: bytes | None = None) -> None:
        self.info = info
        self.num_blocks = info.num_blocks
        self.block_size = info.block_size
        self.free: list[int] = list(range(info.num_blocks - 1, -1, -1))  # stack, top at the end
        self.owners: dict[int, str] = {}  # block_id -> owner
        self.violations: list[Violation] = []
        self.expected_seq = start_seq
        self.previous_hash = genesis_hash(info.pool_id, info.epoch) if previous_hash is None else previous_hash
        self.batch_end = start_seq - 1  # last seq of the batch being read
        self.last_seq = start_seq - 1
        self.closed_seq: int | None = None
        self._start_snapshot_seq = start_seq if start_seq > 1 else None
        self.num_events = 0

    def apply_chunks(self, chunks: Iterable[Sequence[tuple]]) -> None:
        """Check and apply chunks of rows (EVENT_COLUMNS tuples) in seq order.

        A chunk whose seqs run on from the last one and whose hashes all
        chain is checked in bulk (C-level ``map``); any other goes through the
        row-by-row checks that name what is wrong.
        """
        fast = self.invariant_holds()
        for chunk in chunks:
            if not self._chunk_is_intact(chunk):
                self.apply_rows(chunk)
            elif fast:
                self.apply_intact_rows(chunk)
                self.previous_hash = chunk[-1][4]
            else:
                self.apply_rows(chunk, verified=True)

    def _chunk_is_intact(self, chunk: Sequence[tuple]) -> bool:
        if not chunk:
            return True
        first = self.expected_seq
        if list(map(_seq_of, chunk)) != list(range(first, first + len(chunk))):
            return False
        hashes = list(map(_hash_of, chunk))
        previous = [self.previous_hash]
        previous += hashes[:-1]
        records = map(str.encode, map(_record_of, chunk))
        return list(map(_digest, map(hashlib.sha256, map(operator.add, previous, records)))) == hashes

    def apply_rows(self, rows: Sequence[tuple], verified: bool = False) -> None:
        """Check and apply rows in seq order; ``verified`` skips the seq and hash checks already done."""
        previous = self.previous_hash
        expected = self.expected_seq
        batch_end = self.batch_end
        violate = self.violate
        sha256 = hashlib.sha256
        closed_seq = self.closed_seq
        for seq, kind_column, owner_column, record, stored in rows:
            if not verified:
                if seq != expected:
                    if seq > expected:
                        violate(expected, "missing_events", f"seqs {expected}..{seq - 1} are missing")
                    else:
                        violate(seq, "out_of_order", f"seq {seq} follows seq {expected - 1}")
                    if batch_end >= expected and seq > batch_end:
                        batch_end = seq - 1  # the gap already reported the torn batch
                if sha256(previous + record.encode()).digest() != stored:
                    violate(seq, "hash_mismatch", "stored hash does not match the record and the previous hash", owner=owner_column)
            expected = seq + 1
            previous = stored
            try:
                record_seq, batch_text, kind, block_text, step, reason, wall_ns, mono_ns, tail = record.split("|", 8)
                batch_seq = int(batch_text)
                if not verified and int(record_seq) != seq:
                    violate(seq, "seq_mismatch", f"the record says seq {record_seq}")
            except ValueError:
                violate(seq, "bad_record", f"record {record[:80]!r} is malformed", owner=owner_column)
                continue
            owner = None if kind in DATA_KINDS else tail
            if kind != kind_column or owner != owner_column:
                violate(seq, "column_mismatch", f"columns kind={kind_column!r} owner={owner_column!r} differ from the record", owner=owner)
            if seq > batch_end:
                batch_end = batch_seq
                if batch_seq < seq:
                    violate(seq, "torn_batch", f"batch_seq {batch_seq} is before the record's own seq")
            elif batch_seq != batch_end:
                violate(seq, "torn_batch", f"batch ending at seq {batch_end} is cut short: batch_seq {batch_seq} starts here")
                batch_end = batch_seq
            if closed_seq is not None:
                violate(seq, "after_close", f"{kind} after POOL_CLOSE at seq {self.closed_seq}", owner=owner)
            if kind in _BLOCK_KINDS:
                try:
                    block_ids = list(map(int, block_text.split(",")))
                except ValueError:
                    violate(seq, "bad_record", f"block_ids {block_text!r} is not a list of block ids", owner=owner)
                    continue
                if kind in _ALLOCATE_KINDS:
                    self._allocate(seq, block_ids, owner)
                else:
                    self._free(seq, block_ids, owner)
            elif kind == _SNAPSHOT:
                self._snapshot(seq, tail)
            elif kind == _INIT:
                if seq != 1:
                    violate(seq, "misplaced_init", "POOL_INIT is not the epoch's first record")
            elif kind == _CLOSE:
                self.closed_seq = closed_seq = seq
            else:
                violate(seq, "unknown_kind", f"event kind {kind!r} is not known to this replay", owner=owner)
        self.previous_hash = previous
        self.expected_seq = expected
        self.last_seq = expected - 1
        self.num_events += len(rows)
        self.batch_end = batch_end

    def apply_intact_rows(self, rows: Sequence[tuple]) -> bool:
        """Apply rows (EVENT_COLUMNS; the hash unused) whose hash chain is verified already.

        Makes every check of ``apply_rows(rows, verified=True)`` (columns,
        batches, close, the state rules) with the state machine inlined: this
        is the loop that replays millions of events. Returns False, leaving
        the replayer half-updated, at the first seq out of line; the caller
        then replays from the start with ``apply_chunks``, which names it.
        Needs ``invariant_holds()`` (a block on top of the free stack is then
        free and in the pool).
        """
        expected = self.expected_seq
        batch_end = self.batch_end
        batch_end_text = str(batch_end)
        closed_seq = self.closed_seq
        free, owners = self.free, self.owners
        pop_owner, push_free = owners.pop, free.append
        violate = self.violate
        num_blocks = self.num_blocks
        kind_codes = _KIND_CODES
        for seq, kind_column, owner_column, record, _ in rows:
            if seq != expected:
                return False
            expected = seq + 1
            try:
                _, batch_text, kind, block_text, _, _, _, _, tail = record.split("|", 8)
                if seq > batch_end or batch_text != batch_end_text:
                    batch_seq = int(batch_text)
            except ValueError:
                violate(seq, "bad_record", f"record {record[:80]!r} is malformed", owner=owner_column)
                continue
            code = kind_codes.get(kind, _UNKNOWN)
            owner = None if code >= _DATA else tail
            if kind != kind_column or owner != owner_column:
                violate(seq, "column_mismatch", f"columns kind={kind_column!r} owner={owner_column!r} differ from the record", owner=owner)
            if seq > batch_end:
                batch_end = batch_seq
                batch_end_text = batch_text
                if batch_seq < seq:
                    violate(seq, "torn_batch", f"batch_seq {batch_seq} is before the record's own seq")
            elif batch_text != batch_end_text and batch_seq != batch_end:
                violate(seq, "torn_batch", f"batch ending at seq {batch_end} is cut short: batch_seq {batch_seq} starts here")
                batch_end = batch_seq
                batch_end_text = batch_text
            if closed_seq is not None:
                violate(seq, "after_close", f"{kind} after POOL_CLOSE at seq {closed_seq}", owner=owner)
            if code <= _FREE_CODE:
                try:
                    block_ids = list(map(int, block_text.split(",")))
                except ValueError:
                    violate(seq, "bad_record", f"block_ids {block_text!r} is not a list of block ids", owner=owner)
                    continue
                if code == _FREE_CODE:
                    for block_id in block_ids:
                        holder = pop_owner(block_id, None)
                        if holder == owner:
                            push_free(block_id)
                        elif holder is None:
                            rule = "free_of_free_block" if 0 <= block_id < num_blocks else "foreign_block"
                            violate(seq, rule, "block is not allocated", block_id, owner)
                        else:
                            violate(seq, "owner_mismatch", f"block is held by {holder!r}", block_id, owner)
                            push_free(block_id)
                elif free[-len(block_ids):] == block_ids[::-1]:  # the allocator pops from the top
                    del free[-len(block_ids):]
                    for block_id in block_ids:
                        owners[block_id] = owner
                else:
                    self._allocate(seq, block_ids, owner)
            elif code == _SNAPSHOT_CODE:
                self._snapshot(seq, tail)
            elif code == _INIT_CODE:
                if seq != 1:
                    violate(seq, "misplaced_init", "POOL_INIT is not the epoch's first record")
            elif code == _CLOSE_CODE:
                self.closed_seq = closed_seq = seq
            else:
                violate(seq, "unknown_kind", f"event kind {kind!r} is not known to this replay", owner=owner)
        self.expected_seq = expected
        self.last_seq = expected - 1
        self.num_events += len(rows)
        self.batch_end = batch_end
        return True

    def invariant_holds(self) -> bool:
        """The free stack holds distinct pool blocks, none of them owned (true unless a snapshot says otherwise)."""
        free = set(self.free)
        return (
            len(free) == len(self.free)
            and free.isdisjoint(self.owners)
            and all(type(block_id) is int and 0 <= block_id < self.num_blocks for block_id in free)
        )

    def finish(self) -> None:
        """Checks at the end of the stored rows: whole last batch, nothing cut from the tail."""
        durable_seq = self.info.durable_seq
        if self.batch_end > self.last_seq:
            self.violate(
                self.last_seq + 1, "torn_batch", f"batch ending at seq {self.batch_end} stops at seq {self.last_seq}"
            )
        elif durable_seq > self.last_seq:
            self.violate(
                self.last_seq + 1, "missing_events", f"seqs {self.last_seq + 1}..{durable_seq} are missing (durable_seq {durable_seq})"
            )
        elif durable_seq == self.last_seq and self.info.head_hash != self.previous_hash:
            self.violate(self.last_seq, "hash_mismatch", "last record's hash differs from the epoch's head_hash")
        if self.info.closed_seq is not None and self.closed_seq is None:
            self.violate(self.info.closed_seq, "missing_close", "the epoch was closed but its POOL_CLOSE record is missing")

    def state(self) -> PoolState:
        return PoolState(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_block_ids=tuple(self.free),
            owners=dict(self.owners),
            last_seq=self.last_seq,
            pool_id=self.info.pool_id,
            epoch=self.info.epoch,
            violations=list(self.violations),
        )

    def load_snapshot(self, data: str) -> None:
        """Take the state stored in a SNAPSHOT record as the current one."""
        free, owners = _decode_snapshot(data)
        self.free = free
        self.owners = owners

    def _allocate(self, seq: int, block_ids: list[int], owner: str | None) -> None:
        free, owners = self.free, self.owners
        for block_id in block_ids:
            holder = owners.get(block_id)
            if holder is not None:
                self.violate(seq, "allocate_of_allocated", f"block is held by {holder!r}", block_id, owner)
            elif not 0 <= block_id < self.num_blocks:
                self.violate(seq, "foreign_block", f"block is not in the pool of {self.num_blocks}", block_id, owner)
            else:
                if free[-1] == block_id:
                    free.pop()
                else:
                    free.remove(block_id)
                owners[block_id] = owner  # type: ignore[assignment]

    def _free(self, seq: int, block_ids: list[int], owner: str | None) -> None:
        free, owners = self.free, self.owners
        for block_id in block_ids:
            holder = owners.pop(block_id, None)
            if holder is None:
                rule = "free_of_free_block" if 0 <= block_id < self.num_blocks else "foreign_block"
                self.violate(seq, rule, "block is not allocated", block_id, owner)
                continue
            if holder != owner:
                self.violate(seq, "owner_mismatch", f"block is held by {holder!r}", block_id, owner)
            free.append(block_id)

    def _snapshot(self, seq: int, data: str | None) -> None:
        if seq == self._start_snapshot_seq:
            return  # the snapshot this replay started from
        try:
            free, owners = _decode_snapshot(data or "")
        except (ValueError, KeyError, TypeError) as exc:
            self.violate(seq, "bad_snapshot", f"snapshot data unreadable: {exc}")
            return
        if free != self.free or owners != self.owners:
            self.violate(seq, "snapshot_mismatch", "snapshot differs from the replayed state")

    def violate(
        self, seq: int, rule: str, message: str, block_id: int | None = None, owner: str | None = None
    ) -> None:
        self.violations.append(Violation(seq=seq, rule=rule, message=message, block_id=block_id, owner=owner))


def _decode_snapshot(data: str) -> tuple[list[int], dict[int, str]]:
    decoded = json.loads(data)
    return list(decoded["free_block_ids"]), {int(block): owner for block, owner in decoded["owners"].items()}


def replay(
    url: str,
    pool_id: str | None = None,
    epoch: int | None = None,
    until_seq: int | None = None,
    *,
    from_snapshot: bool = True,
) -> PoolState:
    """The pool of ``(pool_id, epoch)`` as of ``until_seq`` (default: the last stored event).

    ``pool_id`` None means the log's only pool, ``epoch`` None its newest
    epoch. With ``from_snapshot`` replay starts at the newest SNAPSHOT at or
    before ``until_seq``. Broken rules are in ``PoolState.violations``.
    Raises LogNotFoundError (a ValueError) for an unknown log, pool or epoch.
    """
    with connect(url) as conn:
        info = resolve_epoch(conn, pool_id, epoch)
        replayer = replay_epoch(conn, info, until_seq, lambda: _start(conn, info, until_seq, from_snapshot))
        if until_seq is None:
            replayer.finish()
        return replayer.state()


def replay_epoch(conn: sa.Connection, info: EpochInfo, until_seq: int | None, start: Callable[[], Replayer]) -> Replayer:
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
    database = conn.engine.url.database
    if conn.dialect.name == "sqlite" and database not in (None, "", ":memory:"):
        last_seq = last_stored_seq(conn, info.pool_id, info.epoch, until_seq)
        num_rows = 0 if last_seq is None else last_seq - replayer.expected_seq + 1
        if num_rows >= NUM_EVENTS_FOR_VERIFIER and _has_idle_core() and replayer.invariant_holds():
            if _replay_verified(conn, database, info, replayer, last_seq):  # type: ignore[arg-type]
                return replayer
            replayer = start()
            until_seq = last_seq
    rows = event_rows(conn, info.pool_id, info.epoch, replayer.expected_seq, until_seq, num_rows_per_chunk=_CHUNK_ROWS)
    replayer.apply_chunks(rows)
    return replayer


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
    sql, params = compile_for_driver(conn, rows_query(info.pool_id, info.epoch, from_seq, last_seq, _CHAIN_COLUMNS))
    try:
        verifier = chain_verifier.start(database, sql, list(params), replayer.previous_hash, from_seq)
    except OSError:
        return False
    in_line = True
    rows = event_rows(conn, info.pool_id, info.epoch, from_seq, last_seq, columns=_REPLAY_COLUMNS, num_rows_per_chunk=_CHUNK_ROWS)
    try:
        for chunk in rows:
            if not replayer.apply_intact_rows(chunk):
                in_line = False
                break
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
    replayer.previous_hash = verdict.last_hash  # type: ignore[assignment]
    return True


def _start(conn: Any, info: EpochInfo, until_seq: int | None, from_snapshot: bool) -> Replayer:
    snapshot_seq = latest_snapshot_seq(conn, info.pool_id, info.epoch, until_seq) if from_snapshot else None
    if snapshot_seq is None:
        return Replayer(info)
    previous = stored_hash(conn, info.pool_id, info.epoch, snapshot_seq - 1)
    rows = [row for chunk in event_rows(conn, info.pool_id, info.epoch, snapshot_seq, snapshot_seq) for row in chunk]
    replayer = Replayer(info, start_seq=snapshot_seq, previous_hash=previous or b"")
    replayer.load_snapshot(rows[0][3].split("|", 8)[8])
    replayer.apply_rows(rows)
    return replayer
