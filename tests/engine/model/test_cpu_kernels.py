"""nanoserve's CPU kernels (paged decode attention, add + RMSNorm, silu * up, rope + K/V write)
against torch's ops, and the model's fused layer ops against its torch path.

Tolerances: both compute in float32 like the reference, in another order; ``ATOL`` on
outputs of magnitude about 1. The paged decode kernel computes its own exp: ``EXP_RTOL``
relative to float64 (measured 8.5e-8, under an ulp), and is checked against a float64
reference in both of its bodies (``isa`` avx2 and avx512, the latter where the CPU has
it). ``silu_and_mul`` computes its own exp: ``SILU_RTOL`` relative. ``rope_and_write_kv``
does torch's very operations: bit-equal here, allowed ``ROPE_ATOL`` (an ulp of values up
to 4) where a torch build rounds addcmul differently.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine.model import kernels, llama
from nanoserve.engine.model.attention import TorchAttentionBackend, select_backend, write_kv
from nanoserve.engine.model.cpu_paged_attention import CpuPagedAttentionBackend
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice
from nanoserve.engine.model.layers.rope import RotaryEmbedding, apply_rope

ATOL = 1e-5
SILU_RTOL = 1e-6  # measured: at most 3 ulp (3.4e-7) from torch's silu * up
ROPE_ATOL = 1e-6
EXP_RTOL = 1e-7
EXP_SUBNORMAL = -87.3366  # ln(2^-126): below, the kernel's exp returns 0 (torch's a subnormal)

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


def isa_params() -> list:
    """Both kernel bodies; avx512 skipped where the CPU lacks it."""
    no_avx512 = kernels.best_isa() != "avx512"
    return ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(no_avx512, reason="no AVX-512"))]


def reference_decode_f64(q, key_cache, value_cache, tables, lens, scale):
    """softmax(q k^T scale) v in float64 through each block table: [B, H * D] float64."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    out = []
    for b in range(num_seqs):
        keys = key_cache[tables[b].long()].flatten(0, 1)[: lens[b]].double()  # [L, Hkv, D]
        values = value_cache[tables[b].long()].flatten(0, 1)[: lens[b]].double()
        queries = q[b].double().view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
        probs = torch.softmax(torch.einsum("hgd,lhd->hgl", queries, keys) * scale, dim=-1)
        out.append(torch.einsum("hgl,lhd->hgd", probs, values).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (3, 3, 64), (6, 2, 128), (3, 3, 128), (6, 2, 40), (8, 1, 24), (7, 1, 64)],
)
def test_paged_decode_equals_float64_reference(isa, num_heads, num_kv_heads, head_dim):
    # group sizes 3, 1, 8 (passes 4 + 4 / 3 + 3 + 2) and 7; head_dim 40 and 24: a half vector at the end
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    block_size, num_blocks = 16, 64
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 15, 16, 17, 100, 33], dtype=torch.int32)  # ragged: tails of 1, 15, 0, 1, 4, 1 keys
    tables = torch.randperm(num_blocks, generator=gen)[:42].view(6, 7).to(torch.int32)
    q = torch.randn(6, num_heads, head_dim, generator=gen) * 3  # peaked softmaxes too
    scale = 1 / math.sqrt(head_dim)
    got = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, isa=isa)
    expected = reference_decode_f64(q, key_cache, value_cache, tables, lens, scale)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 40)])
def test_paged_decode_on_a_16_bit_cache_equals_float32_on_its_values(isa, dtype, num_heads, num_kv_heads, head_dim):
    # each element widened exactly as it is loaded: the float32 body's bits on the cache's values
    gen = torch.Generator().manual_seed(head_dim)
    key_cache = torch.randn(64, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(64, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 100, 33], dtype=torch.int32)
    tables = torch.randperm(64, generator=gen)[:42].view(6, 7).to(torch.int32)
    q = torch.randn(6, num_heads, head_dim, generator=gen) * 3
    got = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125, isa=isa)
    widened = kernels.paged_decode_attention(q, key_cache.float(), value_cache.float(), tables, lens, 0.125, isa=isa)
    assert torch.equal(got, widened)


