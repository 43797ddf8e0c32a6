"""ModelRunner start-up: KV cache sizing, limits, and what it exposes."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice

# tiny model: 2 layers, 2 KV heads, head_dim 16; block_size 4; float32
TINY_BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4


def test_num_kv_blocks_from_memory_budget(tiny_runner_factory):
    runner = tiny_runner_factory(num_kv_blocks=None, kv_cache_memory=TINY_BYTES_PER_BLOCK * 10 + 5)
    assert runner.num_kv_blocks == 10
    assert runner.kv_cache.key_caches[0].shape == (10, 4, 2, 16)


def test_num_kv_blocks_given_wins_over_budget(tiny_runner_factory):
    runner = tiny_runner_factory(num_kv_blocks=7, kv_cache_memory=TINY_BYTES_PER_BLOCK * 100)
    assert runner.num_kv_blocks == 7


def test_budget_below_one_block_is_rejected(tiny_runner_factory):
    with pytest.raises(ValueError, match="kv_cache_memory of 100 bytes holds no block"):
        tiny_runner_factory(num_kv_blocks=None, kv_cache_memory=100)


def test_max_model_len_beyond_context_is_rejected(tiny_runner_factory):
    with pytest.raises(ValueError, match="max_model_len must be <= the model's context length 1024, got 4096"):
        tiny_runner_factory(max_model_len=4096)


def test_runner_exposes_model_facts(tiny_runner_factory, tiny_model_dir):
    runner = tiny_runner_factory(max_model_len=256)
    assert runner.max_model_len == 256
    assert runner.vocab_size == 49152
    assert runner.block_size == 4
    assert runner.dtype == torch.float32
    assert runner.model_name == tiny_model_dir.name
    assert runner.tokenizer.vocab_size == 49152


def test_forward_returns_float32_logits_for_requested_rows(tiny_runner_factory):
    runner = tiny_runner_factory(dtype="bfloat16")
    batch = ForwardBatch.build(
        [SeqSlice([5, 6, 7], 0, [0], needs_logits=False), SeqSlice([8, 9], 0, [1]), SeqSlice([10], 0, [2])], 4
    )
    logits = runner.forward(batch)
    assert logits.shape == (2, 49152)
    assert logits.dtype == torch.float32


def test_forward_writes_kv_into_the_mapped_slots_only(tiny_runner_factory):
    runner = tiny_runner_factory()
    runner.forward(ForwardBatch.build([SeqSlice([5, 6, 7, 8, 9], 0, [3, 1])], 4))
    written = runner.kv_cache.key_caches[0].abs().sum(dim=(2, 3)) != 0  # [num_blocks, block_size]
    assert written.nonzero().tolist() == [[1, 0], [3, 0], [3, 1], [3, 2], [3, 3]]


def test_forward_without_logits_requested_returns_empty_rows(tiny_runner_factory):
    runner = tiny_runner_factory()
    logits = runner.forward(ForwardBatch.build([SeqSlice([5, 6, 7], 0, [0], needs_logits=False)], 4))
    assert logits.shape == (0, 49152)


def test_start_up_log_reports_blocks_tokens_and_bytes(tiny_runner_factory):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        tiny_runner_factory(num_kv_blocks=10)
    ready = next(entry for entry in logs if entry["event"] == "model_runner.ready")
    assert (ready["num_kv_blocks"], ready["num_kv_tokens"], ready["kv_cache_bytes"]) == (
        10,
        40,
        10 * TINY_BYTES_PER_BLOCK,
    )
    from nanoserve.engine.model import kernels

    if kernels.load():  # float32 on the CPU
        assert ready["attention_backend"] == "cpu-paged"
        assert (
            ready["attention_backend_reason"]
            == "float32 on the CPU: nanoserve's paged decode kernel (float32 cache, prefill by SDPA)"
        )
        # the tiny model's float weights run on torch's dense matmuls: batch_invariant auto is off, no guarantee
        assert ready["batch_invariance"] == (
            "none: not every linear runs on nanoserve's GGUF kernel by its int16 arithmetic"
        )
    else:
        assert ready["attention_backend"] == "torch-sdpa"
        assert ready["attention_backend_reason"] == "device is cpu"
    assert ready["kv_cache_dtype"] == "float32"  # auto: the model's, a float checkpoint
