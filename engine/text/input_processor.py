"""Turning a prompt and its SamplingParams into a validated Request.

Pure: it reads the tokenizer and the engine's fixed limits (``ModelInfo``),
never the scheduler, so AsyncLLMEngine runs it on its tokenizer thread and a
bad request fails there, before it is queued, without holding up the event
loop.

Every check of a request's content lives here or in ``SamplingParams``; the
service only checks the shape of its protobuf message. The work is bounded
before it starts: a text that cannot fit in ``max_model_len`` tokens whatever
the tokenizer does with it is refused from its length alone, so a megabyte
prompt costs a length check, not a tokenization.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nanoserve.allocator import cdiv
from nanoserve.engine.core.request import Request
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import ChatPrompt, Prompt, TokensPrompt
from nanoserve.engine.text.stored_text import check_stored_text

if TYPE_CHECKING:
    from nanoserve.engine.core.status import ModelInfo
    from nanoserve.engine.text.tokenizer import Tokenizer

CHAT_ROLES = ("system", "user", "assistant")
MAX_REQUEST_ID_CHARS = 128
# a text prompt longer than this many characters per allowed token is tokenized a prefix first
PREFIX_CHARS_PER_TOKEN = 8
# tokens a prefix may differ by from the same words in the whole text (the cut, merges across it)
PREFIX_MARGIN_TOKENS = 16


class InputProcessor:
    """Tokenizes prompts and checks requests against the model and the KV pool.

    Limits: prompt + max_tokens <= max_model_len, and <= the whole pool
    (num_blocks * block_size tokens), so that a request alone always fits and
    is never preempted forever. Every error names the field and both numbers;
    a prompt that alone leaves no room for one generated token is named as
    the prompt, not as max_tokens.
    """

    def __init__(self, tokenizer: Tokenizer, model_info: ModelInfo, *, max_parallel_samples: int = 16) -> None:
        self.tokenizer = tokenizer
        self.max_parallel_samples = max_parallel_samples  # the most samples (n, best_of) of one request
        self.vocab_size = model_info.vocab_size
        self.max_model_len = model_info.max_model_len
        self.num_blocks = model_info.num_blocks
        self.block_size = model_info.block_size
        self.pool_tokens = model_info.num_blocks * model_info.block_size
        # the longest sequence a request may reach: its prompt leaves room for one generated token
        self.max_seq_len = model_info.max_seq_len

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        serial: int = 0,
    ) -> Request:
        """Raises InvalidRequestError naming the field and the limit."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        check_stored_text("request_id", request_id, MAX_REQUEST_ID_CHARS)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        for name, value in (("n", params.n), ("best_of", params.best_of)):
            if value is not None and value > self.max_parallel_samples:
                raise InvalidRequestError(
                    name, f"must be in [1, {self.max_parallel_samples}] (--max-parallel-samples), got {value}"
                )
        for token_id in params.logit_bias or ():
            if token_id >= self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias[{token_id}]", f"token id {token_id} outside the vocabulary [0, {self.vocab_size})"
                )
        for index, token_id in enumerate(params.stop_token_ids):
            if token_id >= self.vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids[{index}]", f"token id {token_id} outside the vocabulary [0, {self.vocab_size})"
                )
        prompt_text, prompt_token_ids = self.tokenize(prompt, truncate_to=params.truncate_prompt_tokens)
        num_prior_output_tokens = self.prior_output_tokens(prompt, len(prompt_token_ids))
        return Request(
            request_id,
            prompt_token_ids,
            params,
            max_tokens=self.resolve_max_tokens(
                len(prompt_token_ids), params.max_tokens, clamp=params.max_tokens_is_default
            ),
            eos_token_ids=sorted(self.tokenizer.eos_token_ids),
            decoder=self.tokenizer,
            prompt=prompt_text,
            arrival_time=arrival_time,
            serial=serial,
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

    def tokenize(
        self, prompt: Prompt, *, text_field: str = "prompt", as_prompt: bool = True, truncate_to: int | None = None
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); raises InvalidRequestError naming the input:
        ``text_field`` (text), ``prompt_token_ids`` or ``messages`` (chat).

        as_prompt: also refuse an empty result or one longer than a prompt may be.
        Without it (counting tokens) only a text that could not be a prompt by
        its length alone is refused, so the work stays bounded.
        truncate_to: keep only the last k tokens (``truncate_prompt_tokens``;
        -1: as many as a prompt may have); the text is then None.
        """
        whole = as_prompt and truncate_to is None  # the whole prompt must fit
        if isinstance(prompt, str):
            field = text_field
            if not prompt:
                raise InvalidRequestError(field, "is empty (0 tokens)")
            self._check_text_fits(field, len(prompt.encode("utf-8", "surrogatepass")))
            if whole:
                self._check_prefix_fits(field, prompt)
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, TokensPrompt):
            field = "prompt_token_ids"
            token_ids = list(prompt.prompt_token_ids)
            if whole:
                self._check_prompt_len(len(token_ids), field)
            for index, token_id in enumerate(token_ids):
                if type(token_id) is not int or not 0 <= token_id < self.vocab_size:
                    raise InvalidRequestError(
                        f"prompt_token_ids[{index}]",
                        f"token id {token_id!r} outside the vocabulary [0, {self.vocab_size})",
                    )
            text = None
        elif isinstance(prompt, ChatPrompt):
            field = "messages"
            token_ids = self._apply_chat_template(prompt)
            text = None
        else:
            raise InvalidRequestError("prompt", f"must be str, TokensPrompt or ChatPrompt, got {type(prompt).__name__}")
        if truncate_to is not None:
            keep = self.max_seq_len - 1 if truncate_to == -1 else truncate_to
            if len(token_ids) > keep:
                token_ids, text = token_ids[-keep:], None
        if as_prompt:
            if not token_ids:
                raise InvalidRequestError(field, "is empty (0 tokens)")
            self._check_prompt_len(len(token_ids), field)
        return text, token_ids

    def _apply_chat_template(self, prompt: ChatPrompt) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise InvalidRequestError("messages", "the model has no chat template; send a plain prompt")
        if not prompt.messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        num_bytes = 0
        for index, message in enumerate(prompt.messages):
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{index}].role", f"unknown role {role!r}; known roles: {', '.join(CHAT_ROLES)}"
                )
            if not isinstance(content, str):
                raise InvalidRequestError(
                    f"messages[{index}].content", f"must be a string, got {type(content).__name__}"
                )
            num_bytes += len(content.encode("utf-8", "surrogatepass"))
        # the template only adds tokens around the contents: contents that cannot fit cannot fit templated
        self._check_text_fits("messages", num_bytes)
        return list(self.tokenizer.apply_chat_template(prompt.messages))

    def _check_text_fits(self, field: str, num_bytes: int) -> None:
        """Refuses a text whose length alone proves it is longer than any prompt may be.

        Each token covers at most ``tokenizer.max_token_bytes`` bytes of text, so
        a text of ``num_bytes`` bytes is at least ceil(num_bytes / max_token_bytes)
        tokens. A text under the bound is tokenized and checked exactly.
        """
        min_tokens = cdiv(num_bytes, self.tokenizer.max_token_bytes)
        if min_tokens > self.max_seq_len - 1:
            raise InvalidRequestError(
                field,
                f"{num_bytes} bytes of text are at least {min_tokens} tokens; a prompt may have at most "
                f"{self.max_seq_len - 1} tokens (max_model_len {self.max_model_len}, KV pool {self.pool_tokens} "
                "tokens, one token left to generate)",
            )

    def _check_prefix_fits(self, field: str, text: str) -> None:
        """Refuses a long text whose first part alone is more tokens than a prompt may have.

        A text of ordinary words runs a few characters a token, so a text longer
        than PREFIX_CHARS_PER_TOKEN characters per allowed token is tokenized a
        prefix first, cut before a space (so the prefix's words are the text's
        words): when that prefix alone is more than PREFIX_MARGIN_TOKENS over
        the limit, the whole text is too, and the rest is never tokenized.
        """
        limit = self.max_seq_len - 1
        cut = text.rfind(" ", 0, PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_MARGIN_TOKENS))
        if cut <= 0 or len(text) <= PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_MARGIN_TOKENS):
            return
        num_prefix_tokens = len(self.tokenizer.encode(text[:cut]))
        if num_prefix_tokens > limit + PREFIX_MARGIN_TOKENS:
            raise InvalidRequestError(
                field,
                f"prompt has more than {limit} tokens (its first {cut} characters alone are {num_prefix_tokens} "
                f"tokens); at most {limit} leave room for one generated token (max_model_len {self.max_model_len}, "
                f"KV pool {self.pool_tokens} tokens)",
            )

    def _check_prompt_len(self, num_prompt_tokens: int, field: str = "prompt") -> None:
        if num_prompt_tokens > self.max_seq_len - 1:
            raise InvalidRequestError(
                field,
                f"prompt has {num_prompt_tokens} tokens; at most {self.max_seq_len - 1} leave room for one generated "
                f"token (max_model_len {self.max_model_len}, KV pool {self.pool_tokens} tokens)",
            )

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, *, clamp: bool = False) -> int:
        """max_tokens checked against max_model_len and the pool; None -> all that fits.

        clamp: max_tokens is the default, not the client's: it becomes
        min(max_tokens, room left), never an error (vLLM's meaning).
        A prompt too long by itself is reported as the prompt (field "prompt"),
        whatever max_tokens says; only a prompt that fits makes max_tokens the
        field at fault.
        """
        self._check_prompt_len(num_prompt_tokens)
        if max_tokens is None:
            return self.max_seq_len - num_prompt_tokens
        if clamp:
            return min(max_tokens, self.max_seq_len - num_prompt_tokens)
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})",
            )
        if total > self.pool_tokens:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"needs {cdiv(total, self.block_size)} KV blocks; the whole pool holds {self.num_blocks} "
                f"blocks ({self.pool_tokens} tokens)",
            )
        return max_tokens