def test_paged_decode_rejects_mixed_cache_dtypes():
    key_cache, q = torch.zeros(4, 4, 1, 8), torch.zeros(1, 1, 8)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must both be float32, float16 or bfloat16"):
        kernels.paged_decode_attention(q, key_cache, key_cache.half(), tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="must both be float32, float16 or bfloat16"):
        kernels.paged_decode_attention(q, key_cache.double(), key_cache.double(), tables, lens, 1.0)


def test_paged_decode_takes_a_strided_query_as_the_backend_passes_it():
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = torch.randn(8, 16, 3, 64, generator=gen), torch.randn(8, 16, 3, 64, generator=gen)
    qkv = torch.randn(2, 15 * 64, generator=gen)
    q = qkv.view(2, 15, 64)[:, :9]  # q of (Q | K | V) rows
    tables, lens = torch.tensor([[0, 1], [5, 6]], dtype=torch.int32), torch.tensor([20, 32], dtype=torch.int32)
    got = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125)
    expected = reference_decode_f64(q, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("isa", isa_params())
def test_attention_exp_is_within_an_ulp_down_to_the_subnormals(isa):
    x = torch.cat([torch.linspace(EXP_SUBNORMAL + 1e-4, 0, 400_001), torch.tensor([-1e-30, -0.5, -1.0])])
    got = kernels.attention_exp(x, isa=isa)
    torch.testing.assert_close(got.double(), torch.exp(x.double()), rtol=EXP_RTOL, atol=0)


@pytest.mark.parametrize("isa", isa_params())
def test_attention_exp_gives_one_at_the_maximum_and_zero_below_the_normals(isa):
    x = torch.tensor([0.0, -0.0, -87.34, -88.0, -103.0, -104.0, -1e4, -float("inf")])
    assert kernels.attention_exp(x, isa=isa).tolist() == [1.0, 1.0, 0, 0, 0, 0, 0, 0]


def test_attention_exp_rejects_positive_values():
    with pytest.raises(RuntimeError, match=r"x must be <= 0, got 0\.5"):
        kernels.attention_exp(torch.tensor([-1.0, 0.5]))


def test_paged_decode_rejects_an_unknown_isa():
    key_cache, q = torch.zeros(1, 4, 1, 8), torch.zeros(1, 1, 8)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"isa must be 0 \(best\), 1 \(avx2\) or 2 \(avx512\), got 3"):
        torch.ops.nanoserve.paged_decode_attention(q, key_cache, key_cache, tables, lens, 1.0, 3)


