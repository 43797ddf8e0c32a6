"""How one request picks its tokens and when it stops.

Field names and meanings follow vLLM's ``SamplingParams`` (and, for the
penalties, the OpenAI API), so that clients of either feel at home. "Disabled"
is ``None`` (``top_k=None``), never -1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.counter_rng import MAX_SEED, MIN_SEED
from nanoserve.engine.sampling.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from nanoserve.engine.structured.constraint import Constraint
from nanoserve.engine.text.stored_text import check_stored_text

# Below this temperature a request is greedy, exactly: a logit gap of 1e-3 is already a factor of e**100
# between two tokens, so nothing is lost, and no division by a near-zero temperature is left to overflow
# (vLLM treats temperature < 1e-5 as greedy too).
MIN_SAMPLING_TEMPERATURE = 1e-5


class _DefaultMaxTokens(int):
    """The max_tokens of a request that named none: an int, told apart from the same number given.

    vLLM's meaning: the default is 16, clamped to the room the prompt leaves in
    max_model_len (and the pool), while a max_tokens the client gave that does
    not fit is refused. ``SamplingParams.max_tokens_is_default`` reads the type.
    """

    __slots__ = ()


DEFAULT_MAX_TOKENS: int = _DefaultMaxTokens(16)


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request; validates itself.

    temperature: finite, >= 0. 0, or any value below MIN_SAMPLING_TEMPERATURE
        (1e-5), means greedy: the argmax, exactly as temperature 0; otherwise
        logits are divided by it.
    top_k: keep the k most likely tokens (None: all).
    top_p: keep the smallest set of most likely tokens whose probability sums
        to at least top_p (nucleus sampling, Holtzman et al. 2019).
    min_p: drop tokens whose probability is below min_p times the most likely
        token's probability.
    repetition_penalty: divides positive logits and multiplies negative ones of
        every token already in the prompt or output (Keskar et al. 2019, CTRL).
    presence_penalty / frequency_penalty: subtracted from the logit of every
        generated token once / once per occurrence (OpenAI definition), in [-2, 2].
    seed: an int64, in [-2**63, 2**63 - 1]. The token at output position n
        (0 for the first generated token) is drawn with a uniform number that
        is a function of (seed, n) only (SplitMix64 from the state
        mix64(seed mod 2**64), read at n; see ``counter_rng``), so a seeded
        request gets the same tokens whatever shares its batch, whether it was
        preempted, or re-admitted after a restart with the tokens it had
        generated. Distinct seeds have distinct states (the map is a
        bijection on 64-bit words). None: the engine picks 64 random bits
        (``Request.seed``).
    max_tokens: most tokens generated (None: up to max_model_len or the pool).
        Not given: DEFAULT_MAX_TOKENS (16), clamped to the room the prompt
        leaves (``max_tokens_is_default``); a given value that does not fit
        is refused.
    min_tokens: the first min_tokens tokens can be neither EOS, a stop token,
        nor complete a stop string.
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: token ids that end generation (finish reason "stop").
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: also return the chosen token's log-probability and this many
        most likely alternatives (0: the chosen one only; None: nothing).
    prompt_logprobs: also return, once, each prompt token's log-probability
        given the tokens before it and this many most likely alternatives
        (0..20), from the prefill; None: nothing. Such a request's prompt is
        computed in full (no prefix-cache hits); not with n or best_of above 1.
    logit_bias: token id -> a value in [-100, 100] added to that token's logit
        before sampling (OpenAI's meaning), at most 300 entries; ids are
        checked against the vocabulary when the request is admitted. Logprobs
        are those of the model's raw logits.
    truncate_prompt_tokens: keep only the prompt's last k tokens (k >= 1), or
        -1: the last ones that fit the model (max_model_len - 1); None: the
        whole prompt (one too long is refused).
    n: how many samples to return (parallel sampling), >= 1; the engine caps it
        (``--max-parallel-samples``, ``SchedulerConfig.max_parallel_samples``).
        The prompt is prefilled once and its blocks are forked into the samples
        (docs/parallel-sampling.md); sample i draws with the seed
        ``counter_rng.sample_seed(seed, i)``, so it equals a single request sent
        with that seed.
    best_of: samples to generate, of which the n with the highest cumulative
        log-probability are returned (vLLM's meaning); >= n; None: n. With
        best_of > n nothing is streamed before the end.
    cache_salt: prefix caching shares KV blocks only between requests with
        equal salts (None: the shared default); 1..256 characters. Not a
        sampling setting, but one per request that travels with them (vLLM
        carries it beside the prompt): a tenant with its own salt cannot learn
        from time to first token what another tenant sent.
    constraint: structured output (``Constraint``): the output must match a
        JSON schema, regex, grammar, one of a list of choices, or be any JSON
        object (None: unconstrained). The engine masks every disallowed token
        before sampling and ends the request (finish reason "stop") when the
        grammar is complete and allows nothing more. A dict in the journal's
        form (``Constraint.to_dict``) is read as one.

    Raises InvalidRequestError(field, message) naming the field and its
    range: "top_p: must be in (0, 1], got nan". NaN and infinities are
    outside every range; so is any value that is not a number.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    n: int = 1
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.constraint, dict):
            self.constraint = Constraint.from_dict(self.constraint)
        _require(
            "constraint",
            self.constraint is None or isinstance(self.constraint, Constraint),
            f"must be a Constraint or None, got {type(self.constraint).__name__}",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_ranges()
        self._check_stops()
        self._check_logit_bias()
        self._check_prompt_logprobs()
        if self.cache_salt is not None:
            check_stored_text("cache_salt", self.cache_salt, MAX_CACHE_SALT_CHARS)

    @property
    def max_tokens_is_default(self) -> bool:
        """max_tokens was not given: the engine clamps it to the room the prompt leaves."""
        return type(self.max_tokens) is _DefaultMaxTokens

    @property
    def num_samples(self) -> int:
        """Samples generated: best_of, or n when best_of is unset."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0 or below MIN_SAMPLING_TEMPERATURE."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def _check_ranges(self) -> None:
        floor = MIN_SAMPLING_TEMPERATURE
        _require_number(
            "temperature",
            self.temperature,
            lambda t: math.isfinite(t) and t >= 0.0,
            f"finite and >= 0 (0, or below {floor}: greedy)",
        )
        _require(
            "top_k",
            self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
            f"must be an integer >= 1 (unset: no top-k), got {self.top_k!r}",
        )
        _require_number("top_p", self.top_p, lambda p: 0.0 < p <= 1.0, "in (0, 1]")
        _require_number("min_p", self.min_p, lambda p: 0.0 <= p <= 1.0, "in [0, 1]")
        _require_number(
            "repetition_penalty",
            self.repetition_penalty,
            lambda p: math.isfinite(p) and p > 0.0,
            "finite and > 0 (1: off)",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            _require_number(
                name,
                getattr(self, name),
                lambda p: -MAX_PENALTY <= p <= MAX_PENALTY,
                f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
            )
        _require(
            "seed",
            self.seed is None or (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED),
            f"must be an integer in [-2**63, 2**63 - 1] or None, got {self.seed!r}",
        )
        _require(
            "max_tokens",
            self.max_tokens is None or self.max_tokens >= 1,
            f"must be >= 1, got {self.max_tokens}",
        )
        _require("min_tokens", self.min_tokens >= 0, f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _require(
                "min_tokens",
                self.min_tokens <= self.max_tokens,
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _require("n", _is_int(self.n) and self.n >= 1, f"must be an integer >= 1, got {self.n!r}")
        _require(
            "best_of",
            self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
            f"must be an integer >= n ({self.n}) or unset, got {self.best_of!r}",
        )
        _require(
            "logprobs",
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )

    def _check_prompt_logprobs(self) -> None:
        _require(
            "prompt_logprobs",
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
        )
        _require(
            "prompt_logprobs",
            self.prompt_logprobs is None or self.num_samples == 1,
            f"is not served with n or best_of above 1 (got {self.num_samples} samples)",
        )
        _require(
            "n",
            self.constraint is None or self.num_samples == 1,
            f"must be 1 with a structured-output constraint (got {self.num_samples} samples; each sample would "
            "need its own grammar state, which is not built yet)",
        )

    def _check_logit_bias(self) -> None:
        _require(
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens is None
            or (
                _is_int(self.truncate_prompt_tokens)
                and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
            ),
            f"must be -1 (the model's limit) or an integer >= 1, got {self.truncate_prompt_tokens!r}",
        )
        if self.logit_bias is None:
            return
        _require(
            "logit_bias",
            isinstance(self.logit_bias, dict),
            f"must be a map of token id to bias, got {_shown(self.logit_bias)}",
        )
        _require(
            "logit_bias",
            len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
            f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}",
        )
        for token_id, bias in self.logit_bias.items():
            _require(
                f"logit_bias[{token_id}]",
                _is_int(token_id) and token_id >= 0,
                f"token id {token_id!r} outside the vocabulary (ids are >= 0)",
            )
            _require_number(
                f"logit_bias[{token_id}]", bias, lambda b: -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS, "in [-100, 100]"
            )

    def _check_stops(self) -> None:
        _require(
            "stop", len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
        )
        for index, text in enumerate(self.stop):
            _require(
                f"stop[{index}]", isinstance(text, str) and text != "", f"must be a non-empty string, got {text!r}"
            )
            _require(
                f"stop[{index}]",
                len(text) <= MAX_STOP_STRING_CHARS,
                f"at most {MAX_STOP_STRING_CHARS} characters, got {len(text)}",
            )
        _require(
            "stop_token_ids",
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
        )
        for index, token_id in enumerate(self.stop_token_ids):
            _require(
                f"stop_token_ids[{index}]",
                type(token_id) is int and token_id >= 0,
                f"token id {token_id!r} outside the vocabulary (ids are >= 0)",
            )


def _require(field_name: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _require_number(field_name: str, value: object, in_range: Callable[[float], bool], limit: str) -> None:
    """``value`` is an int or float (not bool) and ``in_range``; NaN fails every comparison."""
    number = _as_float(value)
    _require(field_name, number is not None and in_range(number), f"must be {limit}, got {value!r}")


def _as_float(value: object) -> float | None:
    """The float of an int or float; None for anything else, bools and ints past float range included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object, limit: int = 40) -> str:
    """``value`` for an error message: its repr, cut to ``limit`` characters with its length when longer."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
    return f"{text[:limit]}... ({size})"
