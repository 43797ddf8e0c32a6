"""What the engine hands back: one RequestOutput per request per step.

A request's outputs are deltas until its final one: each non-final output
the engine makes holds only this step's text, token ids and logprobs
(``is_delta``; ``outputs[0]`` is the delta, ``delta_start`` where it
begins), and the final output holds the whole completion, so a batch caller
reads the last output. Making an output thus costs O(the step's tokens),
never the whole history again, and so does queueing it for a slow reader.
Outputs are snapshots: the engine never mutates one after handing it out.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class AbortCause(str, enum.Enum):
    """Why a request ended with finish_reason "abort"; carried by its final output.

    The engine knows every ending: whoever asks it to abort a request says why,
    and the request's one final output carries that cause to whoever records it.
    """

    ABORT_RPC = "abort_rpc"  # an Abort call named the request
    CANCELLED = "cancelled"  # the client cancelled the call or went away
    DEADLINE = "deadline"  # the call's deadline passed
    SHUTDOWN = "shutdown"  # still running when the server's shutdown grace ran out
    ENGINE_ERROR = "engine_error"  # the engine loop failed
    NOT_RECOVERED = "not_recovered"  # unfinished at a crash and not taken over (past the journal's retention)
    CALLER = "caller"  # the engine's own caller gave up (``LLM.generate`` cleaning up after a bad request)
    SLOW_CONSUMER = "slow_consumer"  # the client read its stream too slowly: the stream's buffer passed its bound
    GRAMMAR = "grammar"  # structured output: the constraint's grammar allowed no next token (or its matcher failed)


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token and its top alternatives.

    Log-probabilities are natural-log, of the model's own distribution
    (before penalties, temperature and top-k/top-p/min-p truncation).
    top_logprobs: token id -> logprob of the n most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass(frozen=True)
class CompletionOutput:
    """The generated completion of one request, as released so far.

    text: released text; a stop string and the text of a stop token or EOS
        are never part of it.
    token_ids: released token ids (they stay in step with ``text``: a token is
        released with the text it completes); a stop token or EOS is included.
    finish_reason: "stop" (EOS, stop token or stop string), "length"
        (max_tokens or max_model_len) or "abort"; None while running.
    stop_reason: the stop string or token id that matched; None otherwise.
    logprobs: one TokenLogprob per token id, when the request asked for them.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds of ``time.monotonic()``.

    None until the event happens. A preempted request keeps its first times.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to first sampled token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """One request's state after a step: this step's delta, and on a whole output the completion so far.

    Concatenating ``delta_text`` over a request's outputs gives the final
    ``text``; concatenating ``delta_token_ids`` gives the final ``token_ids``.
    A delta (``is_delta``) has ``outputs[0]`` equal to its delta; a whole
    output (every final one) has the completion so far there.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    # this request's number in the engine's life (1, 2, ...): two requests that reuse one
    # request_id, one after the other, have different serials
    serial: int = 0
    # why an aborted request ended (final output only); None for every other ending
    abort_cause: AbortCause | None = None
    # an abort's reason in words where the cause alone does not say it (a request recovery after a crash
    # could not take back: the limit it broke), from its journaled FINISH; None otherwise
    abort_detail: str | None = None

    # the output holds only this step's tokens: outputs[0] is the delta, not the whole completion
    is_delta: bool = False
    # a delta's first token: how many output tokens the request released before it (0 on a whole output:
    # ``delta_start_index`` works for both)
    delta_start: int = 0
    # parallel sampling (n / best_of): None for a one-sample request; True when each sample streamed its
    # outputs and its ending (outputs[0] with finish_reason set, not final) and the final output only
    # gathers them; False (best_of > n) when the final output is the first to carry the samples, whole
    samples_streamed: bool | None = None
    # prompt logprobs (``SamplingParams.prompt_logprobs``): one per prompt token after the first, on the
    # request's first output and its final one (a stream sends them once, with the first)
    prompt_logprobs: list[TokenLogprob] | None = None

    def as_delta(self) -> RequestOutput:
        """This output with ``outputs[0]`` cut to the step's delta (text, token ids, logprobs).

        The delta's lists are shared, not copied, so it costs O(the step's tokens)
        whatever the completion's length. A final output is returned as it is: it
        carries the whole completion (its counts, ``to_complete``'s token ids).
        """
        if self.finished or self.is_delta or self.outputs[0].finish_reason is not None:
            return self  # a sample's ending stays whole too: its counts are the sample's
        completion = self.outputs[0]
        delta = CompletionOutput(
            index=completion.index, text=self.delta_text, token_ids=self.delta_token_ids, logprobs=self.delta_logprobs
        )
        return dataclasses.replace(self, outputs=[delta], is_delta=True, delta_start=self.delta_start_index)

    @property
    def num_released_tokens(self) -> int:
        """Output tokens the request has released up to and including this output (of ``outputs[0]``'s sample)."""
        if self.is_delta:
            return self.delta_start + len(self.delta_token_ids)
        return len(self.outputs[0].token_ids)

    @property
    def delta_start_index(self) -> int:
        """The index of the delta's first token among the request's released output tokens."""
        return self.num_released_tokens - len(self.delta_token_ids)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason
