"""Batched sampling: one call turns a step's logits into one token per sequence.

Every transform works on the whole [num_seqs, vocab_size] tensor with one
value per row; Python loops only gather per-request settings and draw the
random numbers of seeded requests from their own generators.

Order (as in vLLM): penalties on the raw logits, min_tokens masking, then
greedy rows take the argmax; the others are divided by their temperature and
truncated by top-k, top-p and min-p, and a token is drawn with the
exponential race (argmax of p / q, q ~ Exp(1), which draws from p exactly
like multinomial sampling but lets each row bring its own noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.engine.outputs import TokenLogprob
from nanoserve.engine.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads from one sequence."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # None: draw from the sampler's generator
    min_tokens_banned_ids: list[int]  # EOS / stop token ids blocked while min_tokens is not reached


@dataclass(frozen=True)
class SamplerOutput:
    """token_ids: one per row; logprobs: per row, None where not asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row of a logits batch.

    A row's result depends only on its own logits, settings and generator,
    never on the other rows: a seeded request gives the same tokens whatever
    shares its batch.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: [num_seqs, vocab_size] float32, row i belonging to rows[i]."""
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} sequences"
        params = [row.sampling_params for row in rows]
        raw_logits = logits
        logits = apply_penalties(logits, rows)
        logits = mask_min_tokens(logits, rows)
        token_ids = torch.argmax(logits, dim=-1)  # [num_seqs]
        if not all(p.greedy for p in params):
            probs = sampling_probs(logits, params)
            noise = self._exponential_noise(probs, rows)
            drawn = torch.argmax(probs / noise, dim=-1)
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            token_ids = torch.where(greedy, token_ids, drawn)
        return SamplerOutput(token_ids.tolist(), gather_logprobs(raw_logits, token_ids, params))

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # noise: [num_seqs, vocab_size], Exp(1); seeded rows draw from their own generator.
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for i, row in enumerate(rows):
            generator = row.generator
            if generator is None or row.sampling_params.greedy:
                continue
            if generator.device == noise.device:
                noise[i].exponential_(generator=generator)
            else:  # a CPU generator serving CUDA logits: same draws on every device
                noise[i].copy_(torch.empty(noise.shape[1], device=generator.device).exponential_(generator=generator))
        return noise.clamp_(min=1e-20)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties; returns a new tensor when any applies.

    logits: [num_seqs, vocab_size]. Repetition (CTRL): logits of tokens seen in
    prompt or output are divided by the penalty when positive, multiplied when
    negative. Presence / frequency (OpenAI): subtract presence * [count > 0] +
    frequency * count, counting generated tokens only.
    """
    params = [row.sampling_params for row in rows]
    has_repetition = any(p.repetition_penalty != 1.0 for p in params)
    has_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (has_repetition or has_additive):
        return logits
    vocab_size = logits.shape[1]
    output_counts = token_counts([row.output_token_ids for row in rows], vocab_size, logits.device)
    logits = logits.clone()
    if has_repetition:
        prompt_counts = token_counts([row.prompt_token_ids for row in rows], vocab_size, logits.device)
        seen = (prompt_counts + output_counts) > 0  # [num_seqs, vocab_size]
        penalty = _column([p.repetition_penalty for p in params], logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if has_additive:
        presence = _column([p.presence_penalty for p in params], logits)
        frequency = _column([p.frequency_penalty for p in params], logits)
        logits = logits - presence * (output_counts > 0) - frequency * output_counts
    return logits


def mask_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sets EOS / stop-token logits to -inf for rows below their min_tokens."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.sampling_params.min_tokens:
            row_index.extend([i] * len(row.min_tokens_banned_ids))
            token_index.extend(row.min_tokens_banned_ids)
    if not row_index:
        return logits
    logits = logits.clone()
    logits[torch.tensor(row_index, device=logits.device), torch.tensor(token_index, device=logits.device)] = float(
        "-inf"
    )
    return logits


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p; returns probabilities [num_seqs, vocab_size].

    Greedy rows (temperature 0) are scaled by 1 and their probabilities unused.
    """
    temperature = _column([p.temperature if not p.greedy else 1.0 for p in params], logits)
    logits = logits / temperature
    vocab_size = logits.shape[1]
    top_k = [p.top_k if p.top_k is not None else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        logits = truncate_top_k_top_p(logits, top_k, top_p)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        logits = truncate_min_p(logits, min_p)
    return torch.softmax(logits, dim=-1)


def truncate_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keeps each row's top_k most likely tokens, then its smallest nucleus of mass >= top_p.

    logits: [num_seqs, vocab_size]; dropped tokens get -inf. The most likely
    token is always kept.
    """
    sorted_logits, sorted_ids = torch.sort(logits, dim=-1, descending=True)  # [num_seqs, vocab_size]
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)  # [1, vocab_size]
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)  # [num_seqs, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
    p = _column(top_p, logits)
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, sorted_ids, sorted_logits)


def truncate_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = _column(min_p, logits) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Chosen-token logprob and the top-n alternatives for rows that asked for them."""
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return [None] * len(params)
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)  # [num_seqs, vocab_size]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = token_ids.tolist()
    max_n = max(n for n in wanted if n is not None)
    top_values, top_ids = (v.tolist() for v in torch.topk(logprobs, max(max_n, 1), dim=-1))
    result: list[TokenLogprob | None] = []
    for i, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        top = dict(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        result.append(TokenLogprob(chosen_ids[i], chosen[i], top))
    return result


def token_counts(sequences: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token id per sequence: [num_seqs, vocab_size] float32."""
    max_len = max((len(s) for s in sequences), default=0)
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    # Pad with vocab_size: a spare column that is dropped afterwards.
    padded = torch.tensor([s + [vocab_size] * (max_len - len(s)) for s in sequences], device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
