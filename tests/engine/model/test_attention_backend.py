"""Attention backend choice and the metadata each backend builds from a batch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nanoserve.engine.model.attention import TorchAttentionBackend, bucket_by_num_blocks, select_backend
from nanoserve.engine.model.flash_attention import FlashAttentionBackend
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice


def mixed_batch() -> ForwardBatch:
    return ForwardBatch.build(
        [SeqSlice([1, 2, 3], 4, [5, 6]), SeqSlice([7], 9, [1, 2, 3]), SeqSlice([8, 9], 0, [4])], block_size=4
    )


def test_cpu_gets_torch_backend():
    backend, reason = select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 16)
    assert isinstance(backend, TorchAttentionBackend)
    assert reason == "device is cpu"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="checks the fallback")
def test_cuda_without_flash_attn_gets_torch_backend():
    backend, reason = select_backend(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 256)
    assert isinstance(backend, TorchAttentionBackend)
    assert reason.startswith("flash-attn not installed")


def test_torch_metadata_splits_decodes_from_prefills():
    metadata = TorchAttentionBackend().prepare(mixed_batch(), block_size=4)
    [bucket] = metadata.decode_buckets
    assert bucket.token_indices.tolist() == [3]
    assert bucket.block_ids.tolist() == [1, 2, 3]
    assert bucket.mask is None  # one sequence: keys are cut to its context, nothing to mask
    assert bucket.num_keys == 10
    assert [(p.token_start, p.token_end, p.context_len) for p in metadata.prefills] == [(0, 3, 7), (4, 6, 2)]
    assert metadata.prefills[0].block_ids.tolist() == [5, 6]
    # chunk at positions 4..6 sees keys 0..4, 0..5, 0..6
    assert metadata.prefills[0].mask.sum(dim=1).tolist() == [5, 6, 7]
    assert metadata.prefills[1].mask is None  # starts at 0: plain causal over its own keys


def test_torch_metadata_buckets_decodes_by_context_length():
    # contexts 2, 40, 3, 38 tokens (1, 10, 1, 10 blocks): two buckets, short ones first
    slices = [
        SeqSlice([1], 1, [0]),
        SeqSlice([2], 39, list(range(10, 20))),
        SeqSlice([3], 2, [1]),
        SeqSlice([4], 37, list(range(20, 30))),
    ]
    metadata = TorchAttentionBackend().prepare(ForwardBatch.build(slices, block_size=4), block_size=4)
    assert [b.token_indices.tolist() for b in metadata.decode_buckets] == [[0, 2], [3, 1]]
    short, long = metadata.decode_buckets
    assert short.block_ids.tolist() == [0, 1]
    assert long.block_ids.tolist() == list(range(20, 30)) + list(range(10, 20))
    assert metadata.decode_buckets[0].mask[:, 0, 0].tolist() == [[True] * 2 + [False], [True] * 3]
    assert metadata.decode_buckets[1].mask[:, 0, 0].sum(dim=1).tolist() == [38, 40]
    assert metadata.prefills == []


def test_torch_metadata_omits_mask_when_every_context_fills_its_blocks():
    batch = ForwardBatch.build([SeqSlice([1], 3, [0]), SeqSlice([2], 3, [1])], block_size=4)
    [bucket] = TorchAttentionBackend().prepare(batch, block_size=4).decode_buckets
    assert bucket.mask is None


def test_decode_only_step_in_one_bucket_keeps_batch_order():
    # contexts 6, 3, 5 tokens: one bucket, rows in batch order, so its output needs no scatter
    slices = [SeqSlice([1], 5, [0, 1]), SeqSlice([2], 2, [2]), SeqSlice([3], 4, [3, 4])]
    metadata = TorchAttentionBackend().prepare(ForwardBatch.build(slices, block_size=4), block_size=4)
    [bucket] = metadata.decode_buckets
    assert metadata.decode_only_in_order
    assert bucket.token_indices.tolist() == [0, 1, 2]
    assert bucket.block_ids.tolist() == [0, 1, 2, 0, 3, 4]
    assert bucket.num_keys == 6
    assert bucket.mask[:, 0, 0].sum(dim=1).tolist() == [6, 3, 5]


def test_step_with_a_prefill_is_not_decode_only():
    assert not TorchAttentionBackend().prepare(mixed_batch(), block_size=4).decode_only_in_order


def test_single_decode_reads_keys_up_to_its_context_without_mask():
    batch = ForwardBatch.build([SeqSlice([1], 5, [7, 2])], block_size=4)
    metadata = TorchAttentionBackend().prepare(batch, block_size=4)
    [bucket] = metadata.decode_buckets
    assert (bucket.num_keys, bucket.mask, metadata.decode_only_in_order) == (6, None, True)


def test_bucketing_splits_at_distinct_block_counts_when_buckets_are_free():
    assert bucket_by_num_blocks([1, 1, 1, 1, 2, 2, 10, 10, 30], max_buckets=4, bucket_cost=0) == [4, 6, 8, 9]


def test_bucketing_keeps_one_bucket_when_a_split_costs_more_than_it_saves():
    assert bucket_by_num_blocks([1, 1, 1, 1, 2, 2, 10, 10, 30], max_buckets=4, bucket_cost=1000) == [9]


def test_bucketing_respects_max_buckets():
    # best 2-way split of [1, 1, 1, 1, 2, 2, 10, 10, 30]: [1..2] and [10, 10, 30] costs 6*2 + 3*30 = 102
    assert bucket_by_num_blocks([1, 1, 1, 1, 2, 2, 10, 10, 30], max_buckets=2, bucket_cost=0) == [6, 9]


def test_flash_metadata_has_cumulative_lengths():
    metadata = FlashAttentionBackend().prepare(mixed_batch(), block_size=4)
    assert metadata.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert metadata.cu_seqlens_k.tolist() == [0, 7, 17, 19]
    assert (metadata.max_query_len, metadata.max_context_len) == (3, 10)
    assert metadata.cu_seqlens_q.dtype == torch.int32
