"""``Replayer``: rebuild a pool from its log, checking every event against the state.

``Replayer`` walks an epoch's rows in seq order and applies each block event
to a ``PoolState`` with ``transition.apply``, the function the live allocator
changes its pool with. On the way it checks the log's rules and collects every
break as a ``Violation`` (never raising half-way): sequence numbers
contiguous, hash chain intact, batches whole, records well-formed, allocate
only free blocks, free only allocated blocks of the named owner, POOL_INIT
first, nothing after POOL_CLOSE, snapshots equal to the replayed state.

Two loops apply rows: ``apply_rows`` decodes every record into a
``BlockEvent`` and applies it (the checked path), and ``apply_intact_rows``,
for rows whose hash chain is verified already, inlines the common case of
``apply`` (blocks taken from the top of the free stack, blocks freed by their
owner, and REGISTER, SHARE, RELEASE, EVICT that break no rule, through
``cache_replay``) because it replays millions of events; anything else it
hands to the checked path's own code. Both take a record's fields from ``record_codec``
(the fast loop splits a whole chunk at once). The fast loop is an optimisation
guarded by tests/allocator/test_replay_paths.py, which proves it equal to the
checked one (``transition.apply``) on random logs (Hypothesis), damaged ones
included; a new event kind needs nothing here.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log import cache_replay
from nanoserve.allocator.log.hash_chain import genesis_hash
from nanoserve.allocator.log.packed_rows import UnreadableRecords
from nanoserve.allocator.log.reader import EpochInfo
from nanoserve.allocator.log.record_codec import (
    BLOCK_KINDS,
    DATA_KINDS,
    NUM_FIELDS,
    REASONS,
    decode_block_event,
    decode_block_id_list,
    split_record,
    split_records,
)
from nanoserve.allocator.log.snapshot_codec import check_whole, decode_snapshot
from nanoserve.allocator.pool_state import PoolState, Violation
from nanoserve.allocator.transition import apply

# one stored row as replay reads it: (seq, kind, owner, record, hash), EVENT_COLUMNS
Row = tuple[Any, ...]

_digest = operator.methodcaller("digest")
# columns of an EVENT_COLUMNS row, taken out of a whole chunk at C speed (zip(*chunk) is ten times slower)
_seq_of, _record_of, _hash_of = operator.itemgetter(0), operator.itemgetter(3), operator.itemgetter(4)
_INIT = EventKind.POOL_INIT.value
_SNAPSHOT = EventKind.SNAPSHOT.value
_CLOSE = EventKind.POOL_CLOSE.value

# kind -> small int for the fast loop: block kinds < _UNKNOWN (inlined: plain ones <= _FREE_CODE, prefix-cache
# ones after) < unknown kinds < data kinds (>= _DATA)
_ALLOCATE_CODE, _FREE_CODE, _REGISTER_CODE, _SHARE_CODE, _RELEASE_CODE, _EVICT_CODE = range(6)
_UNKNOWN, _SNAPSHOT_CODE, _INIT_CODE, _CLOSE_CODE = range(6, 10)
_DATA = _SNAPSHOT_CODE
_KIND_CODES = {
    EventKind.ALLOCATE.value: _ALLOCATE_CODE,
    EventKind.ALLOCATE_FOR.value: _ALLOCATE_CODE,
    EventKind.FREE.value: _FREE_CODE,
    EventKind.FREE_ALL.value: _FREE_CODE,
    EventKind.REGISTER.value: _REGISTER_CODE,
    EventKind.SHARE.value: _SHARE_CODE,
    EventKind.RELEASE.value: _RELEASE_CODE,
    EventKind.EVICT.value: _EVICT_CODE,
    _SNAPSHOT: _SNAPSHOT_CODE,
    _INIT: _INIT_CODE,
    _CLOSE: _CLOSE_CODE,
}
# prefix-cache code -> its fast transition (``cache_replay``); False hands the record to the checked path
_CACHE_APPLY: dict[int, Callable[[PoolState, dict[int, None], list[int], str, str], bool]] = {
    _REGISTER_CODE: cache_replay.register,
    _SHARE_CODE: cache_replay.share,
    _RELEASE_CODE: cache_replay.release_reference,
    _EVICT_CODE: cache_replay.evict,
}  # A block kind missing here (a new one, CACHE_RESET) takes the checked path in the fast loop too, through
# ``_apply_record``; one inlined here must be a block kind, applied as ``transition.take`` (allocate codes),
# ``release`` (free) or its ``cache_replay`` function.
assert {kind for kind, code in _KIND_CODES.items() if code < _UNKNOWN} <= set(BLOCK_KINDS)


class Replayer:
    """The pool state of one epoch, advanced one stored row at a time.

    Start from the epoch's genesis (``start_seq=1``) or from a SNAPSHOT row
    (``start_seq`` its seq, ``previous_hash`` the stored hash of the row
    before it, then ``load_snapshot``).
    """

    def __init__(self, info: EpochInfo, start_seq: int = 1, previous_hash: bytes | None = None) -> None:
        self.info = info
        self.pool = PoolState.fresh(info.num_blocks, info.block_size)
        self.violations: list[Violation] = []
        self.expected_seq = start_seq
        self.previous_hash = genesis_hash(info.pool_id, info.epoch) if previous_hash is None else previous_hash
        self.batch_end = start_seq - 1  # last seq of the batch being read
        self.last_seq = start_seq - 1
        self.closed_seq: int | None = None
        self._start_snapshot_seq = start_seq if start_seq > 1 else None
        self.start_seq = start_seq  # the first seq this replay reads
        self.num_events = 0
        self._seq = start_seq  # the row being applied, for ``_report``

    def apply_chunks(self, chunks: Iterable[Sequence[Row]]) -> None:
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

    def _chunk_is_intact(self, chunk: Sequence[Row]) -> bool:
        if not chunk:
            return True
        first = self.expected_seq
        if list(map(_seq_of, chunk)) != list(range(first, first + len(chunk))):
            return False
        hashes = list(map(_hash_of, chunk))
        previous = [self.previous_hash]
        previous += hashes[:-1]
        try:
            records = list(map(str.encode, map(_record_of, chunk)))
            return list(map(_digest, map(hashlib.sha256, map(operator.add, previous, records)))) == hashes
        except TypeError:  # a column of the wrong type (text read as bytes, a hash stored as text)
            return False

    def apply_rows(self, rows: Sequence[Row], verified: bool = False) -> None:
        """Check and apply rows in seq order; ``verified`` skips the seq and hash checks already done."""
        previous = self.previous_hash
        expected = self.expected_seq
        batch_end = self.batch_end
        violate = self.violate
        sha256 = hashlib.sha256
        for seq, kind_column, owner_column, record, stored in rows:
            if type(seq) is not int or type(record) is not str:  # damaged columns: name them, apply nothing
                self._bad_columns(expected, seq, record, owner_column)
                if type(seq) is int:
                    if not verified and seq > expected:
                        violate(expected, "missing_events", f"seqs {expected}..{seq - 1} are missing")
                    expected = seq + 1
                    if type(record) is UnreadableRecords:  # it stands for all the seqs of its packed row
                        expected = record.last_seq + 1
                        self.num_events += record.last_seq - seq
                    previous = stored if type(stored) is bytes else previous
                continue
            if not verified:
                if seq != expected:
                    if seq > expected:
                        violate(expected, "missing_events", f"seqs {expected}..{seq - 1} are missing")
                    else:
                        violate(seq, "out_of_order", f"seq {seq} follows seq {expected - 1}")
                    if batch_end >= expected and seq > batch_end:
                        batch_end = seq - 1  # the gap already reported the torn batch
                computed = sha256(previous + record.encode()).digest()
                if computed != stored:
                    what = "does not match" if type(stored) is bytes else f"is {type(stored).__name__}, not bytes, and"
                    violate(
                        seq,
                        "hash_mismatch",
                        f"stored hash {what} the record and the previous hash",
                        owner=owner_column,
                    )
                    if type(stored) is not bytes:
                        stored = computed  # the next record chains from what this one should have stored
            expected = seq + 1
            previous = stored
            fields = split_record(record)
            try:
                if len(fields) != NUM_FIELDS:
                    raise ValueError
                record_seq, batch_text, kind, block_text, _step, reason_text, _wall_ns, _mono_ns, tail = fields
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
            if self.closed_seq is not None:
                violate(seq, "after_close", f"{kind} after POOL_CLOSE at seq {self.closed_seq}", owner=owner)
            self._apply_record(seq, kind, block_text, reason_text, tail)
        self.previous_hash = previous
        self.expected_seq = expected
        self.last_seq = expected - 1
        self.num_events += len(rows)
        self.batch_end = batch_end

    def _bad_columns(self, expected: int, seq: Any, record: Any, owner: Any) -> None:
        """A row whose seq is not an integer or whose record is not text: reported, not applied."""
        if type(seq) is not int:
            self.violate(expected, "bad_record", f"a row after seq {expected - 1} has seq {seq!r}, not an integer")
            return
        if type(record) is UnreadableRecords:
            self.violate(seq, "bad_record", f"seqs {seq}..{record.last_seq} (one packed row): {record.cause}")
            return
        if isinstance(record, bytes):
            try:
                record.decode()
                problem = "is stored as bytes, not text"
            except UnicodeDecodeError as exc:
                problem = f"is not valid UTF-8 (byte {record[exc.start]:#04x} at offset {exc.start})"
        else:
            problem = f"is {type(record).__name__}, not text"
        owner_text = owner if type(owner) is str else None
        self.violate(seq, "bad_record", f"record {record[:80]!r} {problem}", owner=owner_text)

    def _apply_record(self, seq: int, kind: str, block_text: str, reason_text: str, tail: str) -> None:
        """Apply one record's event to the pool (the checked path's step; the fast loop's fallback)."""
        if kind in BLOCK_KINDS:
            try:
                event = decode_block_event(kind, block_text, reason_text, tail)
            except ValueError as exc:
                self.violate(seq, "bad_record", str(exc), owner=tail)
                return
            self._seq = seq
            apply(self.pool, event, self._report)
        elif kind == _SNAPSHOT:
            self._snapshot(seq, tail)
        elif kind == _INIT:
            if seq != 1:
                self.violate(seq, "misplaced_init", "POOL_INIT is not the epoch's first record")
        elif kind == _CLOSE:
            self.closed_seq = seq
        else:
            owner = None if kind in DATA_KINDS else tail
            self.violate(seq, "unknown_kind", f"event kind {kind!r} is not known to this replay", owner=owner)

    def apply_intact_rows(self, rows: Sequence[Row]) -> bool:
        """Apply rows (EVENT_COLUMNS; the hash unused) whose hash chain is verified already.

        Gives what ``apply_rows(rows, verified=True)`` gives (state, violations,
        batch and close tracking), with the common case of ``apply`` inlined:
        this is the loop that replays millions of events. Any other record
        (blocks off the stack's top, a malformed one, a snapshot) goes through
        ``_apply_record`` as in the checked path. Returns False, leaving the
        replayer half-updated, at the first seq out of line; the caller then
        replays from the start with ``apply_chunks``, which names it. Needs
        ``invariant_holds()`` (a block on top of the free stack is then free
        and in the pool).
        """
        expected = self.expected_seq
        batch_end = self.batch_end
        batch_end_text = str(batch_end)
        free, owners = self.pool.free_block_ids, self.pool.owners
        block_keys, sharers = self.pool.block_keys, self.pool.sharers
        pop_owner, push_free = owners.pop, free.append
        violate = self.violate
        apply_record = self._apply_record
        num_blocks = self.pool.num_blocks
        kind_codes = _KIND_CODES
        reasons = REASONS
        closed_seq = self.closed_seq
        pool = self.pool
        cached = dict.fromkeys(pool.cached_free)  # the cached-free list while this loop runs (``cache_replay``)
        cache_apply = _CACHE_APPLY
        records = split_records(map(_record_of, rows))  # the codec splits each record as the loop reaches it
        for (seq, kind_column, owner_column, record, _), fields in zip(rows, records, strict=True):
            if seq != expected:
                pool.cached_free[:] = cached
                return False
            expected = seq + 1
            try:
                _, batch_text, kind, block_text, _, reason_text, _, _, tail = fields
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
            if code > _FREE_CODE or pool.copy_on_write:  # forked partial blocks: every kind checked
                if (
                    code < _UNKNOWN and not pool.copy_on_write
                ):  # a prefix-cache kind: its fast transition, else the checked path
                    try:
                        if cache_apply[code](pool, cached, decode_block_id_list(block_text), tail, reason_text):
                            continue
                    except ValueError:
                        pass
                pool.cached_free[:] = cached
                apply_record(seq, kind, block_text, reason_text, tail)
                cached = dict.fromkeys(pool.cached_free)
                closed_seq = self.closed_seq  # POOL_CLOSE sets it; only a data record can
                continue
            if reason_text not in reasons:
                pool.cached_free[:] = cached
                apply_record(seq, kind, block_text, reason_text, tail)
                cached = dict.fromkeys(pool.cached_free)
                continue
            try:
                block_ids = decode_block_id_list(block_text)
            except ValueError:
                apply_record(seq, kind, block_text, reason_text, tail)  # names the block list: no state changes
                continue
            if (
                code == _FREE_CODE
                and (block_keys or sharers)
                and not cache_replay.plain_blocks(block_ids, block_keys, sharers)
            ):
                pool.cached_free[:] = cached  # a prefix-cache block freed as a plain one: the checked path
                apply_record(seq, kind, block_text, reason_text, tail)
                cached = dict.fromkeys(pool.cached_free)
            elif code == _FREE_CODE:  # transition.release, inlined
                for block_id in block_ids:
                    holder = pop_owner(block_id, None)
                    if holder == tail:
                        push_free(block_id)
                    elif holder is None:
                        rule = "free_of_free_block" if 0 <= block_id < num_blocks else "foreign_block"
                        violate(seq, rule, "block is not allocated", block_id, tail)
                    else:
                        violate(seq, "owner_mismatch", f"block is held by {holder!r}", block_id, tail)
                        push_free(block_id)
            elif free[-len(block_ids) :] == block_ids[::-1]:  # transition.take from the top, inlined
                del free[-len(block_ids) :]
                for block_id in block_ids:
                    owners[block_id] = tail
            else:
                pool.cached_free[:] = cached
                apply_record(seq, kind, block_text, reason_text, tail)
                cached = dict.fromkeys(pool.cached_free)
        pool.cached_free[:] = cached
        self.expected_seq = expected
        self.last_seq = expected - 1
        self.num_events += len(rows)
        self.batch_end = batch_end
        return True

    def invariant_holds(self) -> bool:
        """The free stack holds distinct pool blocks, none of them owned or cached-free, and the cached-free list
        no block twice (true unless a snapshot says otherwise)."""
        free = set(self.pool.free_block_ids)
        return (
            len(free) == len(self.pool.free_block_ids)
            and free.isdisjoint(self.pool.owners)
            and free.isdisjoint(self.pool.cached_free)
            and len(set(self.pool.cached_free)) == len(self.pool.cached_free)
            and all(type(block_id) is int and 0 <= block_id < self.pool.num_blocks for block_id in free)
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
        """A copy of the replayed pool, stamped with where it came from and what broke on the way."""
        state = self.pool.copy()
        state.last_seq = self.last_seq
        state.pool_id = self.info.pool_id
        state.epoch = self.info.epoch
        state.violations = list(self.violations)
        return state

    def load_snapshot(self, tail: str) -> None:
        """Take the state stored in a SNAPSHOT record's tail as the current one.

        ValueError when it is unreadable or breaks the ``PoolState`` invariant
        (every block of the pool free or owned by a named owner, exactly once):
        replay then starts at genesis instead, and reaching the snapshot reports it.
        """
        pool = decode_snapshot(tail, self.pool.num_blocks, self.pool.block_size)
        check_whole(pool)
        self.pool = pool

    def _snapshot(self, seq: int, tail: str) -> None:
        if seq == self._start_snapshot_seq:
            return  # the snapshot this replay started from
        try:
            snapshot = decode_snapshot(tail, self.pool.num_blocks, self.pool.block_size)
        except ValueError as exc:
            self.violate(seq, "bad_snapshot", f"snapshot data unreadable: {exc}")
            return
        if snapshot != self.pool:
            self.violate(seq, "snapshot_mismatch", "snapshot differs from the replayed state")

    def _report(self, rule: str, message: str, block_id: int | None, owner: str | None) -> None:
        """``transition.apply``'s report: a Violation at the row being applied."""
        self.violations.append(Violation(self._seq, rule, message, block_id, owner))

    def violate(self, seq: int, rule: str, message: str, block_id: int | None = None, owner: str | None = None) -> None:
        self.violations.append(Violation(seq=seq, rule=rule, message=message, block_id=block_id, owner=owner))
