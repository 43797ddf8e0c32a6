"""The fast replay loop is the checked one, proved on random logs (Hypothesis).

``Replayer.apply_intact_rows`` inlines the transition function for speed (it
replays million-event epochs); ``Replayer.apply_rows`` decodes each record and
applies it with ``transition.apply``. On random valid workloads and on random
damage (edited fields, columns, deleted, swapped and duplicated rows, records
after POOL_CLOSE, a stale snapshot) the fast loop must give the checked loop's
state and violations exactly, or hand the rows over (seqs out of line). The
logs are built in memory by the log writer's own encoder, without a database.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.allocator import (
    BlockAllocator,
    BlockTable,
    EventKind,
    FreeReason,
    KVCacheExhausted,
    PoolState,
    extend_block_keys,
)
from nanoserve.allocator.log.hash_chain import chain_hash, genesis_hash
from nanoserve.allocator.log.reader import EpochInfo
from nanoserve.allocator.log.record_codec import entries_are, split_record
from nanoserve.allocator.log.replay_state import Replayer
from nanoserve.allocator.log.snapshot_codec import snapshot_data
from nanoserve.allocator.log.writer import Batch, LogWriter

NUM_BLOCKS = 8
BLOCK_SIZE = 4
OWNERS = ("A", "B", "C")
Row = tuple[Any, ...]  # (seq, kind, owner, record, hash): what replay reads

OPERATIONS = st.one_of(
    st.tuples(st.just("allocate"), st.sampled_from(OWNERS)),
    st.tuples(st.just("allocate_for"), st.integers(1, 4 * BLOCK_SIZE), st.sampled_from(OWNERS)),
    st.tuples(st.just("release"), st.sampled_from(OWNERS), st.sampled_from([None, *FreeReason])),
    st.tuples(st.just("free"), st.integers(0, NUM_BLOCKS - 1)),
    st.tuples(st.just("step"), st.booleans()),  # end of a step; with a SNAPSHOT or not
    # prefix caching: a sequence of a two-token vocabulary shares what is cached, takes the rest and
    # registers its full blocks; it ends (releasing its references) at its owner's next "end"
    st.tuples(st.just("admit"), st.sampled_from(("D", "E", "F")), st.lists(st.integers(0, 1), min_size=1, max_size=10)),
    st.tuples(st.just("end"), st.sampled_from(("D", "E", "F")), st.sampled_from([None, *FreeReason])),
    st.tuples(st.just("reset"), st.just("admin")),
    # parallel sampling: a child forks a live sequence and writes one token (copying a partly filled last block)
    st.tuples(st.just("fork"), st.sampled_from(("D", "E", "F")), st.sampled_from(("D", "E", "F"))),
)


@dataclass
class Log:
    rows: list[Row]
    info: EpochInfo
    pool: PoolState  # the live pool after the last event


def write_log(operations: list[tuple[Any, ...]], close: bool) -> Log:
    """Drive a pool as the engine does and encode its batches with the log writer (no database)."""
    pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    writer = LogWriter(None, "p", 1, "writer", 0, genesis_hash("p", 1), 16)  # type: ignore[arg-type]
    init = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "model": None, "config": None}
    stored, _ = writer.seal_first(Batch(1, None, 1, 1, (), EventKind.POOL_INIT, init))
    batches: list[Batch] = []
    tables: dict[str, BlockTable] = {}  # owner -> its prefix-cached sequence
    seq = 1
    for step, operation in enumerate([*operations, ("step", False)]):
        name = operation[0]
        try:
            if name == "admit" and operation[1] not in tables:
                tokens = operation[2]
                keys = extend_block_keys([], tokens, BLOCK_SIZE)
                hits, hits_free = pool.count_prefix_hits(operation[1], keys[: (len(tokens) - 1) // BLOCK_SIZE])
                if -(-len(tokens) // BLOCK_SIZE) - hits > pool.num_free - hits_free:
                    continue
                table = tables[operation[1]] = BlockTable(pool, operation[1])
                table.append_tokens(len(tokens) - table.share_prefix(keys[:hits]))
                table.register(keys, len(tokens))
            elif name == "fork" and operation[1] in tables and operation[2] not in tables:
                tables[operation[2]] = tables[operation[1]].fork(operation[2])
                tables[operation[2]].append_tokens(1)
            elif name == "end" and operation[1] in tables:
                tables.pop(operation[1]).release(operation[2])
            elif name == "reset":
                pool.reset_prefix_cache(operation[1])
            elif name == "allocate":
                pool.allocate(operation[1])
            elif name == "allocate_for":
                pool.allocate_for(operation[1], operation[2])
            elif name == "release":
                pool.free_all(pool.state().blocks_by_owner().get(operation[1], [])[::-1], operation[2])
            elif name == "free":
                pool.free(operation[1], FreeReason.PREEMPTED)
        except (KVCacheExhausted, ValueError):
            continue  # refused: the pool emitted nothing
        if name == "step" and pool.num_pending_events:
            events = pool.take_events()
            snapshot = snapshot_data(pool.snapshot()) if operation[1] else None
            batch = Batch(seq + 1, step, 2 * step, step, events, EventKind.SNAPSHOT if snapshot else None, snapshot)
            batches.append(batch)
            seq = batch.last_seq
    if close:
        batches.append(Batch(seq + 1, None, 0, 0, (), EventKind.POOL_CLOSE, {"num_free": pool.num_free}))
    rows, last_seq, head_hash, closed_seq = writer.seal_rows(batches)
    stored += rows
    info = EpochInfo("p", 1, NUM_BLOCKS, BLOCK_SIZE, None, 0, last_seq if rows else 1, head_hash, closed_seq)
    return Log(
        [(seq, kind, owner, record, hash_) for _, _, seq, kind, owner, record, hash_, _ in stored], info, pool.state()
    )


NUMBERS = ("", "x", "-1", "0", "1", "2", "3", "7", "8", "9", "99", " 2", "1_0")
BLOCK_LISTS = (*NUMBERS, "0,1", "1,0", "8,0", "0,0", "3,", "2,3,4")
KINDS = (
    "allocate", "allocate_for", "free", "free_all", "snapshot", "pool_init", "pool_close", "bogus", "",
    "register", "share", "release", "evict", "cache_reset", "fork", "copy",
)  # fmt: skip
REASONS = ("", "finished", "preempted", "aborted", "abortec", "x", ";", "finished;", ";ab=1", ";ab:", ";ab=x,cd=1")
TAILS = ("A", "B", "C", "", "{}", '{"free_block_ids":[],"owners":{}}', "null")
# a damaged record field: (index, what it may read); block_ids (3) the most often, replay reads it for every event
FIELD_EDITS = (
    (0, NUMBERS), (1, NUMBERS), (2, KINDS), (3, BLOCK_LISTS), (3, BLOCK_LISTS), (3, BLOCK_LISTS), (4, NUMBERS),
    (5, REASONS), (5, REASONS), (6, NUMBERS), (8, TAILS), (8, TAILS),
)  # fmt: skip
DAMAGES = (
    "field",
    "field",
    "field",
    "field",
    "field",
    "cut",
    "kind_column",
    "owner_column",
    "delete",
    "swap",
    "duplicate",
    "entry",
    "entry",
    "entry",
)
# edits of one prefix-cache entry (``key:parent:token_ids``, ``key=count``, ``key``), see ``edit_entry``
ENTRY_EDITS = (
    "count+1", "count-1", "count0", "drop", "duplicate", "swap", "other_key", "key=", "tokens_x", "tokens_unicode",
    "no_tokens", "reason",
)  # fmt: skip


def edit_entry(record: str, keys: list[str], rng: random.Random) -> str:
    """``record`` with one of its prefix-cache entries edited (a record without entries: unchanged)."""
    fields = split_record(record)
    if len(fields) != 9 or ";" not in fields[5]:
        return record
    reason, _, text = fields[5].partition(";")
    entries = text.split(",")
    index = rng.randrange(len(entries))
    entry = entries[index]
    what = rng.choice(ENTRY_EDITS)
    key, equals, count = entry.partition("=")
    if what.startswith("count") and equals and count.isdigit():
        entries[index] = (
            key + "=" + {"count+1": str(int(count) + 1), "count-1": str(int(count) - 1)}.get(what, "0" + count)
        )
    elif what == "drop" and len(entries) > 1:
        del entries[index]
    elif what == "duplicate":
        entries.insert(index, entry)
    elif what == "swap":
        other = rng.randrange(len(entries))
        entries[index], entries[other] = entries[other], entries[index]
    elif what == "other_key" and keys:
        entries[index] = rng.choice(keys) + entry[len(entry.split(":")[0].split("=")[0]) :]
    elif what == "key=":
        entries[index] = "k=" + entry
    elif what.startswith("tokens") and entry.count(":") == 2:
        head = entry.rpartition(":")[0]
        entries[index] = head + (":x" if what == "tokens_x" else ":\u0663.1")
    elif what == "no_tokens" and entry.count(":") == 2:
        entries[index] = entry.rpartition(":")[0]
    elif what == "reason":
        reason = rng.choice(("finished", "x", ""))
    fields[5] = reason + ";" + ",".join(entries)
    return "|".join(fields)


def damage(rows: list[Row], seed: int) -> list[Row]:
    """``rows`` with 1..3 random edits; hashes are left alone (the verified loops do not read them).

    The edits are drawn from ``random.Random(seed)``: uniform over rows, where
    Hypothesis's own integers favour the first and last ones.
    """
    rng = random.Random(seed)
    rows = list(rows)
    for _ in range(rng.randint(1, 3)):
        index = rng.randrange(len(rows))
        seq, kind, owner, record, hash_ = rows[index]
        what = rng.choice(DAMAGES)
        if what == "field":
            fields = split_record(record)
            field, texts = rng.choice(FIELD_EDITS)
            fields[min(field, len(fields) - 1)] = rng.choice(texts)
            rows[index] = (seq, kind, owner, "|".join(fields), hash_)
        elif what == "cut":
            rows[index] = (seq, kind, owner, "|".join(split_record(record)[: rng.randint(0, 8)]), hash_)
        elif what == "kind_column":
            rows[index] = (seq, rng.choice(KINDS), owner, record, hash_)
        elif what == "owner_column":
            rows[index] = (seq, kind, rng.choice([None, *OWNERS]), record, hash_)
        elif what == "delete" and len(rows) > 1:
            del rows[index]
        elif what == "swap":
            other = rng.randrange(len(rows))
            rows[index], rows[other] = rows[other], rows[index]
        elif what == "duplicate":
            rows.insert(index, rows[index])
        elif what == "entry":
            cache_rows = [i for i, row in enumerate(rows) if row[1] in CACHE_KIND_TEXTS]
            if cache_rows:
                index = rng.choice(cache_rows)
                seq, kind, owner, record, hash_ = rows[index]
                rows[index] = (seq, kind, owner, edit_entry(record, log_keys(rows), rng), hash_)
    return rows


CACHE_KIND_TEXTS = ("register", "share", "release", "evict", "cache_reset")


def log_keys(rows: list[Row]) -> list[str]:
    """Every key the rows' prefix-cache entries name."""
    keys = []
    for row in rows:
        fields = split_record(row[3])
        if row[1] in CACHE_KIND_TEXTS and len(fields) == 9:
            keys += [entry.split(":")[0].split("=")[0] for entry in fields[5].partition(";")[2].split(",")]
    return keys


