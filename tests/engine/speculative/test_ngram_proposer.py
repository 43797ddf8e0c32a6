"""Prompt lookup: the drafts are what followed the most recent earlier occurrence of the longest suffix."""

from __future__ import annotations

import pytest

from nanoserve.engine.config import SpeculativeConfig
from nanoserve.engine.speculative import NgramProposer, make_proposer


def test_the_longest_suffix_that_occurred_before_wins() -> None:
    proposer = NgramProposer(1, 3)
    # suffix (7, 8, 9) occurred at 0 (followed by 1, 2); the 1-gram 9 occurred last at 6 (followed by 5)
    assert proposer.propose([7, 8, 9, 1, 2, 4, 9, 5, 7, 8, 9], 2) == [1, 2]


def test_the_most_recent_occurrence_is_copied() -> None:
    proposer = NgramProposer(2, 2)
    assert proposer.propose([3, 4, 10, 11, 3, 4, 20, 21, 3, 4], 2) == [20, 21]


def test_a_shorter_ngram_is_tried_when_the_longer_never_occurred() -> None:
    assert NgramProposer(1, 4).propose([1, 2, 3, 9, 4, 5, 6, 9], 3) == [4, 5, 6]


def test_no_occurrence_gives_no_drafts() -> None:
    assert NgramProposer(1, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramProposer(2, 4).propose([1, 2, 3, 1, 4, 2], 4) == []  # only 1-grams repeat


def test_a_run_reaching_the_end_continues_with_its_own_drafts() -> None:
    # period 2: the most recent earlier (5, 6) starts at 2, and 2 tokens follow it; the copy runs on
    assert NgramProposer(1, 2).propose([5, 6, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]
    assert NgramProposer(1, 1).propose([4, 4], 3) == [4, 4, 4]


def test_at_most_num_tokens_are_proposed() -> None:
    proposer = NgramProposer(1, 2)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2], 0) == []
    assert proposer.propose([1], 4) == []


@pytest.mark.parametrize(("ngram_min", "ngram_max"), [(0, 2), (3, 2)])
def test_bad_ngram_sizes_are_refused(ngram_min: int, ngram_max: int) -> None:
    with pytest.raises(ValueError, match="need 1 <= ngram_min <= ngram_max"):
        NgramProposer(ngram_min, ngram_max)


def test_make_proposer_follows_the_setting() -> None:
    assert make_proposer(SpeculativeConfig()) is None
    proposer = make_proposer(SpeculativeConfig(speculative="ngram", speculative_ngram_min=2, speculative_ngram_max=5))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.ngram_min, proposer.ngram_max) == (2, 5)
