"""One scheduled step packed for the model: sequences back to back, no padding.

A step mixes prefill chunks (several new tokens of one sequence, possibly
starting mid-prompt when the prompt is prefilled in chunks) and decodes (one new
token). Every new token gets a position and a slot in the paged KV cache
(``slot = block_id * block_size + offset``), where its K and V are written before
attention reads the whole context back through the sequence's block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.allocator import cdiv


@dataclass(frozen=True)
class SeqSlice:
    """The new tokens of one sequence in this step.

    token_ids: the tokens at positions ``start_position .. start_position + len - 1``.
    start_position: tokens of this sequence already in the KV cache.
    block_ids: the sequence's whole block table, big enough for
        ``start_position + len(token_ids)`` tokens.
    needs_logits: whether the logits of the last new token are wanted (False for
        a prefill chunk that does not end the prompt).
    """

    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_logits: bool = True


@dataclass
class ForwardBatch:
    """Tensors of one forward pass; sequences keep the order they were given in.

    input_ids: [num_tokens] int64, the new tokens of every sequence, packed.
    positions: [num_tokens] int64, each token's position in its sequence.
    slot_mapping: [num_tokens] int64, each token's KV-cache slot.
    query_lens: [num_seqs], new tokens per sequence.
    context_lens: [num_seqs], tokens in the KV cache after this step
        (``start_position + query_len``).
    block_tables: [num_seqs, max_num_blocks] int32, padded with 0 past each
        sequence's blocks (never read: attention masks by ``context_lens``).
    logits_indices: [num_logits] int64, rows of the packed tokens whose logits
        are returned (the last token of each sequence with ``needs_logits``).
    start_positions: [num_seqs], ``context_lens - query_lens``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    start_positions: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(cls, seqs: list[SeqSlice], block_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
        """Pack ``seqs`` into one batch on ``device``.

        Raises ValueError for an empty batch, a sequence with no new tokens, a
        negative start position, or a block table too small for its context.
        """
        if not seqs:
            raise ValueError("seqs must hold at least one sequence")
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        for i, seq in enumerate(seqs):
            num_new = len(seq.token_ids)
            if num_new == 0:
                raise ValueError(f"seqs[{i}].token_ids must not be empty")
            if seq.start_position < 0:
                raise ValueError(f"seqs[{i}].start_position must be >= 0, got {seq.start_position}")
            context_len = seq.start_position + num_new
            num_blocks_needed = cdiv(context_len, block_size)
            if len(seq.block_ids) < num_blocks_needed:
                raise ValueError(
                    f"seqs[{i}].block_ids holds {len(seq.block_ids)} blocks, "
                    f"{num_blocks_needed} needed for {context_len} tokens of block_size {block_size}"
                )
            input_ids.extend(seq.token_ids)
            for pos in range(seq.start_position, context_len):
                positions.append(pos)
                slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            query_lens.append(num_new)
            context_lens.append(context_len)
            if seq.needs_logits:
                logits_indices.append(len(input_ids) - 1)
        max_num_blocks = max(len(seq.block_ids) for seq in seqs)
        table = [seq.block_ids + [0] * (max_num_blocks - len(seq.block_ids)) for seq in seqs]

        def as_tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            input_ids=as_tensor(input_ids, torch.int64),
            positions=as_tensor(positions, torch.int64),
            slot_mapping=as_tensor(slots, torch.int64),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=as_tensor(table, torch.int32),
            logits_indices=as_tensor(logits_indices, torch.int64),
            start_positions=[c - q for c, q in zip(context_lens, query_lens, strict=True)],
        )
