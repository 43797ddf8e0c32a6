"""How one request picks its tokens and when it stops.

Field names and meanings follow vLLM's ``SamplingParams`` (and, for the
penalties, the OpenAI API), so that clients of either feel at home. "Disabled"
is ``None`` (``top_k=None``), never -1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.engine.counter_rng import MAX_SEED, MIN_SEED
from nanoserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most top alternatives returned per generated token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 256
# Below this temperature a request is greedy, exactly: a logit gap of 1e-3 is already a factor of e**100
# between two tokens, so nothing is lost, and no division by a near-zero temperature is left to overflow
# (vLLM treats temperature < 1e-5 as greedy too).
MIN_SAMPLING_TEMPERATURE = 1e-5


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
    min_tokens: the first min_tokens tokens can be neither EOS, a stop token,
        nor complete a stop string.
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: token ids that end generation (finish reason "stop").
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: also return the chosen token's log-probability and this many
        most likely alternatives (0: the chosen one only; None: nothing).
    cache_salt: prefix caching shares KV blocks only between requests with
        equal salts (None: the shared default); 1..256 characters. Not a
        sampling setting, but one per request that travels with them (vLLM
        carries it beside the prompt): a tenant with its own salt cannot learn
        from time to first token what another tenant sent.

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
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_ranges()
        self._check_stops()
        if self.cache_salt is not None and (
            type(self.cache_salt) is not str or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise InvalidRequestError(
                "cache_salt", f"must be a string of 1..{MAX_CACHE_SALT_CHARS} characters, got {self.cache_salt!r:.300}"
            )

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
            _require_number(name, getattr(self, name), lambda p: -2.0 <= p <= 2.0, "in [-2, 2]")
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
        _require(
            "logprobs",
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
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
