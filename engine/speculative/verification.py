"""Verifying draft tokens: the rows the sampler draws each verified position from, and the accepted prefix.

A verify pass runs the model once over [last token, d_0, ..., d_{k-1}] and keeps the
logits of all k + 1 positions. Position i's row is sampled exactly as a plain decode
step would sample it had d_0 .. d_{i-1} been generated: same processed distribution
p_i (penalties, logit bias, min_tokens, temperature, top-k/top-p/min-p), same output
position, so the same counter-based uniform u_i (``engine/sampling/counter_rng.py``).
That target token t_i = inverse_cdf(p_i, u_i) decides:

    accept d_i  iff  t_i == d_i;  at the first i with t_i != d_i emit t_i and stop;
    all k accepted: emit t_k (the bonus token).

This is speculative sampling's rule (Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large
Language Model Decoding with Speculative Sampling", 2023) for a deterministic draft
(q one-hot on d_i): P(accept) = P(t_i == d_i) = p_i(d_i) = min(1, p_i(d_i) / q(d_i)),
and given a rejection, t_i is distributed as p_i with d_i removed and renormalised,
which is norm(max(0, p_i - q)). Coupling the accept test and the residual draw through
one uniform makes every emitted token the very token plain decoding draws at that
position, so a seeded request gives the same tokens with and without speculation,
and greedy rows (t_i = argmax) accept exactly the drafts that equal the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from nanoserve.allocator import FreeReason
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler, SamplerOutput, SamplingRow

if TYPE_CHECKING:
    from nanoserve.engine.core.request import Request


class DraftRow:
    """A request seen as if its first ``num_drafts`` drafts were generated: one ``SamplingRow``
    per verified position, so the sampler's output position, penalties and min_tokens
    count them (the request itself is not touched)."""

    __slots__ = ("_drafts", "_row")

    def __init__(self, row: SamplingRow, drafts: Sequence[int]) -> None:
        self._row = row
        self._drafts = list(drafts)

    @property
    def sampling_params(self) -> SamplingParams:
        return self._row.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._row.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._row.output_token_ids + self._drafts

    @property
    def seed(self) -> int:
        return self._row.seed

    @property
    def num_prior_output_tokens(self) -> int:
        return self._row.num_prior_output_tokens

    @property
    def min_tokens_banned_ids(self) -> list[int]:
        return self._row.min_tokens_banned_ids


def draft_rows(row: SamplingRow, drafts: Sequence[int]) -> list[DraftRow]:
    """The k + 1 sampling rows of a verify pass over ``drafts`` (k of them): row i as if
    ``drafts[:i]`` were generated."""
    return [DraftRow(row, drafts[:i]) for i in range(len(drafts) + 1)]


def accepted_tokens(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a verify pass emits: the drafts up to the first that differs from its
    target, then that target (or, all k accepted, the bonus target ``targets[k]``).

    drafts: k draft ids; targets: the k + 1 tokens sampled at the verified positions.
    Returns between 1 and k + 1 tokens. ValueError when len(targets) != k + 1.
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} targets for {len(drafts)} drafts, got {len(targets)}")
    tokens: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        tokens.append(target)
        if draft != target:
            return tokens
    tokens.append(targets[len(drafts)])
    return tokens


def sample_verified(
    sampler: Sampler, verified: Sequence[tuple[SamplingRow, Sequence[int], torch.Tensor]]
) -> list[SamplerOutput]:
    """Each verify pass's k + 1 targets, drawn in one sampler call over every verified position.

    verified: (the request, its k drafts, its logits ``[k + 1, vocab_size]``) per verify pass.
    """
    rows = [row for request, drafts, _ in verified for row in draft_rows(request, drafts)]
    result = sampler(torch.cat([logits for _, _, logits in verified]), rows)
    targets: list[SamplerOutput] = []
    first = 0
    for _, drafts, _ in verified:
        last = first + len(drafts) + 1
        targets.append(SamplerOutput(result.token_ids[first:last], result.logprobs[first:last]))
        first = last
    return targets


def append_accepted(request: Request, drafts: Sequence[int], targets: SamplerOutput) -> tuple[int, int]:
    """Appends the tokens a verify pass over ``drafts`` emits (``accepted_tokens``) to ``request`` one
    by one through its finish checks, stopping at the first that ends it; then its block table
    drops the slots past what is computed (blocks only rejected drafts needed are freed, reason
    REJECTED_DRAFT). Returns (tokens appended, drafts accepted).

    targets: the token sampled at each of the k + 1 verified positions, and its logprob.
    """
    assert request.sampling_params.num_samples == 1, f"parallel request {request.request_id!r} drafted"
    tokens = accepted_tokens(drafts, targets.token_ids)
    num_appended = 0
    for token_id, logprob in zip(tokens, targets.logprobs, strict=False):  # row i sampled tokens[i]
        request.append_token(token_id, logprob)
        num_appended += 1
        if request.finish_reason is not None:
            break
    # the last token and the drafts accepted have their KV now; the newest token has not
    request.num_computed_tokens += num_appended
    assert request.block_table is not None
    request.block_table.truncate(request.num_computed_tokens, FreeReason.REJECTED_DRAFT)
    return num_appended, min(num_appended, len(tokens) - 1)