def renumber(rows: list[Row]) -> list[Row]:
    """Stored seqs 1, 2, 3, ... again (the damage stays in the records): the rows are then in line."""
    return [(seq, *row[1:]) for seq, row in enumerate(rows, 1)]


def chunked(rows: list[Row], seed: int) -> list[list[Row]]:
    rng = random.Random(seed)
    chunks, start = [], 0
    while start < len(rows):
        size = rng.randint(1, 7)
        chunks.append(rows[start : start + size])
        start += size
    return chunks


def outcome(replayer: Replayer) -> tuple[Any, ...]:
    state = replayer.state()
    return (
        state.free_block_ids,
        state.owners,
        state.sharers,
        state.cached_free,
        state.block_keys,
        state.key_blocks,
        replayer.violations,
        replayer.last_seq,
        replayer.batch_end,
        replayer.closed_seq,
        replayer.num_events,
    )


WORKLOADS = st.lists(OPERATIONS, max_size=40)


@settings(max_examples=300, deadline=None)
@given(operations=WORKLOADS, close=st.booleans(), seed=st.integers(0, 2**16))
def test_fast_and_checked_loops_rebuild_a_valid_log_exactly(
    operations: list[tuple[Any, ...]], close: bool, seed: int
) -> None:
    log = write_log(operations, close)
    checked = Replayer(log.info)
    checked.apply_rows(log.rows)
    checked.finish()
    fast = Replayer(log.info)
    fast.apply_chunks(chunked(log.rows, seed))
    fast.finish()
    assert outcome(fast) == outcome(checked)
    assert checked.violations == []
    assert checked.state() == log.pool
    assert checked.closed_seq == log.info.closed_seq


