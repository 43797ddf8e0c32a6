"""The serving engine: scheduler, sampler, detokenizer and model runner.

    from nanoserve.engine import LLM, SamplingParams

Heavy modules (torch, the model runner) load on first use of a name, so that
``import nanoserve.engine.errors`` or ``.config`` stays cheap. Importing changes no environment
variable: the thread wait policy (``prefer_bounded_spin``) is set by the entry points, the CLI's
``main`` and ``LLM(...)``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.core.async_llm_engine import AsyncLLMEngine, RequestStream
    from nanoserve.engine.core.llm import LLM
    from nanoserve.engine.core.llm_engine import LLMEngine
    from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
    from nanoserve.engine.core.status import ModelInfo, PoolStatus
    from nanoserve.engine.sampling.params import SamplingParams
    from nanoserve.engine.text.prompts import ChatPrompt, TokensPrompt

_EXPORTS = {
    "AsyncLLMEngine": "core.async_llm_engine",
    "ChatPrompt": "text.prompts",
    "CompletionOutput": "core.outputs",
    "EngineConfig": "config",
    "LLM": "core.llm",
    "LLMEngine": "core.llm_engine",
    "PoolStatus": "core.status",
    "ModelInfo": "core.status",
    "AbortCause": "core.outputs",
    "RequestStream": "core.async_llm_engine",
    "RequestMetrics": "core.outputs",
    "RequestOutput": "core.outputs",
    "SamplingParams": "sampling.params",
    "TokenLogprob": "core.outputs",
    "TokensPrompt": "text.prompts",
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
