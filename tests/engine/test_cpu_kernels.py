"""nanoserve's paged decode attention and fused add + RMSNorm kernels against torch's ops.

Tolerances: both compute in float32 like the reference, in another order; ``ATOL`` on
outputs of magnitude about 1.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine import kernels
from nanoserve.engine.attention import CpuPagedAttentionBackend, TorchAttentionBackend, select_backend
from nanoserve.engine.forward_batch import ForwardBatch, SeqSlice

ATOL = 1e-5

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")


def reference_decode(q, key_cache, value_cache, tables, lens, scale):
    """SDPA over each sequence's gathered keys: [B, H * D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = []
    for b in range(num_seqs):
        keys = key_cache[tables[b].long()].flatten(0, 1)[: lens[b]].transpose(0, 1)  # [Hkv, L, D]
        values = value_cache[tables[b].long()].flatten(0, 1)[: lens[b]].transpose(0, 1)
        queries = q[b].view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        out.append(F.scaled_dot_product_attention(queries, keys, values, scale=scale).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 32)])
def test_paged_decode_equals_sdpa_over_gathered_blocks(num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks = 4, 40
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 4, 5, 17, 30], dtype=torch.int32)  # one key, full blocks, partial blocks
    tables = torch.randperm(num_blocks, generator=gen)[:40].view(5, 8).to(torch.int32)  # scattered, disjoint
    q = torch.randn(5, num_heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    got = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    assert got.shape == (5, num_heads * head_dim)
    torch.testing.assert_close(got, reference_decode(q, key_cache, value_cache, tables, lens, scale), rtol=0, atol=ATOL)


def test_paged_decode_rejects_what_it_cannot_read():
    key_cache = torch.zeros(4, 4, 1, 8)
    q, lens = torch.zeros(1, 1, 8), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        kernels.paged_decode_attention(q, key_cache, key_cache, torch.tensor([[0, 9]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match=r"context length 5 of sequence 0 outside 1\.\.4"):
        kernels.paged_decode_attention(q, key_cache, key_cache, torch.tensor([[0]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.paged_decode_attention(
            q.bfloat16(), key_cache, key_cache, torch.tensor([[0, 1]], dtype=torch.int32), lens, 1.0
        )


def test_float32_cpu_models_get_the_kernel_backend_and_others_the_torch_one():
    backend, reason = select_backend(torch.device("cpu"), torch.float32, 16)
    assert isinstance(backend, CpuPagedAttentionBackend)
    assert reason == "float32 on the CPU: nanoserve's paged decode kernel"
    backend, _ = select_backend(torch.device("cpu"), torch.bfloat16, 16)
    assert type(backend) is TorchAttentionBackend


def test_kernel_backend_sends_decodes_to_the_kernel_and_prefills_to_sdpa():
    batch = ForwardBatch.build(
        [SeqSlice([1, 2, 3], 4, [5, 6]), SeqSlice([7], 9, [1, 2, 3]), SeqSlice([8], 2, [4])], block_size=4
    )
    metadata = CpuPagedAttentionBackend().prepare(batch, block_size=4)
    decodes = metadata.kernel_decodes
    assert decodes is not None
    assert decodes.token_indices.tolist() == [3, 4]  # rows of the two decodes in the packed batch
    assert decodes.context_lens.tolist() == [10, 3]
    assert decodes.block_tables.dtype == torch.int32
    assert decodes.block_tables[:, :1].tolist() == [[1], [4]]
    assert not decodes.in_order
    assert [(p.token_start, p.token_end, p.context_len) for p in metadata.prefills] == [(0, 3, 7)]
    assert metadata.decode_buckets == []


def test_add_rms_norm_equals_torchs_add_then_rms_norm():
    gen = torch.Generator().manual_seed(0)
    hidden, delta = torch.randn(7, 576, generator=gen), torch.randn(7, 576, generator=gen)
    weight = torch.rand(576, generator=gen) + 0.5
    residual, normed = kernels.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(residual, hidden + delta)
    torch.testing.assert_close(normed, F.rms_norm(hidden + delta, (576,), weight, 1e-5), rtol=0, atol=ATOL)
    alone, normed_alone = kernels.add_rms_norm(hidden, None, weight, 1e-5)
    assert torch.equal(alone, hidden)
    torch.testing.assert_close(normed_alone, F.rms_norm(hidden, (576,), weight, 1e-5), rtol=0, atol=ATOL)
