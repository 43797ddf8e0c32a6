"""The serving engine: scheduler, sampler, detokenizer and model runner.

    from nanoserve.engine import LLM, SamplingParams

Heavy modules (torch, the model runner) load on first use of a name, so that
``import nanoserve.engine.errors`` or ``.config`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nanoserve.engine.threads import prefer_bounded_spin

# Threads that spin briefly, then sleep (see nanoserve.engine.threads): effective before torch starts its pool.
prefer_bounded_spin()

if TYPE_CHECKING:
    from nanoserve.engine.async_llm_engine import AsyncLLMEngine, RequestStream
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.llm import LLM
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
    from nanoserve.engine.prompts import ChatPrompt, TokensPrompt
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.engine.status import ModelInfo, PoolStatus

_EXPORTS = {
    "AsyncLLMEngine": "async_llm_engine",
    "ChatPrompt": "prompts",
    "CompletionOutput": "outputs",
    "EngineConfig": "config",
    "LLM": "llm",
    "LLMEngine": "llm_engine",
    "PoolStatus": "status",
    "ModelInfo": "status",
    "AbortCause": "outputs",
    "RequestStream": "async_llm_engine",
    "RequestMetrics": "outputs",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "TokenLogprob": "outputs",
    "TokensPrompt": "prompts",
}

__all__ = [  # the names of _EXPORTS, spelled out so that linters and type checkers see them
    "LLM",
    "AsyncLLMEngine",
    "ChatPrompt",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ModelInfo",
    "AbortCause",
    "RequestStream",
    "PoolStatus",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "TokensPrompt",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanoserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanoserve.engine.{_EXPORTS[name]}"), name)
