"""Batched sampling: one call turns a step's logits into one token per sequence.

Every transform works on the whole [num_seqs, vocab_size] tensor with one
value per row; Python loops only gather per-request settings.

Order (as in vLLM): the grammar mask of structured-output rows (disallowed
tokens to -inf, ``token_mask``), penalties on the raw logits, min_tokens masking, then
greedy rows (temperature 0, or below ``MIN_SAMPLING_TEMPERATURE``) take the
argmax; the others are shifted by their largest logit, divided by their
temperature, truncated by top-k, top-p and min-p, and drawn by inverse
transform sampling. A batch whose rows are all greedy and ask for nothing
else (no penalty, no pending min_tokens, no logprobs) skips all of that: numpy
reads each row's argmax in place (``argmax_rows``), the same first-index
tie-breaking as ``torch.argmax``, and only a row whose largest logit is not
finite sends the batch down the general path.

The draw: each sampled row gets one uniform ``u`` in [0, 1) from its seed and
output position (``counter_rng``: SplitMix64 read at a position), and takes the
token ``t`` with ``cdf(t - 1) <= u * cdf(V - 1) < cdf(t)``, the cumulative
probabilities running in token-id order (Devroye, "Non-Uniform Random Variate
Generation", 1986, ch. II.2). So a row's token depends only on its own logits,
settings, seed and position: not on the rest of the batch, nor on what the
request went through before (preemption and recompute, a restart). One random
number per row instead of one per vocabulary entry; the cumulative sum is
taken in two levels (float32 sums of 256-token chunks, then float64 running
sums of the chunk sums and of the chosen chunk) so that a 49152-token row is
not scanned in float64.

Numerics: whatever the parameters that ``SamplingParams`` accepts, no NaN or
inf reaches the draw. NaN logits become -inf and +inf logits the largest
float32; a repetition penalty's quotient is clamped to the finite range; each
row is shifted so that its largest logit is 0 before the temperature divides
it, so tiny temperatures give -inf (probability 0), never +inf. A row without
a finite logit is drawn uniformly (greedy: token 0). Tokens with probability 0
are never drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.engine.core.outputs import TokenLogprob
from nanoserve.engine.sampling.counter_rng import uniforms
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.token_mask import TokenMask, apply_token_mask

CDF_CHUNK_SIZE = 256  # tokens per chunk of the two-level cumulative sum


class SamplingRow(Protocol):
    """What the sampler reads from one sequence."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def seed(self) -> int:
        """The request's effective seed, in [-2**63, 2**63)."""
        ...

    @property
    def num_prior_output_tokens(self) -> int:
        """The last ones of prompt_token_ids, generated before this admission (a resumed request)."""
        ...

    @property
    def min_tokens_banned_ids(self) -> list[int]:
        """EOS / stop token ids blocked while min_tokens is not reached."""
        ...


@dataclass(frozen=True)
class SamplerOutput:
    """token_ids: one per row; logprobs: per row, None where not asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row of a logits batch.

    A row's token depends only on its own logits, settings, seed and output
    position, never on the other rows or on earlier calls: the sampler holds
    no state.
    """

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """logits: [num_seqs, vocab_size] float32, row i belonging to rows[i].

        token_mask: the allowed tokens of the constrained rows (structured
        outputs), applied before every other transform; such a row's token is
        always one its mask allows (when it allows any).
        """
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} sequences"
        raw_logits = logits
        if token_mask is not None:
            raw_logits = finite_logits(logits)  # logprobs stay the model's own distribution
            # the runner's logits are this call's to change; a copy only where logprobs read them unmasked
            in_place = all(row.sampling_params.logprobs is None for row in rows)
            logits = apply_token_mask(raw_logits, token_mask, in_place=in_place)
        if only_argmax(rows):
            argmax_ids = argmax_rows(logits)
            if argmax_ids is not None:
                return SamplerOutput(argmax_ids, [None] * len(rows))
        params = [row.sampling_params for row in rows]
        logits = finite_logits(logits)
        if token_mask is None:
            raw_logits = logits
        logits = apply_penalties(logits, rows)
        logits = apply_logit_bias(logits, params)
        banned = mask_min_tokens(logits, rows)
        if token_mask is not None and banned is not logits:  # min_tokens may have banned a row's only allowed tokens
            banned = apply_token_mask(banned, token_mask)
        logits = banned
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if len(drawn) == len(rows):
            token_ids = draw(logits, rows)  # [num_seqs]
        else:
            token_ids = torch.argmax(logits, dim=-1)  # [num_seqs]; greedy rows keep it
            if drawn:
                index = torch.tensor(drawn, device=logits.device)
                token_ids[index] = draw(logits.index_select(0, index), [rows[i] for i in drawn])
        return SamplerOutput(token_ids.tolist(), gather_logprobs(raw_logits, token_ids, params))


