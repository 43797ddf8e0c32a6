"""``Proposer``: what proposes a decoding request's draft tokens, and the one that the settings pick."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import structlog

from nanoserve.engine.config import SpeculativeConfig
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


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer ``config.speculative`` names (logged once, ``speculative_decoding``); None when off."""
    if config.speculative == "ngram":
        _log.info(
            "speculative_decoding",
            method=config.speculative,
            num_speculative_tokens=config.num_speculative_tokens,
            ngram_min=config.speculative_ngram_min,
            ngram_max=config.speculative_ngram_max,
        )
        return NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    assert config.speculative == "off", f"no proposer for speculative={config.speculative!r}"
    return None
