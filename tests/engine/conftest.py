"""Engine fixtures: the tiny random-weight model (``make_tiny_model_dir`` in tests/conftest.py), the
real SmolLM2 loaded once."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# On a few shared cores, torch's default of one OpenMP thread per core stalls at every
# op's barrier whenever another process holds a core: the engine tests ran 3-4x slower
# with 2 threads than with 1 on the 2-core CI box. NANOSERVE_TEST_TORCH_THREADS overrides.
TEST_THREADS = int(os.environ.get("NANOSERVE_TEST_TORCH_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)

from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice  # noqa: E402


@pytest.fixture(scope="session")
def tiny_runner_factory(tiny_model_dir):
    """``make(**engine_kwargs) -> ModelRunner`` on the tiny model, float32 on CPU by default."""
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.model.model_runner import ModelRunner

    def make(**kwargs) -> ModelRunner:
        settings = {
            "model": str(tiny_model_dir),
            "dtype": "float32",
            "device": "cpu",
            "num_kv_blocks": 64,
            "block_size": 4,
            "num_threads": TEST_THREADS,  # a runner sizes the pool itself; keep the tests' choice
        }
        settings.update(kwargs)
        return ModelRunner(EngineConfig.from_kwargs(**settings))

    return make


@pytest.fixture(scope="session")
def real_runner():
    """The default SmolLM2-135M-Instruct GGUF in float32 on CPU, dequantized (the exact path), loaded once."""
    return make_real_runner(quantization="none", dtype="float32")


def make_real_runner(**kwargs):
    """A ModelRunner on the default GGUF, CPU, 512 blocks of 16, the tests' thread count; kwargs override."""
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.model.model_runner import ModelRunner

    settings = {"device": "cpu", "num_kv_blocks": 512, "block_size": 16, "num_threads": TEST_THREADS, **kwargs}
    return ModelRunner(EngineConfig.from_kwargs(**settings))


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


@pytest.fixture(scope="module")
def make_tiny_llm(tiny_model_dir):  # -> Iterator[Callable[..., LLM]]
    """``make(**kwargs) -> LLM`` on the tiny random model (float32, CPU, 64 blocks of 4; kwargs override);
    every LLM made is shut down after the module."""
    from nanoserve.engine.core.llm import LLM

    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4}
        llm = LLM(model=str(tiny_model_dir), **{**settings, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.shutdown()
