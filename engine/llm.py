"""LLM: offline batch generation, the vLLM-style front door.

from nanoserve.engine import LLM, SamplingParams
llm = LLM(max_num_seqs=64)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import AbortCause, RequestOutput
from nanoserve.engine.prompts import ChatPrompt, Prompt, TokensPrompt
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.tokenizer import Tokenizer


class LLM:
    """Runs batches of prompts to completion through one LLMEngine.

    model: a .gguf file or Hugging Face folder; None for the default
    SmolLM2-135M-Instruct. Other keywords are EngineConfig's flat names
    (block_size, num_kv_blocks, kv_cache_memory, max_num_seqs,
    max_num_batched_tokens, max_model_len, dtype, event_log_url, ...).
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self._counter = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one finished output per prompt, in order.

        sampling_params: one for all prompts, or a list with one per prompt.
        Raises InvalidRequestError (nothing is left queued) on a bad request.
        """
        if isinstance(prompts, (str, TokensPrompt, ChatPrompt)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = [f"llm-{next(self._counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, params in zip(request_ids, prompts, params_list, strict=True):
                self.engine.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort(request_id, AbortCause.CALLER)
            self.engine.step()  # hand out the aborts' final outputs, so the next call starts clean
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            from nanoserve.engine.errors import InvalidRequestError

            raise InvalidRequestError(
                "sampling_params", f"got {len(params_list)} for {num_prompts} prompts (give one, or one per prompt)"
            )
        return params_list

    def shutdown(self) -> None:
        """Closes the engine's event log."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
