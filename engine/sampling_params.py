"""How one request picks its tokens and when it stops.

Field names and meanings follow vLLM's ``SamplingParams`` (and, for the
penalties, the OpenAI API), so that clients of either feel at home. "Disabled"
is ``None`` (``top_k=None``), never -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most top alternatives returned per generated token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request; validates itself.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (None: all).
    top_p: keep the smallest set of most likely tokens whose probability sums
        to at least top_p (nucleus sampling, Holtzman et al. 2019).
    min_p: drop tokens whose probability is below min_p times the most likely
        token's probability.
    repetition_penalty: divides positive logits and multiplies negative ones of
        every token already in the prompt or output (Keskar et al. 2019, CTRL).
    presence_penalty / frequency_penalty: subtracted from the logit of every
        generated token once / once per occurrence (OpenAI definition), in [-2, 2].
    seed: seeds this request's own random generator, so its tokens do not
        depend on what else shares the batch. None draws from the engine's.
    max_tokens: most tokens generated (None: up to max_model_len or the pool).
    min_tokens: the first min_tokens tokens can be neither EOS, a stop token,
        nor complete a stop string.
    stop: strings that end generation; the matched string is not returned.
    stop_token_ids: token ids that end generation (finish reason "stop").
    ignore_eos: keep generating past the model's EOS tokens.
    logprobs: also return the chosen token's log-probability and this many
        most likely alternatives (0: the chosen one only; None: nothing).

    Raises InvalidRequestError(field, message) naming the field and its range.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_ranges()
        self._check_stops()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _check_ranges(self) -> None:
        _require("temperature", self.temperature >= 0.0, f"must be >= 0 (0 = greedy), got {self.temperature}")
        _require("top_k", self.top_k is None or self.top_k >= 1, f"must be >= 1 (unset: no top-k), got {self.top_k}")
        _require("top_p", 0.0 < self.top_p <= 1.0, f"must be in (0, 1], got {self.top_p}")
        _require("min_p", 0.0 <= self.min_p <= 1.0, f"must be in [0, 1], got {self.min_p}")
        _require(
            "repetition_penalty",
            self.repetition_penalty > 0.0,
            f"must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(name, -2.0 <= value <= 2.0, f"must be in [-2, 2], got {value}")
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
