"""ForwardBatch.build packs sequences back to back with exact positions, slots and tables."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice


def test_build_packs_prefill_chunk_and_decode():
    batch = ForwardBatch.build(
        [
            SeqSlice(token_ids=[11, 12, 13], start_position=2, block_ids=[7, 3], needs_logits=True),
            SeqSlice(token_ids=[21], start_position=5, block_ids=[0, 9], needs_logits=True),
        ],
        block_size=4,
        device="cpu",
    )
    assert batch.input_ids.tolist() == [11, 12, 13, 21]
    assert batch.positions.tolist() == [2, 3, 4, 5]
    # positions 2, 3 -> block 7 offsets 2, 3; position 4 -> block 3 offset 0; position 5 -> block 9 offset 1
    assert batch.slot_mapping.tolist() == [30, 31, 12, 37]
    assert batch.query_lens == [3, 1]
    assert batch.context_lens == [5, 6]
    assert batch.start_positions == [2, 5]
    assert batch.block_tables.tolist() == [[7, 3], [0, 9]]
    assert batch.logits_indices.tolist() == [2, 3]


def test_build_skips_logits_of_unfinished_prefill_chunk():
    batch = ForwardBatch.build(
        [SeqSlice([1, 2], 0, [4], needs_logits=False), SeqSlice([3], 0, [5], needs_logits=True)], block_size=4
    )
    assert batch.logits_indices.tolist() == [2]


def test_build_pads_block_tables_with_zero():
    batch = ForwardBatch.build([SeqSlice([1], 0, [6]), SeqSlice([2], 8, [1, 2, 3])], block_size=4)
    assert batch.block_tables.tolist() == [[6, 0, 0], [1, 2, 3]]


def test_build_dtypes_follow_contract():
    batch = ForwardBatch.build([SeqSlice([1, 2], 0, [0])], block_size=4)
    assert batch.input_ids.dtype == torch.int64
    assert batch.positions.dtype == torch.int64
    assert batch.slot_mapping.dtype == torch.int64
    assert batch.block_tables.dtype == torch.int32
    assert batch.logits_indices.dtype == torch.int64


def test_build_rejects_block_table_too_small():
    with pytest.raises(ValueError, match=r"seqs\[0\].block_ids holds 1 blocks, 2 needed for 5 tokens"):
        ForwardBatch.build([SeqSlice([1, 2], 3, [0])], block_size=4)


def test_build_rejects_empty_token_ids():
    with pytest.raises(ValueError, match=r"seqs\[1\].token_ids must not be empty"):
        ForwardBatch.build([SeqSlice([1], 0, [0]), SeqSlice([], 0, [1])], block_size=4)


def test_build_rejects_empty_batch():
    with pytest.raises(ValueError, match="at least one sequence"):
        ForwardBatch.build([], block_size=4)
