"""One scheduled step packed for the model: sequences back to back, no padding.

A step mixes prefill chunks (several new tokens of one sequence, possibly
starting mid-prompt when the prompt is prefilled in chunks) and decodes (one new
token). Every new token gets a position and a slot in the paged KV cache
(``slot = block_id * block_size + offset``), where its K and V are written before
attention reads the whole context back through the sequence's block table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
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
    all_logits: the logits of every new token are wanted, in order (prompt
        logprobs); the last one's row is then also the sampling row when
        ``needs_logits``.
    as_decodes: each new token attends as a decode at its own position would, where the
        attention backend has a decode path of its own (the float32 CPU kernel): a speculative
        verify pass then gets the logits plain decoding gets, not a prefill's.
    """

    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    needs_logits: bool = True
    all_logits: bool = False
    as_decodes: bool = False


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
        are returned (the last token of each sequence with ``needs_logits``;
        every token of one with ``all_logits``).
    start_positions: [num_seqs], ``context_lens - query_lens``.
    as_decodes: [num_seqs], ``SeqSlice.as_decodes`` (empty: none).

    input_ids, positions, slot_mapping and logits_indices are views of one int64
    array, made in one conversion from Python ints (and one copy to a device)
    instead of four: a decode step's tensors are a few hundred bytes, and making
    them is what costs. Nothing writes into them.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    start_positions: list[int]
    as_decodes: list[bool] = field(default_factory=list)

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
        num_seqs = len(seqs)
        # one flat list of ints -> one int64 array; the int64 fields are views of it:
        # [input_ids | positions | slots | logits_indices], each [num_tokens] but the last
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        start_positions: list[int] = []
        logits_indices: list[int] = []
        max_num_blocks = 0
        for i, seq in enumerate(seqs):
            start = seq.start_position
            num_new = len(seq.token_ids)
            if num_new == 0:
                raise ValueError(f"seqs[{i}].token_ids must not be empty")
            if start < 0:
                raise ValueError(f"seqs[{i}].start_position must be >= 0, got {start}")
            context_len = start + num_new
            block_ids = seq.block_ids
            if len(block_ids) * block_size < context_len:  # fewer than cdiv(context_len, block_size) blocks
                raise ValueError(
                    f"seqs[{i}].block_ids holds {len(block_ids)} blocks, "
                    f"{cdiv(context_len, block_size)} needed for {context_len} tokens of block_size {block_size}"
                )
            max_num_blocks = max(max_num_blocks, len(block_ids))
            input_ids += seq.token_ids
            if num_new == 1:  # a decode
                positions.append(start)
                slots.append(block_ids[start // block_size] * block_size + start % block_size)
            else:
                positions += range(start, context_len)
                slots += [block_ids[pos // block_size] * block_size + pos % block_size for pos in positions[-num_new:]]
            query_lens.append(num_new)
            context_lens.append(context_len)
            start_positions.append(start)
            if seq.all_logits:
                logits_indices += range(len(input_ids) - num_new, len(input_ids))
            elif seq.needs_logits:
                logits_indices.append(len(input_ids) - 1)
        num_tokens = len(input_ids)
        packed = np.array(input_ids + positions + slots + logits_indices, dtype=np.int64)
        if num_seqs == 1 or all(len(seq.block_ids) == max_num_blocks for seq in seqs):
            table = np.array([seq.block_ids for seq in seqs], dtype=np.int32)
        else:
            table = np.array([seq.block_ids + [0] * (max_num_blocks - len(seq.block_ids)) for seq in seqs], np.int32)
        ids, pos, slot_mapping, logits_rows = _int64_fields(packed, num_tokens, device)
        return cls(
            input_ids=ids,
            positions=pos,
            slot_mapping=slot_mapping,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.from_numpy(table).to(device, non_blocking=True),
            logits_indices=logits_rows,
            start_positions=start_positions,
            as_decodes=[seq.as_decodes for seq in seqs],
        )


def _int64_fields(packed: np.ndarray, num_tokens: int, device: torch.device | str) -> list[torch.Tensor]:
    """``packed`` = [input_ids | positions | slots | logits_indices] -> the four tensors on ``device``.

    On the CPU they are views of the array itself (no copy); elsewhere the array
    goes over in one copy and is split there.
    """
    if torch.device(device).type == "cpu":
        bounds = (0, num_tokens, 2 * num_tokens, 3 * num_tokens, len(packed))
        return [torch.from_numpy(packed[start:end]) for start, end in itertools.pairwise(bounds)]
    sizes = [num_tokens, num_tokens, num_tokens, len(packed) - 3 * num_tokens]
    return list(torch.from_numpy(packed).to(device, non_blocking=True).split(sizes))