@settings(max_examples=1000, deadline=None)
@given(operations=WORKLOADS, close=st.booleans(), in_line=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_fast_loop_gives_the_checked_loops_result_on_damaged_rows_or_hands_over(
    operations: list[tuple[Any, ...]], close: bool, in_line: bool, seed: int
) -> None:
    log = write_log(operations, close)
    rows = damage(log.rows, seed)
    if in_line:
        rows = renumber(rows)
    checked = Replayer(log.info)
    fast = Replayer(log.info)
    handed_over = False
    for chunk in chunked(rows, seed):
        checked.apply_rows(chunk, verified=True)
        if not handed_over:
            handed_over = not fast.apply_intact_rows(chunk)
    if handed_over:
        assert [row[0] for row in rows] != list(range(1, len(rows) + 1))
    else:
        assert outcome(fast) == outcome(checked)


@settings(max_examples=300, deadline=None)
@given(operations=WORKLOADS, close=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_chunked_replay_names_damage_as_the_row_by_row_checks_do(
    operations: list[tuple[Any, ...]], close: bool, seed: int
) -> None:
    log = write_log(operations, close)
    rows = damage(log.rows, seed)
    checked = Replayer(log.info)
    checked.apply_rows(rows)
    checked.finish()
    fast = Replayer(log.info)
    fast.apply_chunks(chunked(rows, seed))
    fast.finish()
    assert outcome(fast) == outcome(checked)


def test_a_damaged_block_list_is_named_alike_by_both_loops() -> None:
    log = write_log([("allocate_for", 8, "A"), ("step", False), ("release", "A", None), ("step", True)], close=True)
    fields = split_record(log.rows[2][3])
    assert fields[2:4] == ["free_all", "1,0"]
    fields[3] = "1,x"
    previous = log.rows[1][4]
    record = "|".join(fields)
    rows = [*log.rows[:2], (3, "free_all", "A", record, chain_hash(previous, record)), *log.rows[3:]]
    expected = (3, "bad_record", "block_ids '1,x' is not a list of block ids", None, "A")
    checked = Replayer(log.info)
    checked.apply_rows(rows, verified=True)
    fast = Replayer(log.info)
    assert fast.apply_intact_rows(rows)
    for replayer in (checked, fast):
        violation = replayer.violations[0]
        assert (violation.seq, violation.rule, violation.message, violation.block_id, violation.owner) == expected
        assert replayer.violations[1].rule == "snapshot_mismatch"  # the blocks were never freed


def test_fast_loop_applies_valid_prefix_cache_records_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """REGISTER, SHARE, RELEASE and EVICT of a valid log never reach the checked path's ``_apply_record``."""
    operations: list[tuple[Any, ...]] = [
        ("admit", "D", [0, 1, 0, 1, 0, 1, 0, 1]),
        ("step", False),
        ("admit", "E", [0, 1, 0, 1, 0, 1, 0, 1]),
        ("step", False),
        ("end", "D", None),
        ("end", "E", None),
        ("step", False),
        *[("allocate", "A")] * NUM_BLOCKS,
        ("step", False),
    ]
    log = write_log(operations, close=False)
    kinds = {row[1] for row in log.rows}
    assert {"register", "share", "release", "evict"} <= kinds
    handed: list[str] = []
    original = Replayer._apply_record

    def counted(self: Replayer, seq: int, kind: str, block_text: str, reason_text: str, tail: str) -> None:
        handed.append(kind)
        original(self, seq, kind, block_text, reason_text, tail)

    monkeypatch.setattr(Replayer, "_apply_record", counted)
    fast = Replayer(log.info)
    assert fast.apply_intact_rows(log.rows)
    assert set(handed) <= {"pool_init", "snapshot", "allocate", "allocate_for"}
    assert fast.violations == []
    assert fast.state() == log.pool


@pytest.mark.parametrize(
    ("detail", "keys", "counts", "expected"),
    [
        (";ab=1,cd=2", ["ab", "cd"], [1, 2], True),
        ("finished;ab=0", ["ab"], [0], True),
        (";ab=01", ["ab"], [1], False),  # decodes to 1, but is not what the event writes: the checked path's
        (";ab=1", ["ab"], [2], False),
        ("x;ab=1", ["ab"], [1], False),  # not a FreeReason
        ("ab=1", ["ab"], [1], False),  # no ';'
        (";a=b=1", ["a=b"], [1], False),  # a snapshot's key holding '=': decode_detail reads key 'a'
        (";a,b=1", ["a,b"], [1], False),  # ... or ',': two entries
        (";ab,cd", ["ab", "cd"], None, True),
        (";a,b", ["a,b"], None, False),
        (";ab", ["cd"], None, False),
    ],
)
def test_entries_are_true_only_for_what_the_event_writes(
    detail: str, keys: list[str], counts: list[int] | None, expected: bool
) -> None:
    assert entries_are(detail, keys, counts) is expected
