"""Hugging Face folders (config.json + safetensors): our model against transformers on the same files.

Tiny random models of each supported variant, float32. ATOL covers summation-order
differences only; a wrong fusion, norm, bias or rope shows up as O(1e-1) errors.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice

ATOL = 1e-4


def reference_logits(folder, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at every position: [len(tokens), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def our_logits(runner, tokens: list[int], split: int) -> torch.Tensor:
    """Prefill ``tokens[:split]`` (logits at its last position), then decode the rest one by one."""
    block_ids = list(range(-(-len(tokens) // runner.block_size)))
    rows = [runner.forward(ForwardBatch.build([SeqSlice(tokens[:split], 0, block_ids)], runner.block_size))[0]]
    for pos in range(split, len(tokens)):
        batch = ForwardBatch.build([SeqSlice([tokens[pos]], pos, block_ids)], runner.block_size)
        rows.append(runner.forward(batch)[0])
    return torch.stack(rows)


TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


@pytest.mark.parametrize(
    ("model_type", "tie_word_embeddings"),
    [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)],
    ids=["llama", "llama-tied", "qwen2-qkv-bias", "qwen3-qk-norm"],
)
def test_logits_match_transformers(make_tiny_model_dir, tiny_runner_factory, model_type, tie_word_embeddings):
    folder = make_tiny_model_dir(model_type, tie_word_embeddings=tie_word_embeddings)
    runner = tiny_runner_factory(model=str(folder))
    expected = reference_logits(folder, TOKENS)[10 - 1 :]
    torch.testing.assert_close(our_logits(runner, TOKENS, split=10), expected, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers(make_tiny_model_dir, tiny_runner_factory):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
        "rope_theta": 10000.0,
    }
    folder = make_tiny_model_dir("llama", rope_parameters=rope)
    runner = tiny_runner_factory(model=str(folder))
    assert runner.model.config.rope_scaling["rope_type"] == "llama3"
    expected = reference_logits(folder, TOKENS)[-1:]
    torch.testing.assert_close(our_logits(runner, TOKENS, split=len(TOKENS)), expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir, tiny_runner_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).save_pretrained(
        sharded, max_shard_size="1MB"
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    single = our_logits(tiny_runner_factory(), TOKENS, split=len(TOKENS))
    torch.testing.assert_close(
        our_logits(tiny_runner_factory(model=str(sharded)), TOKENS, split=len(TOKENS)), single, atol=0, rtol=0
    )


def test_missing_tensor_is_named(tiny_model_dir, tiny_runner_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        tiny_runner_factory(model=str(broken))


def test_unsupported_architecture_is_named(tiny_model_dir, tiny_runner_factory, tmp_path):
    import json

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"architecture 'gpt2' .* is not one of"):
        tiny_runner_factory(model=str(other))


def test_sliding_window_caps_the_context(make_tiny_model_dir, tiny_runner_factory):
    folder = make_tiny_model_dir("qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=0)
    assert tiny_runner_factory(model=str(folder)).max_model_len == 256
