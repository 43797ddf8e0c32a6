"""KV cache sizing: bytes per block and blocks per memory budget."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model.kv_cache import KVCache, KVCacheSpec

SMOLLM2_BF16 = KVCacheSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    # 2 (K, V) * 30 layers * 16 tokens * 3 heads * 64 dims * 2 bytes
    assert SMOLLM2_BF16.bytes_per_block == 368_640


def test_num_blocks_for_budget_rounds_down():
    assert SMOLLM2_BF16.num_blocks_for(1 << 30) == 2912
    assert SMOLLM2_BF16.num_blocks_for(368_640 * 3 - 1) == 2


def test_num_blocks_for_budget_below_one_block_raises():
    with pytest.raises(ValueError, match="kv_cache_memory of 1000 bytes holds no block; one block needs 368640 bytes"):
        SMOLLM2_BF16.num_blocks_for(1000)


def test_cache_tensors_have_block_layout():
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=5, device=torch.device("cpu"))
    assert len(cache.key_caches) == len(cache.value_caches) == 2
    assert cache.key_caches[1].shape == (5, 4, 2, 8)
    assert cache.num_tokens == 20
    assert cache.num_bytes == 5 * 2 * 2 * 4 * 2 * 8 * 4


def test_cache_starts_as_zeros_in_separate_writable_tensors():
    spec = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    cache = KVCache(spec, num_blocks=3, device=torch.device("cpu"))
    tensors = cache.key_caches + cache.value_caches
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in tensors)
    tensors[1].fill_(1.0)  # layer 1's K: no other layer's K or V changes
    assert [int(t.sum()) for t in tensors] == [0, 3 * 4 * 2 * 8, 0, 0]