def only_argmax(rows: Sequence[SamplingRow]) -> bool:
    """Every row is greedy and nothing but the argmax is asked for: no penalty, no
    pending min_tokens, no logprobs. Then the token of a row whose largest logit is
    finite is its argmax, before and after ``finite_logits`` alike."""
    for row in rows:
        p = row.sampling_params
        if (
            not p.greedy
            or p.logprobs is not None
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.logit_bias
            or len(row.output_token_ids) < p.min_tokens
        ):
            return False
    return True


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax by numpy: [num_seqs, vocab_size] float32 on the CPU -> num_seqs token ids.

    The first index of the largest value, as ``torch.argmax``; None (the caller
    takes the general path) when a row's largest value is not finite (a NaN,
    +inf or a row all -inf), or the logits are not float32 on the CPU. numpy
    reads the tensor's memory in place in one vectorised pass per row, where
    the general path makes two passes with torch (a finiteness check, then the
    argmax) and torch's argmax is the slower: in a decode step of the default
    model (bench/step_overhead.py), ~0.6 ms against ~3.4 at 64 rows.
    """
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return None
    values = logits.numpy()  # [num_seqs, vocab_size], shares memory
    token_ids: list[int] = values.argmax(axis=1).tolist()  # a NaN counts as largest, so it lands on one
    # a Python loop over the chosen values: fewer numpy calls than a gather, and each
    # numpy call costs tens of µs right after the model's forward has evicted the caches
    for row, token_id in enumerate(token_ids):
        if not math.isfinite(values[row, token_id]):
            return None
    return token_ids


def draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row by inverse transform sampling: [n, vocab_size] -> [n] int64.

    logits: after penalties and masking; every row samples (none greedy).
    """
    probs = sampling_probs(logits, [row.sampling_params for row in rows])
    seeds = torch.tensor([row.seed for row in rows], dtype=torch.int64)
    positions = torch.tensor([output_position(row) for row in rows], dtype=torch.int64)
    # Drawn on the CPU whatever the logits' device: the same numbers everywhere.
    u = uniforms(seeds, positions).to(probs.device)  # [n] float64
    return inverse_cdf(probs, u)


def output_position(row: SamplingRow) -> int:
    """Index of the token being sampled among all the request's generated tokens (0 for the first)."""
    return row.num_prior_output_tokens + len(row.output_token_ids)


