"""Prompt lookup: draft tokens copied from where the sequence's last n tokens occurred before.

Text that quotes its input (summaries, code edits, extraction, retrieval answers) repeats
runs of the prompt; a sequence's last few tokens then usually occurred before, followed by
what comes next. Saxena's "prompt lookup decoding" (2023) and vLLM's ngram proposer draft
from that earlier occurrence; no model is run to propose.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes the tokens that followed the most recent earlier occurrence of the last n tokens.

    n runs from ``ngram_max`` down to ``ngram_min``: the longest suffix that occurred
    before wins (a longer match is a better predictor). The continuation is copied as
    LZ77 copies an overlapping match: a run that reaches the sequence's end goes on
    with the tokens just proposed, so a short repeating pattern (period p < k) still
    gives k drafts.
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        """ValueError unless 1 <= ngram_min <= ngram_max."""
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts to follow ``token_ids``; [] when no suffix of
        ``ngram_min`` or more tokens occurred earlier. O(len(token_ids) * ngram_max) per call, in numpy."""
        if num_tokens <= 0 or len(token_ids) <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # windows [L - n, n]: window i is tokens[i : i + n], for every i < L - n (an occurrence
            # that ends before the last token, so at least one token follows it)
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                return _copy_after(token_ids, int(starts[-1]) + n, num_tokens)
        return []


def _copy_after(token_ids: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """``num_tokens`` tokens read from ``start`` on, the read running on into what it wrote."""
    assert 0 <= start < len(token_ids), f"start {start} outside the {len(token_ids)} tokens"
    drafts: list[int] = []
    for position in range(start, start + num_tokens):
        drafts.append(token_ids[position] if position < len(token_ids) else drafts[position - len(token_ids)])
    return drafts
