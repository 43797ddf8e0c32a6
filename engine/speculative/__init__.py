"""Speculative decoding: draft tokens proposed cheaply, verified by one forward pass of the model.

``proposer`` (the ``Proposer`` protocol and ``make_proposer``), ``ngram_proposer`` (prompt
lookup), ``verification`` (the rows the sampler draws each verified position from, and the
accepted prefix). See docs/speculative-decoding.md.
"""

from nanoserve.engine.speculative.ngram_proposer import NgramProposer
from nanoserve.engine.speculative.proposer import Proposer, make_proposer
from nanoserve.engine.speculative.verification import (
    DraftRow,
    accepted_tokens,
    append_accepted,
    draft_rows,
    sample_verified,
)

__all__ = [
    "DraftRow",
    "NgramProposer",
    "Proposer",
    "accepted_tokens",
    "append_accepted",
    "draft_rows",
    "make_proposer",
    "sample_verified",
]
