"""Turning a prompt and its SamplingParams into a validated Request.

Pure: it reads the tokenizer and the engine's fixed limits, never the
scheduler, so AsyncLLMEngine runs it on the caller's thread and a bad request
fails there, before it is queued.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nanoserve.allocator import cdiv
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.prompts import ChatPrompt, Prompt, TokensPrompt
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine.tokenizer import Tokenizer


class InputProcessor:
    """Tokenizes prompts and checks requests against the model and the KV pool.

    Limits: prompt + max_tokens <= max_model_len, and <= the whole pool
    (num_blocks * block_size tokens), so that a request alone always fits and
    is never preempted forever. Every error names the field and both numbers.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, num_blocks: int, block_size: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Raises InvalidRequestError naming the field and the limit."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {request_id!r}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        num_prior_output_tokens = self.prior_output_tokens(prompt, len(prompt_token_ids))
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"token id {token_id} is not below vocab_size {self.vocab_size}"
                )
        return Request(
            request_id,
            prompt_token_ids,
            params,
            max_tokens=self.resolve_max_tokens(len(prompt_token_ids), params.max_tokens),
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            decoder=self.tokenizer,
            prompt=prompt_text,
            arrival_time=arrival_time,
            num_prior_output_tokens=num_prior_output_tokens,
        )

    def prior_output_tokens(self, prompt: Prompt, num_prompt_tokens: int) -> int:
        """A resumed TokensPrompt's count of already generated tokens (0 otherwise), checked."""
        if not isinstance(prompt, TokensPrompt):
            return 0
        num_prior = prompt.num_prior_output_tokens
        ok = isinstance(num_prior, int) and not isinstance(num_prior, bool) and 0 <= num_prior < num_prompt_tokens
        if not ok:
            raise InvalidRequestError(
                "num_prior_output_tokens",
                f"must be an integer in [0, {num_prompt_tokens}) (fewer than the prompt's tokens), got {num_prior!r}",
            )
        return num_prior

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); raises InvalidRequestError."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, TokensPrompt):
            token_ids = list(prompt.prompt_token_ids)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError("prompt_token_ids", f"token id {bad[0]!r} is not in [0, {self.vocab_size})")
            text = None
        elif isinstance(prompt, ChatPrompt):
            token_ids = self._apply_chat_template(prompt)
            text = None
        else:
            raise InvalidRequestError("prompt", f"must be str, TokensPrompt or ChatPrompt, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty (0 tokens)")
        return text, token_ids

    def _apply_chat_template(self, prompt: ChatPrompt) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise InvalidRequestError("messages", "the model has no chat template; send a plain prompt")
        if not prompt.messages:
            raise InvalidRequestError("messages", "is empty")
        for i, message in enumerate(prompt.messages):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise InvalidRequestError("messages", f"message {i} needs string 'role' and 'content'")
        return list(self.tokenizer.apply_chat_template(prompt.messages))

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """max_tokens checked against max_model_len and the pool; None -> all that fits."""
        pool_tokens = self.num_blocks * self.block_size
        if max_tokens is None:
            limit = min(self.max_model_len, pool_tokens)
            max_tokens = limit - num_prompt_tokens
            if max_tokens < 1:
                raise InvalidRequestError(
                    "prompt",
                    f"prompt has {num_prompt_tokens} tokens; at most {limit - 1} leave room for one generated "
                    f"token (max_model_len {self.max_model_len}, KV pool {pool_tokens} tokens)",
                )
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})",
            )
        if total > pool_tokens:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"needs {cdiv(total, self.block_size)} KV blocks; the whole pool holds {self.num_blocks} "
                f"blocks ({pool_tokens} tokens)",
            )
        return max_tokens
