"""``Proposer``: what proposes a decoding request's draft tokens, and the one that the settings pick."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import structlog

from nanoserve.engine.config import MAX_EXACT_SPECULATIVE_TOKENS, SpeculativeConfig
from nanoserve.engine.speculative.ngram_proposer import NgramProposer

_log = structlog.get_logger(__name__)


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence; the model verifies them (Leviathan et al. 2023).

    A proposer is pure with respect to the engine: it reads the tokens it is given
    and holds no per-request state, so preemption, abort and recovery need nothing
    from it. A draft model would be another implementation.
    """

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """At most ``num_tokens`` (>= 0) draft tokens to follow ``token_ids`` (prompt + output so
        far, oldest first); fewer or none where it has no guess."""
        ...


def resolve(config: SpeculativeConfig, on_gguf_kernels: bool) -> tuple[str, str]:
    """(the method that runs, why): ``auto`` is ngram where a verify pass is bit-identical to plain
    decoding (every linear on nanoserve's GGUF kernels, whose decode tiles take up to 8 rows, and
    k <= MAX_EXACT_SPECULATIVE_TOKENS), off elsewhere (dequantized float32 or a GPU: the matmul's
    reduction order follows the row count, so a greedy answer could part from plain decoding's)."""
    if config.speculative != "auto":
        return config.speculative, "set"
    if not on_gguf_kernels:
        return "off", "auto: the model does not run on nanoserve's GGUF kernels"
    if config.num_speculative_tokens > MAX_EXACT_SPECULATIVE_TOKENS:
        return "off", f"auto: num_speculative_tokens above {MAX_EXACT_SPECULATIVE_TOKENS}"
    return "ngram", "auto: GGUF kernels, verify passes bit-identical to plain decoding"


def make_proposer(config: SpeculativeConfig, on_gguf_kernels: bool = False) -> Proposer | None:
    """The proposer ``config.speculative`` names, ``auto`` resolved (``resolve``; logged once,
    ``speculative_decoding``); None when off."""
    method, why = resolve(config, on_gguf_kernels)
    if method == "ngram":
        _log.info(
            "speculative_decoding",
            method=method,
            reason=why,
            num_speculative_tokens=config.num_speculative_tokens,
            ngram_min=config.speculative_ngram_min,
            ngram_max=config.speculative_ngram_max,
        )
        return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    assert method == "off", f"no proposer for speculative={method!r}"
    _log.info("speculative_decoding", method=method, reason=why)
    return None
