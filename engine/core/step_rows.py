"""``StepRows``: a step's chunks as one forward batch, and which rows of its logits serve what.

The forward pass returns logits only for the rows that need them (``SeqSlice``): the last
token of a chunk that reaches its request's newest token (to sample the next one), every
token of a chunk whose prompt logprobs were asked, and every position of a verify pass
(speculative decoding: the last token and its drafts). ``build_step_rows`` walks the
chunks once and records where each of those rows lands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.core.request import Request
from nanoserve.engine.core.scheduler import ScheduledChunk
from nanoserve.engine.model.forward_batch import SeqSlice


@dataclass
class StepRows:
    """Invariant: ``num_rows`` is the forward pass's logits rows; every index below is one of them."""

    slices: list[SeqSlice] = field(default_factory=list)  # one per chunk, in batch order
    sampled: list[Request] = field(default_factory=list)  # requests that sample a token, in row order
    sample_rows: list[int] = field(default_factory=list)  # the logits row of each of ``sampled``
    # (request, its first logits row, its chunk's start): the rows of its prompt logprobs
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)
    # (a decode with drafts, its first logits row): k + 1 rows from there
    verifying: list[tuple[ScheduledChunk, int]] = field(default_factory=list)
    num_rows: int = 0
    # (source, destination) blocks to copy before the pass: forked blocks copied on write
    copies: list[tuple[int, int]] = field(default_factory=list)


def build_step_rows(chunks: list[ScheduledChunk], now: float) -> StepRows:
    """The slices of ``chunks`` and their logits rows, and the blocks their tables copy on write
    (``BlockTable.take_copies``); stamps each request's first scheduled time (``now``, seconds of
    ``time.monotonic()``) on its first chunk."""
    rows = StepRows()
    for chunk in chunks:
        request = chunk.request
        assert request.block_table is not None
        rows.copies += request.block_table.take_copies()
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        end = chunk.start + chunk.num_new_tokens
        block_ids = request.block_table.block_ids
        if chunk.draft_token_ids:  # a verify pass: [last token, drafts], the logits of every position
            tokens = request.token_ids[chunk.start : end] + list(chunk.draft_token_ids)
            rows.slices.append(SeqSlice(tokens, chunk.start, block_ids, True, True, as_decodes=True))
            rows.verifying.append((chunk, rows.num_rows))
            rows.num_rows += len(tokens)
            continue
        all_logits = request.wants_prompt_logprobs(chunk.start, end)
        rows.slices.append(
            SeqSlice(request.token_ids[chunk.start : end], chunk.start, block_ids, chunk.needs_logits, all_logits)
        )
        if all_logits:
            rows.prompt_rows.append((request, rows.num_rows, chunk.start))
            rows.num_rows += chunk.num_new_tokens
        elif chunk.needs_logits:
            rows.num_rows += 1
        if chunk.needs_logits:
            rows.sampled.append(request)
            rows.sample_rows.append(rows.num_rows - 1)
    return rows
