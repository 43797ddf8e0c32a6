"""Stateful property test of prefix caching and forks: block tables sharing a tiny pool, against the log.

Hypothesis drives admit (lookup + share, then allocate the tail) / extend /
fork (parallel sampling: a child table sharing every block, its partly filled
last block copied on its first write) / preempt / abort / finish / reset over
four owners whose token sequences come
from a two-token vocabulary, so prefixes collide all the time and the pool
(8 blocks of 2 tokens) evicts often. After every step: the live pool equals
the fold of its events and the replay of the log; every audit invariant holds
(each block's count equals the number of block tables holding it, free iff
count 0, the key index holds only registered blocks of the right key, no block
twice, free + cached-free + held == num_blocks); and the taken key of each
shared block names exactly the tokens of every table that holds it. A model
of the KV cache (slot -> token, written at every append, copied at every
COPY) proves that no table's write reaches another table's tokens. A parent
neither grows nor ends while its children hold blocks (the engine's rule: the
prompt's holder stays until every sample ends).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from nanoserve.allocator import (
    BlockAllocator,
    BlockKey,
    BlockTable,
    FreeReason,
    KVCacheExhausted,
    PoolState,
    apply,
    extend_block_keys,
)
from nanoserve.allocator.log import EventLog, audit, replay
from nanoserve.migrations import upgrade

NUM_BLOCKS = 8
BLOCK_SIZE = 2
OWNERS = st.sampled_from(["A", "B", "C", "D"])
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=9)
SALTS = st.sampled_from([(), ("s",)])


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prefix") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


class Sequence_:
    """One owner's tokens, block table and keys (what the engine's Request keeps)."""

    def __init__(self, table: BlockTable, tokens: list[int], salt: tuple[str, ...]) -> None:
        self.table = table
        self.tokens = tokens
        self.salt = salt
        self.keys: list[BlockKey] = []

    def block_keys(self) -> list[BlockKey]:
        return extend_block_keys(self.keys, self.tokens, BLOCK_SIZE, self.salt)


class PrefixCacheMachine(RuleBasedStateMachine):
    template: Path
    kinds_seen: ClassVar[set[str]] = set()  # event kinds over every example: the run must have shared and evicted

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        shutil.copy(self.template, self.folder / "log.db")
        self.url = f"sqlite:///{self.folder / 'log.db'}"
        self.log = EventLog.open(self.url, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_events_per_snapshot=7)
        self.pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.sequences: dict[str, Sequence_] = {}  # owner -> its running sequence
        self.rebuilt = PoolState.fresh(NUM_BLOCKS, BLOCK_SIZE)
        self.step = 0
        self.num_hits = 0
        self.history: list[tuple[list[int], tuple[str, ...]]] = []  # prompts admitted so far
        self.kv: dict[int, int] = {}  # slot -> the token whose KV it holds (the cache, modelled)
        self.children: dict[str, set[str]] = {}  # parent owner -> its live forked children

    def _write(self, sequence: Sequence_, start: int) -> None:
        """The forward pass writes the KV of tokens ``start..`` (after copying the blocks copied on write)."""
        for source, destination in sequence.table.take_copies():
            for offset in range(BLOCK_SIZE):
                if source * BLOCK_SIZE + offset in self.kv:
                    self.kv[destination * BLOCK_SIZE + offset] = self.kv[source * BLOCK_SIZE + offset]
        positions = range(start, len(sequence.tokens))
        for slot, token in zip(sequence.table.slot_mapping(positions), sequence.tokens[start:], strict=True):
            self.kv[slot] = token

    def _compute(self, sequence: Sequence_) -> None:
        """The forward pass wrote every token's KV: register the full blocks."""
        sequence.table.register(sequence.block_keys(), sequence.table.num_tokens)

    @rule(owner=OWNERS, tokens=TOKENS, salt=SALTS)
    def admit(self, owner: str, tokens: list[int], salt: tuple[str, ...]) -> None:
        if owner in self.sequences:
            return
        sequence = Sequence_(BlockTable(self.pool, owner), tokens, salt)
        keys = sequence.block_keys()[: (len(tokens) - 1) // BLOCK_SIZE]
        num_hits, num_cached_free = self.pool.count_prefix_hits(owner, keys)
        num_needed = sequence.table.blocks_needed(len(tokens)) - num_hits
        if num_needed > self.pool.num_free - num_cached_free:
            return  # the scheduler would wait
        num_cached_tokens = sequence.table.share_prefix(keys)
        assert num_cached_tokens == num_hits * BLOCK_SIZE < len(tokens)
        self.num_hits += num_hits
        sequence.table.append_tokens(len(tokens) - num_cached_tokens)
        self.sequences[owner] = sequence
        self.history.append((list(tokens), salt))
        self._write(sequence, num_cached_tokens)
        self._compute(sequence)

    @precondition(lambda self: self.history)
    @rule(owner=OWNERS, data=st.data())
    def admit_again(self, owner: str, data: st.DataObject) -> None:
        """A prompt sent before (a system prompt, a conversation's history), maybe with more tokens."""
        tokens, salt = data.draw(st.sampled_from(self.history))
        self.admit(owner, tokens + data.draw(st.lists(st.integers(0, 1), max_size=3)), salt)

    @rule(owner=OWNERS, tokens=TOKENS)
    def extend(self, owner: str, tokens: list[int]) -> None:
        sequence = self.sequences.get(owner)
        if sequence is None or self.children.get(owner):
            return
        try:
            sequence.table.append_tokens(len(tokens))
        except KVCacheExhausted:
            return
        start = len(sequence.tokens)
        sequence.tokens += tokens
        self._write(sequence, start)
        self._compute(sequence)

    @rule(parent=OWNERS, child=OWNERS, first_token=st.integers(0, 1))
    def fork(self, parent: str, child: str, first_token: int) -> None:
        """Parallel sampling: ``child`` takes every block of ``parent`` by reference, then writes its first
        sampled token (copying the parent's partly filled last block)."""
        sequence = self.sequences.get(parent)
        if sequence is None or child in self.sequences:
            return
        forked = Sequence_(sequence.table.fork(child), list(sequence.tokens), sequence.salt)
        forked.keys = list(sequence.keys)
        self.sequences[child] = forked
        self.children.setdefault(parent, set()).add(child)
        self.extend(child, [first_token])

    @rule(owner=OWNERS, reason=st.sampled_from([FreeReason.FINISHED, FreeReason.ABORTED, FreeReason.PREEMPTED]))
    def end(self, owner: str, reason: FreeReason) -> None:
        """Finish, abort or preempt: every ending releases the table's references."""
        if self.children.get(owner):
            return
        sequence = self.sequences.pop(owner, None)
        if sequence is not None:
            if sequence.table.parent is not None:
                self.children[sequence.table.parent].discard(owner)
            sequence.table.release(reason)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == (not self.sequences)
        if not self.sequences:
            assert self.pool.num_cached == 0

    @rule()
    def persist(self) -> None:
        events = self.pool.take_events()
        for event in events:
            apply(self.rebuilt, event)
            self.kinds_seen.add(event.kind.value)
        self.log.append_batch(self.step, events, self.pool.snapshot)
        self.step += 1

    @invariant()
    def counts_match_the_tables(self) -> None:
        state = self.pool.state()
        holders: dict[int, list[str]] = {}
        for owner, sequence in self.sequences.items():
            assert sequence.table.num_tokens == len(sequence.tokens)
            for block_id in sequence.table.block_ids:
                holders.setdefault(block_id, []).append(owner)
        for block_id in range(NUM_BLOCKS):
            assert state.ref_count(block_id) == len(holders.get(block_id, [])), block_id
            assert sorted(state.holders(block_id)) == sorted(holders.get(block_id, []))
        free, cached_free = set(state.free_block_ids), set(state.cached_free)
        assert len(free) + len(cached_free) + len(state.owners) == NUM_BLOCKS
        assert free.isdisjoint(cached_free)
        assert free.isdisjoint(state.owners)
        assert cached_free.isdisjoint(state.owners)
        assert cached_free <= set(state.block_keys)
        assert set(state.sharers) <= set(state.owners)
        assert state.copy_on_write <= set(state.sharers)
        assert state.key_blocks == {key: block_id for block_id, (key, _) in state.block_keys.items()}

    @invariant()
    def shared_blocks_hold_the_same_tokens(self) -> None:
        """Every table holding a registered block has, at that block, the tokens its key was made of."""
        state = self.pool.state()
        for sequence in self.sequences.values():
            keys = sequence.block_keys()
            for index, block_id in enumerate(sequence.table.block_ids[: sequence.table.num_registered_blocks]):
                assert state.block_keys[block_id][0] == keys[index].key

    @invariant()
    def every_table_reads_its_own_tokens(self) -> None:
        """The KV each table's slots hold is its own tokens: no write reached another table's block."""
        for sequence in self.sequences.values():
            slots = sequence.table.slot_mapping(range(len(sequence.tokens)))
            assert [self.kv.get(slot) for slot in slots] == sequence.tokens, sequence.table

    @precondition(lambda self: self.pool.num_pending_events == 0)
    @invariant()
    def live_pool_equals_fold_and_replay(self) -> None:
        live = self.pool.state()
        assert self.rebuilt == live
        assert self.log.flush(timeout_s=10)
        replayed = replay(self.url)
        assert replayed == live
        assert replayed.violations == []

    def teardown(self) -> None:
        try:
            while self.sequences:
                for owner in list(self.sequences):
                    self.end(owner, FreeReason.ABORTED)
            self.persist()
            self.log.close(final_state=self.pool.snapshot())
            report = audit(self.url)
            assert report.clean, report.render()
            assert replay(self.url, from_snapshot=False) == self.pool.state()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def test_prefix_cache_pool_and_log_agree_at_every_step(migrated_db: Path) -> None:
    PrefixCacheMachine.template = migrated_db
    run_state_machine_as_test(
        PrefixCacheMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            derandomize=True,  # the same examples each run: the kinds every run must see are seen
        ),
    )
    assert {"register", "share", "release", "evict", "cache_reset", "fork", "copy"} <= PrefixCacheMachine.kinds_seen
