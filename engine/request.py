"""One request's state inside the engine: tokens, KV progress, output stream, timings."""

from __future__ import annotations

import enum
import time

from nanoserve.allocator import BlockKey, BlockTable, extend_block_keys
from nanoserve.engine.counter_rng import random_seed
from nanoserve.engine.detokenizer import Decoder
from nanoserve.engine.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.text_stream import TextStream


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's waiting queue, holding no blocks
    RUNNING = "running"  # admitted: holds a block table, prefilling or decoding
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
        self.stream = TextStream(decoder, sampling_params.stop, sampling_params.logprobs is not None)
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

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Adds a sampled token and decides whether it ends the request.

        Sets ``finish_reason`` / ``stop_reason`` when it does: EOS or a stop
        token id (never before min_tokens), a stop string, or max_tokens.
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
        elif num_output >= self.max_tokens:
            self._set_finish("length", None)

    def restore_outputs(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> None:
        """Re-creates released outputs of an earlier admission (recovery after a crash): the
        tokens become generated and released, so sampling continues at output position
        ``len(token_ids)`` and max_tokens / min_tokens / stop strings count them."""
        for index, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            self.stream.append(
                token_id, logprobs[index] if logprobs is not None else None, decode=True, check_stop=False
            )
        self.stream.restore_released(text)

    def _set_finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def abort(self, cause: AbortCause) -> None:
        """Ends the request with finish_reason "abort" and its cause (the caller frees its blocks)."""
        self.finish_reason = "abort"
        self.stop_reason = None
        self.abort_cause = cause

    def make_output(self, *, final: bool) -> RequestOutput | None:
        """This step's output: what the stream may release now; None when nothing new.

        final: the request has finished (or been aborted); release everything.
        """
        delta = self.stream.release(final=final)
        if not final and not delta.token_ids and not delta.text:
            return None
        completion = CompletionOutput(
            index=0,
            text=self.stream.released_text,
            token_ids=list(self.stream.released_token_ids),
            finish_reason=self.finish_reason if final else None,
            stop_reason=self.stop_reason if final else None,
            logprobs=self.stream.released_logprobs,
        )
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
        )
