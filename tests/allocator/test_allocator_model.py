"""Stateful property test: the allocator against a plain reference model, and the log against both.

Hypothesis drives random allocate / allocate_for / free / free_all calls
(exhaustion, double frees and foreign blocks included), and now and then hands
the pending events to the log as one step's batch, as the engine does. After
every call the live pool must equal the reference model; once its events are
taken, applying them to a fresh pool (the one transition function) and
replaying the log (from its snapshots and from the start) must give exactly
the live state.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from nanoserve.allocator import BlockAllocator, FreeReason, KVCacheExhausted, PoolState, apply
from nanoserve.allocator.log import EventLog, audit, replay
from nanoserve.migrations import upgrade

NUM_BLOCKS = 8
BLOCK_SIZE = 4
OWNERS = st.sampled_from(["A", "B", "C"])
# the reasons of frees that need nothing before them: a rejected_draft free gives back a draft
# allocation's blocks (the audit's rollback_of_non_draft), and DRAFT marks allocations
REASONS = st.sampled_from([None, *(r for r in FreeReason if r not in (FreeReason.DRAFT, FreeReason.REJECTED_DRAFT))])


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated SQLite file, copied per example (migrating each time would dominate the run)."""
    path = tmp_path_factory.mktemp("model") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


class AllocatorMachine(RuleBasedStateMachine):
    template: Path

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        shutil.copy(self.template, self.folder / "log.db")
        self.url = f"sqlite:///{self.folder / 'log.db'}"
        self.log = EventLog.open(self.url, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_events_per_snapshot=5)
        self.pool = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
        self.free_stack = list(range(NUM_BLOCKS - 1, -1, -1))  # reference model: top at the end
        self.owners: dict[int, str] = {}
        self.rebuilt = PoolState.fresh(NUM_BLOCKS, BLOCK_SIZE)  # every taken event applied, nothing else
        self.step = 0

    @rule(owner=OWNERS)
    def allocate(self, owner: str) -> None:
        if not self.free_stack:
            with pytest.raises(KVCacheExhausted):
                self.pool.allocate(owner)
            return
        expected = self.free_stack.pop()
        self.owners[expected] = owner
        assert self.pool.allocate(owner) == expected

    @rule(num_tokens=st.integers(1, 6 * BLOCK_SIZE), owner=OWNERS)
    def allocate_for(self, num_tokens: int, owner: str) -> None:
        num_needed = -(-num_tokens // BLOCK_SIZE)
        if num_needed > len(self.free_stack):
            with pytest.raises(KVCacheExhausted) as info:
                self.pool.allocate_for(num_tokens, owner)
            assert (info.value.requested, info.value.available) == (num_needed, len(self.free_stack))
            return
        expected = [self.free_stack.pop() for _ in range(num_needed)]
        self.owners.update(dict.fromkeys(expected, owner))
        assert self.pool.allocate_for(num_tokens, owner) == expected

    @rule(block_id=st.integers(0, NUM_BLOCKS), reason=REASONS)
    def free(self, block_id: int, reason: FreeReason | None) -> None:
        if block_id not in self.owners:  # a double free, or block NUM_BLOCKS: never in the pool
            with pytest.raises(ValueError, match=f"block {block_id} "):
                self.pool.free(block_id, reason)
            return
        del self.owners[block_id]
        self.free_stack.append(block_id)
        self.pool.free(block_id, reason)

    @rule(data=st.data(), reason=REASONS)
    def free_all(self, data: st.DataObject, reason: FreeReason | None) -> None:
        block_ids = data.draw(st.lists(st.integers(0, NUM_BLOCKS - 1), unique=True, max_size=4))
        if any(block_id not in self.owners for block_id in block_ids):
            with pytest.raises(ValueError, match="already free"):
                self.pool.free_all(block_ids, reason)
            return
        for block_id in block_ids:
            del self.owners[block_id]
        self.free_stack.extend(block_ids)
        self.pool.free_all(block_ids, reason)

    @rule()
    def persist(self) -> None:
        """The engine's end of a step: every pending event, in order, as one batch."""
        events = self.pool.take_events()
        for event in events:
            apply(self.rebuilt, event)
        self.log.append_batch(self.step, events, self.pool.snapshot)
        self.step += 1

    @invariant()
    def pool_matches_model(self) -> None:
        state = self.pool.state()
        assert (list(state.free_block_ids), state.owners) == (self.free_stack, self.owners)

    @precondition(lambda self: self.pool.num_pending_events == 0)
    @invariant()
    def taken_events_rebuild_live_state(self) -> None:
        assert self.rebuilt == self.pool.state()

    @precondition(lambda self: self.pool.num_pending_events == 0)
    @invariant()
    def replay_gives_live_state(self) -> None:
        assert self.log.flush(timeout_s=10)
        live = self.pool.state()
        from_snapshot = replay(self.url)
        assert from_snapshot == live
        assert from_snapshot.violations == []
        assert replay(self.url, from_snapshot=False) == live

    def teardown(self) -> None:
        try:
            self.persist()
            self.log.close(final_state=self.pool.snapshot())
            report = audit(self.url)
            assert {v.rule for v in report.violations} <= {"leaked_block"}
            assert report.leaked == dict(sorted(self.owners.items()))
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def test_allocator_and_log_follow_the_reference_model(migrated_db: Path) -> None:
    AllocatorMachine.template = migrated_db
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(
            max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