def test_paged_decode_rejects_what_it_cannot_read():
    key_cache = torch.zeros(4, 4, 1, 8)
    q, lens = torch.zeros(1, 1, 8), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        kernels.paged_decode_attention(q, key_cache, key_cache, torch.tensor([[0, 9]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match=r"context length 5 of sequence 0 outside 1\.\.4"):
        kernels.paged_decode_attention(q, key_cache, key_cache, torch.tensor([[0]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="q must be float32"):
        kernels.paged_decode_attention(
            q.bfloat16(), key_cache, key_cache, torch.tensor([[0, 1]], dtype=torch.int32), lens, 1.0
        )


def test_float32_cpu_models_get_the_kernel_backend_and_others_the_torch_one():
    backend, reason = select_backend(torch.device("cpu"), torch.float32, torch.float32, 16)
    assert isinstance(backend, CpuPagedAttentionBackend)
    assert reason == "float32 on the CPU: nanoserve's paged decode kernel (float32 cache, prefill by SDPA)"
    assert not backend.prefill_by_decode_kernel
    backend, reason = select_backend(torch.device("cpu"), torch.float32, torch.float16, 16, batch_invariant=True)
    assert isinstance(backend, CpuPagedAttentionBackend)
    assert backend.prefill_by_decode_kernel
    assert reason == "float32 on the CPU: nanoserve's paged decode kernel (float16 cache, prefill queries too)"
    backend, _ = select_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 16)
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


def test_a_verify_pass_attends_each_row_as_a_decode_at_its_own_position():
    # a prefill chunk by SDPA, a decode, and a 4-token verify pass at positions 6..9 (SeqSlice.as_decodes)
    batch = ForwardBatch.build(
        [
            SeqSlice([1, 2, 3], 4, [5, 6]),
            SeqSlice([7], 9, [1, 2, 3]),
            SeqSlice([8, 9, 10, 11], 6, [7, 8, 9], as_decodes=True),
        ],
        block_size=4,
    )
    metadata = CpuPagedAttentionBackend().prepare(batch, block_size=4)
    decodes = metadata.kernel_decodes
    assert decodes is not None
    assert decodes.token_indices.tolist() == [3, 4, 5, 6, 7]
    assert decodes.context_lens.tolist() == [10, 7, 8, 9, 10]  # each row sees the keys up to itself
    assert decodes.block_tables[:, :1].tolist() == [[1], [7], [7], [7], [7]]
    assert [(p.token_start, p.token_end, p.context_len) for p in metadata.prefills] == [(0, 3, 7)]
    assert not decodes.in_order


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


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("intermediate", [1536, 600, 13])  # 600: a partial 512-column chunk; 13: a partial vector
def test_silu_and_mul_equals_torchs_silu_times_up(num_tokens, intermediate):
    gen = torch.Generator().manual_seed(num_tokens * intermediate)
    gate_up = torch.randn(num_tokens, 2 * intermediate, generator=gen) * 6
    expected = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    got = kernels.silu_and_mul(gate_up)
    assert got.shape == (num_tokens, intermediate)
    torch.testing.assert_close(got, expected, rtol=SILU_RTOL, atol=0)


def test_silu_and_mul_keeps_its_accuracy_over_the_whole_exp_range():
    # exp(-x) from underflow (x = 120) through overflow (x < -88.72, silu = -0 as torch's)
    gate = torch.cat([torch.linspace(-120, 120, 200_001), torch.tensor([-88.72, -88.73, 0.0, -0.0])])
    got = kernels.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])
    torch.testing.assert_close(got[0], F.silu(gate), rtol=SILU_RTOL, atol=0)
    assert got[0, gate < -88.73].eq(0).all()


def test_silu_and_mul_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="float32 only"):
        kernels.silu_and_mul(torch.zeros(2, 8, dtype=torch.bfloat16))


def rope_reference(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads):
    """The model's torch path: apply_rope over Q and K, then write_kv. Returns q, k, v."""
    head_dim = key_cache.shape[3]
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    qk = apply_rope(heads[:, : num_heads + num_kv_heads], cos, sin)
    v = heads[:, num_heads + num_kv_heads :]
    write_kv(qk[:, num_heads:], v, key_cache, value_cache, slots)
    return qk[:, :num_heads], qk[:, num_heads:], v


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (6, 2, 20)])
def test_rope_and_write_kv_equals_apply_rope_then_write_kv(num_tokens, num_heads, num_kv_heads, head_dim):
    # head_dim 20: a half of 10, one vector and a scalar tail; slots scattered over 32 blocks of 4
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32, torch.device("cpu"))
    cos, sin = rope.lookup(torch.randint(0, 4096, (num_tokens,), generator=gen))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    slots = torch.randperm(128, generator=gen)[:num_tokens]
    key_cache = torch.randn(32, 4, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(32, 4, num_kv_heads, head_dim, generator=gen)
    ref_keys, ref_values = key_cache.clone(), value_cache.clone()
    q_ref, k_ref, v_ref = rope_reference(qkv.clone(), cos, sin, ref_keys, ref_values, slots, num_heads, num_kv_heads)

    q, k, v = kernels.rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
    assert (q.shape, k.shape, v.shape) == (q_ref.shape, k_ref.shape, v_ref.shape)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place
    torch.testing.assert_close(q, q_ref, rtol=0, atol=ROPE_ATOL)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=ROPE_ATOL)
    assert torch.equal(v, v_ref)
    torch.testing.assert_close(key_cache, ref_keys, rtol=0, atol=ROPE_ATOL)  # untouched slots: equal
    assert torch.equal(value_cache, ref_values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_and_write_kv_rounds_into_a_16_bit_cache_as_torchs_cast(dtype):
    gen = torch.Generator().manual_seed(7)
    rope = RotaryEmbedding(64, 4096, 10000.0, None, torch.float32, torch.device("cpu"))
    cos, sin = rope.lookup(torch.randint(0, 4096, (37,), generator=gen))
    qkv = torch.randn(37, 15 * 64, generator=gen) * 300  # float16's ulp at 256-512 is 0.25: rounding shows
    slots = torch.randperm(128, generator=gen)[:37]
    key_cache, value_cache = torch.zeros(32, 4, 3, 64, dtype=dtype), torch.zeros(32, 4, 3, 64, dtype=dtype)
    ref_keys, ref_values = key_cache.clone(), value_cache.clone()
    q_ref, k_ref, _ = rope_reference(qkv.clone(), cos, sin, ref_keys, ref_values, slots, 9, 3)

    q, k, v = kernels.rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, slots, 9, 3)
    assert q.dtype == k.dtype == v.dtype == torch.float32  # the step's own q, k, v stay float32
    torch.testing.assert_close(q, q_ref, rtol=0, atol=ROPE_ATOL * 300)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=ROPE_ATOL * 300)
    assert torch.equal(key_cache.view(-1, 3, 64)[slots], k.to(dtype))  # k rounded by torch's cast
    assert torch.equal(value_cache.view(-1, 3, 64)[slots], v.to(dtype))
    assert torch.equal(value_cache, ref_values)  # write_kv's cast: the same
    written = torch.zeros(128, dtype=torch.bool).index_fill_(0, slots, True)
    assert not key_cache.view(128, -1)[~written].any()  # nothing else written


