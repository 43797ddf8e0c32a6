"""The peer for benchmarks: transformers' LlamaForCausalLM holding our checkpoint's weights.

Built from ``nanoserve.engine.model.weights.load_checkpoint`` (the same dequantized
tensors the runner loads), so both sides of a benchmark run the same model
and transformers needs no GGUF support of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A transformers LlamaForCausalLM in eval mode on CPU with the checkpoint's weights."""
    import transformers

    from nanoserve.engine.model.weights import load_checkpoint

    checkpoint = load_checkpoint(model_path)
    arch = checkpoint.config
    if arch.rope_scaling is not None or arch.attention_bias or arch.qk_norm:
        raise ValueError(f"{model_path}: the transformers reference supports plain Llama only")
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(checkpoint.weights, strict=False)
    allowed_missing = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    if not set(missing) <= allowed_missing or unexpected:
        raise ValueError(f"{model_path}: weights missing {missing}, unexpected {unexpected}")
    if arch.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def hf_model_from_runner(runner, dtype: torch.dtype) -> torch.nn.Module:
    """The same checkpoint the runner serves."""
    from nanoserve.engine.model.weights import resolve_model_path

    return hf_model(resolve_model_path(runner.config.model.model), dtype)
