"""BlockTable: logical positions to physical blocks and flat slots."""

from __future__ import annotations

import pytest

from nanoserve.allocator import BlockAllocator, BlockTable, FreeReason, KVCacheExhausted


@pytest.fixture
def pool() -> BlockAllocator:
    return BlockAllocator(num_blocks=6, block_size=16)


def test_append_tokens_reserves_ceil_blocks(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    assert table.append_tokens(40) == [0, 1, 2]
    assert (table.block_ids, table.num_tokens) == ([0, 1, 2], 40)


def test_append_tokens_fills_last_block_before_taking_new(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(10)
    assert table.append_tokens(6) == []
    assert table.append_tokens(1) == [1]
    assert (table.block_ids, table.num_tokens) == ([0, 1], 17)


def test_blocks_needed_counts_only_new_blocks(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(20)
    assert [table.blocks_needed(n) for n in (0, 12, 13, 44, 45)] == [0, 0, 1, 2, 3]


def test_physical_of_position_17_is_offset_1_of_second_block(pool: BlockAllocator) -> None:
    pool.allocate("other")
    table = BlockTable(pool, "A")
    table.append_tokens(20)
    assert table.block_ids == [1, 2]
    assert table.physical(17) == (2, 1)
    assert table.physical(0) == (1, 0)


def test_physical_outside_table_is_refused(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(20)
    with pytest.raises(ValueError, match=r"position must be in \[0, 20\), got 20"):
        table.physical(20)


def test_slot_mapping_gives_flat_slots(pool: BlockAllocator) -> None:
    pool.allocate_for(40, "A")
    pool.free_all([0, 1, 2])
    table = BlockTable(pool, "B")
    table.append_tokens(20)
    assert table.block_ids == [2, 1]
    assert table.slot_mapping([0, 15, 16, 19]) == [32, 47, 16, 19]


def test_slot_mapping_names_bad_position(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(3)
    with pytest.raises(ValueError, match=r"position must be in \[0, 3\), got -1"):
        table.slot_mapping([0, -1])


def test_append_tokens_exhausted_changes_nothing(pool: BlockAllocator) -> None:
    pool.allocate_for(80, "other")
    table = BlockTable(pool, "A")
    table.append_tokens(10)
    with pytest.raises(KVCacheExhausted) as info:
        table.append_tokens(7)
    assert (info.value.requested, info.value.available) == (1, 0)
    assert (table.block_ids, table.num_tokens) == ([5], 10)


def test_can_append_matches_free_blocks(pool: BlockAllocator) -> None:
    pool.allocate_for(64, "other")
    table = BlockTable(pool, "A")
    assert table.can_append(32)
    assert not table.can_append(33)


def test_release_frees_all_blocks_and_empties_table(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(40)
    table.release(FreeReason.FINISHED)
    assert (table.block_ids, table.num_tokens, pool.num_free) == ([], 0, 6)
    assert pool.allocate("B") == 2


def test_truncate_frees_the_blocks_past_the_kept_tokens_with_the_reason(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(30)  # blocks 0, 1
    table.append_tokens(20)  # speculative room: blocks 2, 3 (50 tokens)
    pool.take_events()
    assert table.truncate(17, FreeReason.REJECTED_DRAFT) == [2, 3]
    assert (table.block_ids, table.num_tokens) == ([0, 1], 17)
    [event] = pool.take_events()
    assert (event.kind, event.block_ids, event.owner, event.reason) == ("free_all", (2, 3), "A", "rejected_draft")
    assert pool.num_free == 4
    assert table.append_tokens(15) == []  # the kept block's free slots are reused first
    assert table.append_tokens(1) == [3]  # LIFO: the last block freed comes back first


def test_truncate_within_the_last_block_frees_nothing(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(20)
    pool.take_events()
    assert table.truncate(17, FreeReason.REJECTED_DRAFT) == []
    assert (table.block_ids, table.num_tokens) == ([0, 1], 17)
    assert pool.take_events() == []


def test_truncate_beyond_the_table_is_refused(pool: BlockAllocator) -> None:
    table = BlockTable(pool, "A")
    table.append_tokens(5)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, 5\], got 6"):
        table.truncate(6)