def test_rope_and_write_kv_rejects_a_slot_outside_the_cache_before_writing():
    qkv, trig = torch.randn(2, 3 * 8), torch.ones(2, 8)
    key_cache, value_cache = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="slot 16 of token 1 outside the cache's 16 slots"):
        kernels.rope_and_write_kv(qkv, trig, trig, key_cache, value_cache, torch.tensor([3, 16]), 1, 1)
    assert torch.equal(qkv, before)
    assert not key_cache.any()
    assert not value_cache.any()


def run_steps(runner) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Logits of a prefill (odd T, scattered blocks), a mixed step, two decodes; then both caches."""
    gen = torch.Generator().manual_seed(5)
    a, b = (
        torch.randint(3, 49152, (10,), generator=gen).tolist(),
        torch.randint(3, 49152, (10,), generator=gen).tolist(),
    )
    table_a, table_b = [9, 3, 17, 40], [2, 31, 60]  # 12 tokens each: three blocks, block 40 unused
    steps = [
        [SeqSlice(a[:9], 0, table_a), SeqSlice(b[:6], 0, table_b, needs_logits=False)],
        [SeqSlice(a[9:], 9, table_a), SeqSlice(b[6:], 6, table_b)],
    ]
    logits = []
    for slices in steps:
        logits.append(runner.forward(ForwardBatch.build(slices, runner.block_size)))
    for step in range(2):
        tokens = logits[-1].argmax(dim=-1).tolist()
        slices = [SeqSlice([tokens[0]], 10 + step, table_a), SeqSlice([tokens[1]], 10 + step, table_b)]
        logits.append(runner.forward(ForwardBatch.build(slices, runner.block_size)))
    return logits, torch.stack(runner.kv_cache.key_caches), torch.stack(runner.kv_cache.value_caches)


def test_fused_layer_ops_equal_the_torch_path(tiny_runner_factory, monkeypatch):
    runner = tiny_runner_factory()
    fused_logits, fused_keys, fused_values = run_steps(runner)
    for cache in [*runner.kv_cache.key_caches, *runner.kv_cache.value_caches]:
        cache.zero_()
    monkeypatch.setattr(llama, "fused_ops_run", lambda x: False)
    torch_logits, torch_keys, torch_values = run_steps(runner)
    for fused, unfused in zip(fused_logits, torch_logits, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=0, atol=ATOL)
    # layer 0's K/V come before any silu: the same bits; later layers' within silu's ulps
    assert torch.equal(fused_keys[0], torch_keys[0])
    assert torch.equal(fused_values[0], torch_values[0])
    torch.testing.assert_close(fused_keys, torch_keys, rtol=0, atol=ATOL)
    torch.testing.assert_close(fused_values, torch_values, rtol=0, atol=ATOL)
    assert fused_keys.abs().sum(dim=(0, 3, 4)).nonzero()[:, 0].unique().tolist() == [2, 3, 9, 17, 31, 60]
