"""LLM: offline batch generation, the vLLM-style front door.

from nanoserve.engine import LLM, SamplingParams
llm = LLM(max_num_seqs=64)
outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].text)
"""

from __future__ import annotations

import atexit
import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import ChatPrompt, Prompt, TokensPrompt
from nanoserve.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from nanoserve.engine.core.llm_engine import LLMEngine


class LLM:
    """Runs batches of prompts to completion through one LLMEngine.

    model: a .gguf file or Hugging Face folder; None for the default
    SmolLM2-135M-Instruct. Other keywords are EngineConfig's flat names
    (block_size, num_kv_blocks, kv_cache_memory, max_num_seqs,
    max_num_batched_tokens, max_model_len, dtype, event_log_url, ...).
    With ``event_log_url`` the store is checked and migrated (unless
    ``event_log_migrate=False``) before the model loads, and a crashed epoch's
    requests are recovered: EventLogUnusableError when the store cannot be used.
    For OpenMP's bounded spin, call ``nanoserve.engine.model.threads.prefer_bounded_spin()``
    before importing torch (importing nanoserve sets no environment variable).

    The engine is shut down by ``shutdown`` (or leaving a ``with`` block),
    else at interpreter exit if it still lives, so a script that never closes
    it still closes its log's epoch (POOL_CLOSE) with every block freed. Not
    when the LLM is collected: a caller may keep using ``llm.engine``.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = build_engine(EngineConfig.from_kwargs(model=model, **config))
        self._counter = itertools.count()
        # a weak reference: the hook keeps neither the engine nor the LLM alive
        self._close_at_exit = functools.partial(_shutdown_if_alive, weakref.ref(self.engine))
        atexit.register(self._close_at_exit)

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
        """Aborts what is left and closes the engine's event log; a second call does nothing."""
        atexit.unregister(self._close_at_exit)
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _shutdown_if_alive(engine_ref: weakref.ref[LLMEngine]) -> None:
    """At interpreter exit: shuts the engine down unless it is gone (``LLMEngine.shutdown`` is idempotent)."""
    engine = engine_ref()
    if engine is not None:
        engine.shutdown()