def generated_token_ids(row: SamplingRow) -> list[int]:
    """Every token the request generated: the prior ones at the end of the prompt, then this admission's."""
    num_prompt = len(row.prompt_token_ids) - row.num_prior_output_tokens
    return row.prompt_token_ids[num_prompt:] + row.output_token_ids


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf and +inf -> the largest finite value; a row with no finite logit left -> all 0.

    logits: [num_seqs, vocab_size]. Returns ``logits`` itself when every row's
    max is finite: one reduction tells, as a max is NaN or +inf exactly when
    its row holds one, and -inf only when the whole row is -inf. A row of
    zeros is uniform: drawn uniformly, token 0 for greedy, logprobs -log(vocab_size).
    """
    if bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return logits
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
    no_mass = logits.amax(dim=-1, keepdim=True) == float("-inf")  # [num_seqs, 1]
    return logits.masked_fill(no_mass, 0.0)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties; returns a new tensor when any applies.

    logits: [num_seqs, vocab_size]. Repetition (CTRL): logits of tokens seen in
    prompt or output are divided by the penalty when positive, multiplied when
    negative; a quotient past the largest float is clamped to it. Presence /
    frequency (OpenAI): subtract presence * [count > 0] + frequency * count,
    counting generated tokens only (a resumed request's prior ones included).
    """
    params = [row.sampling_params for row in rows]
    has_repetition = any(p.repetition_penalty != 1.0 for p in params)
    has_additive = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (has_repetition or has_additive):
        return logits
    vocab_size = logits.shape[1]
    output_counts = token_counts([generated_token_ids(row) for row in rows], vocab_size, logits.device)
    logits = logits.clone()
    if has_repetition:
        prompt_counts = token_counts([row.prompt_token_ids for row in rows], vocab_size, logits.device)
        seen = (prompt_counts + output_counts) > 0  # [num_seqs, vocab_size]
        penalty = _column([p.repetition_penalty for p in params], logits)
        # penalty is finite and > 0: a tiny one overflows the quotient (clamped), never gives NaN
        quotient = (logits / penalty).clamp_(max=torch.finfo(logits.dtype).max)
        penalized = torch.where(logits > 0, quotient, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if has_additive:
        presence = _column([p.presence_penalty for p in params], logits)
        frequency = _column([p.frequency_penalty for p in params], logits)
        logits = logits - presence * (output_counts > 0) - frequency * output_counts
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Adds each row's ``logit_bias`` (token id -> bias in [-100, 100]) to its logits (OpenAI's
    meaning); returns a new tensor when any row has one. logits: [num_seqs, vocab_size]."""
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            row_index.append(i)
            token_index.append(token_id)
            biases.append(bias)
    if not row_index:
        return logits
    logits = logits.clone()
    rows_t = torch.tensor(row_index, device=logits.device)
    tokens_t = torch.tensor(token_index, device=logits.device)
    logits[rows_t, tokens_t] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
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

    logits: [num_seqs, vocab_size], no NaN or +inf (``finite_logits``). Each row
    is shifted so that its largest logit is 0, then divided by its temperature:
    every value lands in [-inf, 0] whatever the temperature, and the softmax
    never sees inf - inf. Greedy rows are scaled by 1 and their probabilities
    unused.
    """
    vocab_size = logits.shape[1]
    temperature = _column([1.0 if p.greedy else p.temperature for p in params], logits)
    row_max = logits.amax(dim=-1, keepdim=True)  # [num_seqs, 1]
    no_mass = row_max == float("-inf")  # min_tokens banned every token left: drawn uniformly
    if bool(no_mass.any()):
        logits = logits.masked_fill(no_mass, 0.0)
        row_max = row_max.masked_fill(no_mass, 0.0)
    logits = torch.sub(logits, row_max).div_(temperature)
    top_k = [min(p.top_k, vocab_size) if p.top_k is not None else vocab_size for p in params]
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


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token t with cdf(t - 1) <= u * total < cdf(t), cdf in token-id order.

    probs: [n, vocab_size] >= 0 with mass in every row (need not sum to 1);
    u: [n] float64 in [0, 1). Returns [n] int64. A token without mass is never
    returned. Two levels: float32 sums of CDF_CHUNK_SIZE-token chunks, whose
    float64 running sum picks the chunk; a float64 running sum of that chunk
    picks the token.
    """
    num_rows, vocab_size = probs.shape
    num_full = vocab_size // CDF_CHUNK_SIZE
    chunk_sums = []  # [n, num_chunks] float32 in pieces
    if num_full:
        full = probs[:, : num_full * CDF_CHUNK_SIZE].view(num_rows, num_full, CDF_CHUNK_SIZE)
        chunk_sums.append(full.sum(dim=-1))
    if vocab_size % CDF_CHUNK_SIZE:
        chunk_sums.append(probs[:, num_full * CDF_CHUNK_SIZE :].sum(dim=-1, keepdim=True))
    chunk_cdf = torch.cumsum(torch.cat(chunk_sums, dim=1), dim=-1, dtype=torch.float64)  # [n, num_chunks]
    target = u.unsqueeze(1) * chunk_cdf[:, -1:]  # [n, 1]
    chunk = _search(chunk_cdf, target)  # [n, 1]
    mass_before = chunk_cdf.gather(1, (chunk - 1).clamp_(min=0)).masked_fill_(chunk == 0, 0.0)  # [n, 1]
    columns = chunk * CDF_CHUNK_SIZE + torch.arange(CDF_CHUNK_SIZE, device=probs.device)  # [n, CDF_CHUNK_SIZE]
    chunk_probs = probs.gather(1, columns.clamp(max=vocab_size - 1)).masked_fill_(columns >= vocab_size, 0.0)
    cdf = torch.cumsum(chunk_probs, dim=-1, dtype=torch.float64).add_(mass_before)  # [n, CDF_CHUNK_SIZE]
    return (chunk * CDF_CHUNK_SIZE + _search(cdf, target)).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cdf exceeds target, at most the last index that adds mass.

    cdf: [n, m] non-decreasing; target: [n, 1]. The bound keeps a target that
    rounding put at or past the row's total on a token with mass.
    """
    index = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())  # first index reaching the row's total
    return torch.minimum(index, last)


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Chosen-token logprob and the top-n alternatives for rows that asked for them.

    Of the model's own distribution (log-softmax of ``raw_logits``: before
    penalties, temperature and truncation, as vLLM's default). Finite for finite
    logits; a token whose logit is -inf has logprob -inf.
    """
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


def prompt_token_logprobs(raw_logits: torch.Tensor, next_ids: list[int], num_top: int) -> list[TokenLogprob]:
    """Each prompt token's logprob given the tokens before it, and the ``num_top`` most likely there.

    raw_logits: [k, vocab_size], row i the logits at the position before next_ids[i] (from the prefill).
    """
    token_ids = torch.tensor(next_ids, dtype=torch.int64, device=raw_logits.device)
    params = SamplingParams(logprobs=num_top)
    return [entry for entry in gather_logprobs(raw_logits, token_ids, [params] * len(next_ids)) if entry is not None]


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
