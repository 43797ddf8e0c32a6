"""A KV cache narrower than the model (``kv_cache_dtype`` float16 / bfloat16 under a float32 model).

K and V are rounded once, as they are written (torch's cast: nearest, ties to even), and
every attention reads the rounded values: decode through the paged kernel or the torch
backend, and prefill too (over the chunk's own K/V rounded alike), so a prompt's
attention does not depend on whether its keys came from this step, the cache, a
prefix-cache hit or a recompute after preemption. A block costs half the bytes: twice
the tokens in the same ``kv_cache_memory``.

On the default model (its Q4_1 GGUF on nanoserve's kernels), against a float32 cache,
measured on Zen 5: perplexity of ``PARAGRAPH`` 34.027 with float16 (-0.07%), 34.056 with
bfloat16 (+0.02%), 34.050 float32; decode-step logits within 7.0e-3 (float16) and 1.7e-2
(bfloat16) of the logits' scale; greedy picks equal over 24 steps of 4 prompts, but for
float16 one near tie (a margin of 0.0065 logits). On an AMX CPU (its tiles multiply the
prefill): 34.058 float16, 34.163 bfloat16, 34.116 float32; logits within 8.8e-3 and 1.5e-2;
bfloat16 two near ties (margins 0.11 and 0.05), float16 none.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.config import CacheConfig
from nanoserve.engine.model import kernels, llama
from nanoserve.engine.model.attention import TorchAttentionBackend, write_kv
from nanoserve.engine.model.device import resolve_kv_cache_dtype
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice

NEAR_TIE = 0.25  # logits
PPL_RTOL = 0.005
LOGIT_RTOL = {"float16": 1.5e-2, "bfloat16": 4e-2}  # of the logits' scale; measured 7.0e-3 and 1.7e-2


def test_auto_is_the_models_dtype_but_float16_on_the_gguf_kernels():
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu_quantized_kernels=True) == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, cpu_quantized_kernels=True) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, cpu_quantized_kernels=True) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("fp8", torch.float32)


def test_config_refuses_an_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\)"):
        CacheConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_holds_twice_the_blocks_in_the_same_memory(tiny_runner_factory, dtype):
    wide = tiny_runner_factory(num_kv_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype="float32")
    narrow = tiny_runner_factory(num_kv_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype=dtype)
    assert narrow.kv_cache.key_caches[0].dtype == getattr(torch, dtype)
    assert narrow.kv_cache.spec.bytes_per_block * 2 == wide.kv_cache.spec.bytes_per_block
    assert narrow.num_kv_blocks == 2 * wide.num_kv_blocks
    assert narrow.kv_cache_dtype == getattr(torch, dtype)


def _prefill_batch(block_size: int) -> ForwardBatch:
    # a fresh 7-token prompt (attended over its own K/V) and a 3-token continuation after 5 cached tokens
    return ForwardBatch.build([SeqSlice(list(range(7)), 0, [3, 0]), SeqSlice([1, 2, 3], 5, [6, 2])], block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_attends_over_the_values_the_cache_holds(dtype):
    gen = torch.Generator().manual_seed(1)
    batch = _prefill_batch(block_size=4)
    q = torch.randn(10, 6, 16, generator=gen)
    k, v = torch.randn(10, 2, 16, generator=gen), torch.randn(10, 2, 16, generator=gen)
    earlier_k, earlier_v = torch.randn(8, 4, 2, 16, generator=gen), torch.randn(8, 4, 2, 16, generator=gen)
    backend = TorchAttentionBackend()
    narrow = earlier_k.to(dtype), earlier_v.to(dtype)
    wide = narrow[0].float(), narrow[1].float()  # the same values in a float32 cache
    metadata = backend.prepare(batch, block_size=4)
    write_kv(k, v, *narrow, metadata.slot_mapping)
    rounded_k, rounded_v = k.to(dtype).float(), v.to(dtype).float()
    write_kv(rounded_k, rounded_v, *wide, metadata.slot_mapping)
    got = backend.forward(q, k, v, *narrow, metadata)
    assert torch.equal(got, backend.forward(q, rounded_k, rounded_v, *wide, metadata))
    assert not torch.equal(got, backend.forward(q, k, v, *[c.clone() for c in wide], metadata))  # rounding shows


@pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_kernels_and_the_torch_path_agree_on_a_16_bit_cache(tiny_runner_factory, monkeypatch, dtype):
    from tests.engine.model.test_cpu_kernels import ATOL, run_steps

    runner = tiny_runner_factory(kv_cache_dtype=dtype)
    assert runner.attention.name == "cpu-paged"
    fused_logits, fused_keys, fused_values = run_steps(runner)
    assert fused_keys.dtype == getattr(torch, dtype)
    for cache in [*runner.kv_cache.key_caches, *runner.kv_cache.value_caches]:
        cache.zero_()
    monkeypatch.setattr(llama, "fused_ops_run", lambda x: False)  # torch's rope, write_kv's cast
    torch_logits, torch_keys, torch_values = run_steps(runner)
    for fused, unfused in zip(fused_logits, torch_logits, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=0, atol=ATOL)
    assert torch.equal(fused_keys[0], torch_keys[0])  # layer 0: the same float32 K rounded the same way
    assert torch.equal(fused_values[0], torch_values[0])


@pytest.mark.real_model
@pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_model_with_a_16_bit_cache_keeps_its_greedy_tokens_and_perplexity(dtype):
    from tests.engine.conftest import make_real_runner
    from tests.engine.model.test_quantized_model import PARAGRAPH, PROMPTS, perplexity

    wide = make_real_runner(quantization="auto", dtype="float32", kv_cache_dtype="float32")
    narrow = make_real_runner(quantization="auto", dtype="float32", kv_cache_dtype=dtype)
    assert narrow.kv_cache.key_caches[0].dtype == getattr(torch, dtype)
    token_ids = wide.tokenizer.encode(PARAGRAPH)
    ppl_wide, ppl_narrow = perplexity(wide, token_ids), perplexity(narrow, token_ids)
    print(f"perplexity float32 cache {ppl_wide:.3f}, {dtype} cache {ppl_narrow:.3f}")
    assert abs(ppl_narrow - ppl_wide) / ppl_wide < PPL_RTOL
    differing, largest = [], 0.0
    for text in PROMPTS:
        token_ids = wide.tokenizer.encode(text)
        for step in range(24):  # the prompt's prefill, then one-token decode steps fed the float32 cache's picks
            new, start = (token_ids, 0) if step == 0 else (token_ids[-1:], len(token_ids) - 1)
            batch = ForwardBatch.build([SeqSlice(new, start, list(range(4)))], 16, wide.device)
            want, got = wide.forward(batch)[-1], narrow.forward(batch)[-1]  # [vocab] each
            largest = max(largest, ((got - want).abs().max() / want.abs().max()).item())
            if got.argmax() != want.argmax():
                differing.append((text, step, float(want.max() - want[got.argmax()])))
            token_ids.append(int(want.argmax()))
    print(f"largest logit difference {largest:.2e} of the logits' scale; picks that differ: {differing}")
    assert largest < LOGIT_RTOL[dtype]
    assert all(margin < NEAR_TIE for *_, margin in differing), differing
    assert len(differing) <= 2, differing  # near ties are rare: two of 96 picks at most
