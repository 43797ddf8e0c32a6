"""``Replayer``: rebuild a pool from its log, checking every event against the state.

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
from collections.abc import Iterable, Sequence
from typing import Any

from nanoserve.allocator.event_chain import DATA_KINDS, genesis_hash
from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log_reader import EpochInfo
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

    def apply_chunks(self, chunks: Iterable[Sequence[tuple[Any, ...]]]) -> None:
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

    def _chunk_is_intact(self, chunk: Sequence[tuple[Any, ...]]) -> bool:
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

    def apply_rows(self, rows: Sequence[tuple[Any, ...]], verified: bool = False) -> None:
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
                    violate(
                        seq,
                        "hash_mismatch",
                        "stored hash does not match the record and the previous hash",
                        owner=owner_column,
                    )
            expected = seq + 1
            previous = stored
            try:
                record_seq, batch_text, kind, block_text, _step, _reason, _wall_ns, _mono_ns, tail = record.split(
                    "|", 8
                )
                batch_seq = int(batch_text)
                if not verified and int(record_seq) != seq:
                    violate(seq, "seq_mismatch", f"the record says seq {record_seq}")
            except ValueError:
                violate(seq, "bad_record", f"record {record[:80]!r} is malformed", owner=owner_column)
                continue
            owner = None if kind in DATA_KINDS else tail
            if kind != kind_column or owner != owner_column:
                violate(
                    seq,
                    "column_mismatch",
                    f"columns kind={kind_column!r} owner={owner_column!r} differ from the record",
                    owner=owner,
                )
            if seq > batch_end:
                batch_end = batch_seq
                if batch_seq < seq:
                    violate(seq, "torn_batch", f"batch_seq {batch_seq} is before the record's own seq")
            elif batch_seq != batch_end:
                violate(
                    seq,
                    "torn_batch",
                    f"batch ending at seq {batch_end} is cut short: batch_seq {batch_seq} starts here",
                )
                batch_end = batch_seq
            if closed_seq is not None:
                violate(seq, "after_close", f"{kind} after POOL_CLOSE at seq {self.closed_seq}", owner=owner)
            if kind in _BLOCK_KINDS:
                try:
                    block_ids = list(map(int, block_text.split(",")))
                except ValueError:
                    violate(seq, "bad_record", f"block_ids {block_text!r} is not a list of block ids", owner=owner)
                    continue
                # a block event's tail is its owner (``owner`` is None only for data kinds)
                if kind in _ALLOCATE_KINDS:
                    self._allocate(seq, block_ids, tail)
                else:
                    self._free(seq, block_ids, tail)
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

    def apply_intact_rows(self, rows: Sequence[tuple[Any, ...]]) -> bool:
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
                violate(
                    seq,
                    "column_mismatch",
                    f"columns kind={kind_column!r} owner={owner_column!r} differ from the record",
                    owner=owner,
                )
            if seq > batch_end:
                batch_end = batch_seq
                batch_end_text = batch_text
                if batch_seq < seq:
                    violate(seq, "torn_batch", f"batch_seq {batch_seq} is before the record's own seq")
            elif batch_text != batch_end_text and batch_seq != batch_end:
                violate(
                    seq,
                    "torn_batch",
                    f"batch ending at seq {batch_end} is cut short: batch_seq {batch_seq} starts here",
                )
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
                elif free[-len(block_ids) :] == block_ids[::-1]:  # the allocator pops from the top
                    del free[-len(block_ids) :]
                    for block_id in block_ids:
                        owners[block_id] = tail  # a block event's tail is its owner
                else:
                    self._allocate(seq, block_ids, tail)
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
                self.last_seq + 1,
                "missing_events",
                f"seqs {self.last_seq + 1}..{durable_seq} are missing (durable_seq {durable_seq})",
            )
        elif durable_seq == self.last_seq and self.info.head_hash != self.previous_hash:
            self.violate(self.last_seq, "hash_mismatch", "last record's hash differs from the epoch's head_hash")
        if self.info.closed_seq is not None and self.closed_seq is None:
            self.violate(
                self.info.closed_seq, "missing_close", "the epoch was closed but its POOL_CLOSE record is missing"
            )

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

    def _allocate(self, seq: int, block_ids: list[int], owner: str) -> None:
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
                owners[block_id] = owner

    def _free(self, seq: int, block_ids: list[int], owner: str) -> None:
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

    def violate(self, seq: int, rule: str, message: str, block_id: int | None = None, owner: str | None = None) -> None:
        self.violations.append(Violation(seq=seq, rule=rule, message=message, block_id=block_id, owner=owner))


def _decode_snapshot(data: str) -> tuple[list[int], dict[int, str]]:
    decoded = json.loads(data)
    return list(decoded["free_block_ids"]), {int(block): owner for block, owner in decoded["owners"].items()}
