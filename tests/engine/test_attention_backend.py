"""Attention backend choice and the metadata each backend builds from a batch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from nanoserve.engine.attention import TorchAttentionBackend, select_backend
from nanoserve.engine.flash_attention import FlashAttentionBackend
from nanoserve.engine.forward_batch import ForwardBatch, SeqSlice


def mixed_batch() -> ForwardBatch:
    return ForwardBatch.build(
        [SeqSlice([1, 2, 3], 4, [5, 6]), SeqSlice([7], 9, [1, 2, 3]), SeqSlice([8, 9], 0, [4])], block_size=4
    )


def test_cpu_gets_torch_backend():
    backend, reason = select_backend(torch.device("cpu"), torch.bfloat16, 16)
    assert isinstance(backend, TorchAttentionBackend)
    assert reason == "device is cpu"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="checks the fallback")
def test_cuda_without_flash_attn_gets_torch_backend():
    backend, reason = select_backend(torch.device("cuda"), torch.bfloat16, 256)
    assert isinstance(backend, TorchAttentionBackend)
    assert reason.startswith("flash-attn not installed")


def test_torch_metadata_splits_decodes_from_prefills():
    metadata = TorchAttentionBackend().prepare(mixed_batch(), block_size=4)
    assert metadata.decode_token_indices.tolist() == [3]
    assert metadata.decode_block_tables.tolist() == [[1, 2, 3]]
    assert metadata.decode_mask[0, 0, 0].tolist() == [True] * 10 + [False] * 2
    assert [(p.token_start, p.token_end, p.context_len) for p in metadata.prefills] == [(0, 3, 7), (4, 6, 2)]
    assert metadata.prefills[0].block_ids.tolist() == [5, 6]
    # chunk at positions 4..6 sees keys 0..4, 0..5, 0..6
    assert metadata.prefills[0].mask.sum(dim=1).tolist() == [5, 6, 7]
    assert metadata.prefills[1].mask is None  # starts at 0: plain causal over its own keys


def test_torch_metadata_for_all_decodes_needs_no_row_index():
    batch = ForwardBatch.build([SeqSlice([1], 3, [0]), SeqSlice([2], 5, [1, 2])], block_size=4)
    metadata = TorchAttentionBackend().prepare(batch, block_size=4)
    assert metadata.decode_token_indices is None
    assert metadata.prefills == []


def test_flash_metadata_has_cumulative_lengths():
    metadata = FlashAttentionBackend().prepare(mixed_batch(), block_size=4)
    assert metadata.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert metadata.cu_seqlens_k.tolist() == [0, 7, 17, 19]
    assert (metadata.max_query_len, metadata.max_context_len) == (3, 10)
    assert metadata.cu_seqlens_q.dtype == torch.int32
