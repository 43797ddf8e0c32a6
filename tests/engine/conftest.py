"""Engine fixtures: a tiny random-weight model on disk, the real SmolLM2 loaded once.

``tiny_model_dir`` is a Hugging Face folder (config.json + model.safetensors +
the real SmolLM2 tokenizer + generation_config.json) holding a 2-layer Llama with
random weights and the real vocabulary size, written by transformers itself so
that loading it exercises our safetensors path. ``make_tiny_model_dir(model_type)``
builds the Qwen2 / Qwen3 variants the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# On a few shared cores, torch's default of one OpenMP thread per core stalls at every
# op's barrier whenever another process holds a core: the engine tests ran 3-4x slower
# with 2 threads than with 1 on the 2-core CI box. NANOSERVE_TEST_TORCH_THREADS overrides.
torch.set_num_threads(int(os.environ.get("NANOSERVE_TEST_TORCH_THREADS", "1")))

from nanoserve.engine.forward_batch import ForwardBatch, SeqSlice  # noqa: E402
from nanoserve.engine.weights import default_model_path  # noqa: E402

TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}


@pytest.fixture(scope="session")
def real_hf_tokenizer():
    """transformers' tokenizer rebuilt from the default GGUF (slow: build once)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="session")
def make_tiny_model_dir(tmp_path_factory, real_hf_tokenizer) -> Callable[..., Path]:
    """``make(model_type="llama", tie_word_embeddings=False, **overrides) -> folder``, cached per arguments."""
    import transformers

    built: dict[tuple, Path] = {}
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }

    def make(model_type: str = "llama", tie_word_embeddings: bool = False, **overrides) -> Path:
        key = (model_type, tie_word_embeddings, json.dumps(overrides, sort_keys=True))
        if key in built:
            return built[key]
        config_class, model_class = classes[model_type]
        dims = {**TINY_DIMS, **overrides}
        config = config_class(
            vocab_size=len(real_hf_tokenizer),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            **dims,
        )
        torch.manual_seed(0)
        model = model_class(config).eval()
        with torch.no_grad():  # norms start at 1; perturb them so a dropped weight shows
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.copy_(
                        1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param)
                    )
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
        model.save_pretrained(folder)
        real_hf_tokenizer.save_pretrained(folder)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
        built[key] = folder
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model_dir) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads, head_dim 16) with SmolLM2's tokenizer."""
    return make_tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_runner_factory(tiny_model_dir):
    """``make(**engine_kwargs) -> ModelRunner`` on the tiny model, float32 on CPU by default."""
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.model_runner import ModelRunner

    def make(**kwargs) -> ModelRunner:
        settings = {
            "model": str(tiny_model_dir),
            "dtype": "float32",
            "device": "cpu",
            "num_kv_blocks": 64,
            "block_size": 4,
        }
        settings.update(kwargs)
        return ModelRunner(EngineConfig.from_kwargs(**settings))

    return make


@pytest.fixture(scope="session")
def real_runner():
    """The default SmolLM2-135M-Instruct GGUF in float32 on CPU, loaded once per session."""
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.model_runner import ModelRunner

    return ModelRunner(EngineConfig.from_kwargs(dtype="float32", device="cpu", num_kv_blocks=512, block_size=16))


@pytest.fixture(scope="session")
def greedy():
    """``greedy(runner, prompts, max_new_tokens) -> (new_tokens, prefill_logits)``."""
    return greedy_generate


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy decoding of all prompts at once through ``runner.forward``.

    Each sequence gets its own contiguous run of blocks. Returns the new tokens per
    prompt and the prefill's last-position logits [num_prompts, vocab_size].
    """
    block_size = runner.block_size
    tables, next_block = [], 0
    for prompt in prompts:
        num_blocks = -(-(len(prompt) + max_new_tokens) // block_size)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    assert next_block <= runner.num_kv_blocks, "KV cache too small for this test"
    slices = [SeqSlice(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    prefill_logits = runner.forward(ForwardBatch.build(slices, block_size, runner.device))
    outputs = [[int(t)] for t in prefill_logits.argmax(-1)]
    for _ in range(max_new_tokens - 1):
        slices = [
            SeqSlice([out[-1]], len(p) + len(out) - 1, t, True)
            for p, out, t in zip(prompts, outputs, tables, strict=True)
        ]
        logits = runner.forward(ForwardBatch.build(slices, block_size, runner.device))
        for out, token in zip(outputs, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
    return outputs, prefill_logits
