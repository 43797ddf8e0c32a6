"""One request's state inside the engine: tokens, KV progress, output stream, timings."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from nanoserve.allocator import BlockKey, BlockTable, extend_block_keys
from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.counter_rng import random_seed
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import prompt_token_logprobs
from nanoserve.engine.text.detokenizer import Decoder
from nanoserve.engine.text.text_stream import TextStream

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher

    from nanoserve.engine.core.sample_group import SampleGroup


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's waiting queue, holding no blocks
    RUNNING = "running"  # admitted: holds a block table, prefilling or decoding
    FORKED = "forked"  # prefilled, its table forked into its samples: holds the prompt's blocks, not scheduled
    FINISHED = "finished"  # done (stop, length or abort); blocks freed


class Request:
    """A prompt being turned into tokens.

    Invariant: while RUNNING, ``block_table.num_tokens`` equals
    ``num_computed_tokens`` between steps (the scheduler grows the table by
    the tokens it schedules; the engine advances ``num_computed_tokens`` after
    the forward pass). A preempted request drops its table and recomputes
    ``token_ids`` (prompt + generated) from position 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: list[int],
        decoder: Decoder,
        prompt: str | None = None,
        arrival_time: float | None = None,
        serial: int = 0,
        num_prior_output_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.serial = serial  # unique over the engine's life; request_id alone may be reused
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # sampling_params.max_tokens, resolved against the limits
        self.eos_token_ids = [] if sampling_params.ignore_eos else list(eos_token_ids)
        self.min_tokens_banned_ids = self.eos_token_ids + list(sampling_params.stop_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.status = RequestStatus.WAITING
        self.block_table: BlockTable | None = None
        # Sampling: the effective seed (the client's, or 64 random bits) and how many of the prompt's
        # last tokens an earlier admission generated; with them the sampler continues a resumed request
        # exactly (output position = num_prior_output_tokens + num_output_tokens).
        self.seed: int = sampling_params.seed if sampling_params.seed is not None else random_seed()
        self.num_prior_output_tokens = num_prior_output_tokens
        self.decoder = decoder
        self.stream = TextStream(decoder, sampling_params.stop, sampling_params.logprobs is not None)
        # prompt logprobs: of prompt tokens 1.. in order (token 0 has none), as their prefill computes them
        self.prompt_logprobs: list[TokenLogprob] | None = [] if sampling_params.prompt_logprobs is not None else None
        self._prompt_logprobs_sent = False
        # parallel sampling: the group this request leads (parent) or belongs to (child, ``index`` its place)
        self.group: SampleGroup | None = None
        self.index = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.abort_cause: AbortCause | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        # Prefix caching: the keys of the full blocks of token_ids computed so far (they only grow, as
        # token_ids does), chained over the cache salt
        self._block_keys: list[BlockKey] = []
        self._extra_keys: tuple[str, ...] = () if sampling_params.cache_salt is None else (sampling_params.cache_salt,)
        # journal: when the client's deadline passes (wall clock, ns; None: no deadline), and the
        # crashed epoch this request was recovered from (None: admitted here)
        self.deadline_wall_ns: int | None = None
        self.recovered_from: int | None = None
        # structured outputs: the llguidance matcher of sampling_params.constraint, advanced by every
        # generated token (None: unconstrained); set by the engine after compiling
        self.matcher: LLMatcher | None = None

    def attach_matcher(self, matcher: LLMatcher) -> None:
        """Takes the matcher of the request's constraint in its start state and advances it over the
        tokens an earlier admission generated (a resumed prompt's last ``num_prior_output_tokens``),
        so the grammar continues where the output stands. Raises InvalidRequestError when they do
        not match the grammar."""
        prior = self.prompt_token_ids[len(self.prompt_token_ids) - self.num_prior_output_tokens :]
        if prior and not matcher.consume_tokens(prior):
            raise InvalidRequestError(
                "num_prior_output_tokens", f"the prior output does not match the constraint: {matcher.get_error()}"
            )
        self.matcher = matcher

    def advance_grammar(self, token_id: int) -> bool:
        """Moves the matcher past a sampled token; False when the grammar cannot take it: the
        matcher failed (a dead end, or llguidance's limits; in that state its mask allows EOS
        only) before or at this token. The request must end, the token discarded."""
        matcher = self.matcher
        if matcher is None:
            return True
        return not matcher.is_error() and matcher.consume_token(token_id) and not matcher.is_error()

    def block_keys(self, block_size: int) -> list[BlockKey]:
        """The ``BlockKey`` of every full block of ``token_ids`` (the list is the request's own: do not change it)."""
        return extend_block_keys(self._block_keys, self.token_ids, block_size, self._extra_keys)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.stream.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.stream.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def wants_prompt_logprobs(self, start: int, end: int) -> bool:
        """The chunk of positions [start, end) holds a position whose prompt logprob is still missing."""
        return self.prompt_logprobs is not None and start <= len(self.prompt_logprobs) < min(
            end, self.num_prompt_tokens - 1
        )

    def add_prompt_logprobs(self, start: int, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens that positions ``start..`` predict.

        logits: [>= the chunk's tokens, vocab_size], row i of position start + i
        (rows past the prompt's second-to-last position are ignored). A
        position recorded before (a recompute after preemption) is skipped.
        """
        assert self.prompt_logprobs is not None
        first = len(self.prompt_logprobs) - start  # the first row not recorded yet
        last = min(self.num_prompt_tokens - 1 - start, logits.shape[0])  # rows predicting a prompt token
        if first >= last:
            return
        next_ids = self.prompt_token_ids[start + first + 1 : start + last + 1]
        num_top = self.sampling_params.prompt_logprobs
        assert num_top is not None
        self.prompt_logprobs += prompt_token_logprobs(logits[first:last], next_ids, num_top)

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Adds a sampled token and decides whether it ends the request.

        Sets ``finish_reason`` / ``stop_reason`` when it does: EOS or a stop
        token id (never before min_tokens), a stop string, a constraint's
        grammar that is complete (finish reason "stop", ``stop_reason`` None),
        or max_tokens. A constrained request's matcher has taken the token
        already (``advance_grammar``).
        ``stop_reason`` names what the client asked for: the stop string, or
        the id from ``stop_token_ids``; it stays None for the model's own EOS
        (a token that is both EOS and in ``stop_token_ids`` reports its id).
        """
        self.token_ids.append(token_id)
        num_output = self.num_output_tokens + 1
        may_stop = num_output > self.sampling_params.min_tokens
        is_stop_token_id = token_id in self.sampling_params.stop_token_ids
        if may_stop and (is_stop_token_id or token_id in self.eos_token_ids):
            self.stream.append(token_id, logprob, decode=False, check_stop=False)
            self._set_finish("stop", token_id if is_stop_token_id else None)
            return
        matched = self.stream.append(token_id, logprob, decode=True, check_stop=may_stop)
        if matched is not None:
            self._set_finish("stop", matched)
        elif self.matcher is not None and self.matcher.is_stopped():  # complete: only EOS may follow
            self._set_finish("stop", None)
        elif num_output >= self.max_tokens:
            self._set_finish("length", None)

    def restore_outputs(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> None:
        """Re-creates released outputs of an earlier admission (recovery after a crash): the
        tokens become generated and released, so sampling continues at output position
        ``len(token_ids)`` and max_tokens / min_tokens / stop strings count them."""
        if self.matcher is not None and not self.matcher.consume_tokens(token_ids):
            raise InvalidRequestError(
                "constraint", f"the journaled output does not match the constraint: {self.matcher.get_error()}"
            )
        for index, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            self.stream.append(
                token_id, logprobs[index] if logprobs is not None else None, decode=True, check_stop=False
            )
        self.stream.restore_released(text)

    def _set_finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def note_first_token(self, now: float) -> None:
        """Stamps ``now`` (``time.monotonic()``) as the first token's time, its group's parent's too, once."""
        for metrics in (self.metrics, self.group.parent.metrics) if self.group is not None else (self.metrics,):
            if metrics.first_token_time is None:
                metrics.first_token_time = now

    def abort(self, cause: AbortCause) -> None:
        """Ends the request with finish_reason "abort" and its cause (the caller frees its blocks)."""
        self.finish_reason = "abort"
        self.stop_reason = None
        self.abort_cause = cause

    def make_output(self, *, final: bool) -> RequestOutput | None:
        """This step's output: what the stream may release now; None when nothing new.

        final: the request has finished (or been aborted); release everything.
        A non-final output is a delta (``is_delta``: O(the step's tokens) to
        make); the final one carries the whole completion, copied once.
        """
        delta = self.stream.release(final=final)
        if not final and not delta.token_ids and not delta.text:
            return None
        if final:
            completion = CompletionOutput(
                index=self.index,
                text=self.stream.released_text,
                token_ids=self.stream.released_token_ids,
                finish_reason=self.finish_reason,
                stop_reason=self.stop_reason,
                logprobs=self.stream.released_logprobs,
            )
        else:
            completion = CompletionOutput(self.index, delta.text, delta.token_ids, logprobs=delta.logprobs)
        prompt_logprobs = None
        if self.prompt_logprobs is not None and (final or not self._prompt_logprobs_sent):
            prompt_logprobs, self._prompt_logprobs_sent = list(self.prompt_logprobs), True  # first and final
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=final,
            delta_text=delta.text,
            delta_token_ids=delta.token_ids,
            delta_logprobs=delta.logprobs,
            metrics=RequestMetrics(**vars(self.metrics)),
            prompt=self.prompt,
            serial=self.serial,
            abort_cause=self.abort_cause if final else None,
            prompt_logprobs=prompt_logprobs,
            is_delta=not final,
            delta_start=self.stream.num_released_tokens - len(delta.token_ids) if not final else 0,
        )
