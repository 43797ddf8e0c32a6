"""The float32 CPU attention backend: decodes through nanoserve's paged decode kernel.

``CpuPagedAttentionBackend`` extends the torch backend of ``attention.py``: every decode of a
step (query_len 1) reads its K/V straight through its block table in the kernel
(``kernels/paged_attention.cpp``), with no gather, padding or mask; prefill chunks go through
SDPA as in the torch backend, unless batch invariance routes them through the kernel too.
``attention.select_backend`` picks it where the kernels load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoserve.engine.model import kernels
from nanoserve.engine.model.attention import TorchAttentionBackend, TorchAttentionMetadata, first_rows
from nanoserve.engine.model.forward_batch import ForwardBatch


@dataclass
class KernelDecodes:
    """Every decode of a step, for the paged decode kernel: no buckets, no gather, no mask."""

    token_indices: torch.Tensor  # [num_decodes] int64: their rows in the batch
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor  # [num_decodes] int32
    in_order: bool  # every token is a decode, in batch order: the kernel's output is the layer's


@dataclass
class CpuPagedAttentionMetadata(TorchAttentionMetadata):
    kernel_decodes: KernelDecodes | None = None


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Decodes by nanoserve's paged decode kernel (float32 CPU), prefills by SDPA as the torch backend.

    prefill_by_decode_kernel (batch invariance): every query row, prefill or decode, goes through the
    paged decode kernel as a decode at its own position (keys ``0 .. position``, read from the cache
    this step's K/V were just written to). A row's attention then depends only on its query, its
    position and the cached K/V, never on how its prompt was chunked, whether its prefix came from
    the prefix cache or a recompute, or what else is in the batch: the kernel reduces each row over
    its keys in one fixed order, the same one a later decode of that row would use.
    """

    name = "cpu-paged"

    def __init__(self, prefill_by_decode_kernel: bool = False) -> None:
        self.prefill_by_decode_kernel = prefill_by_decode_kernel

    def prepare(self, batch: ForwardBatch, block_size: int) -> CpuPagedAttentionMetadata:
        metadata = CpuPagedAttentionMetadata(slot_mapping=batch.slot_mapping, num_tokens=batch.num_tokens)
        if self.prefill_by_decode_kernel and any(q != 1 for q in batch.query_lens):
            query_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
            metadata.kernel_decodes = KernelDecodes(
                token_indices=torch.arange(batch.num_tokens, dtype=torch.int64),
                # [num_tokens, max_blocks]: each row its sequence's table, keys up to its own position
                block_tables=batch.block_tables.repeat_interleave(query_lens, dim=0).to(torch.int32),
                context_lens=(batch.positions + 1).to(torch.int32),
                in_order=True,
            )
            return metadata
        token_starts = first_rows(batch.query_lens)
        self._prepare_prefills(batch, block_size, token_starts, metadata)
        if any(batch.as_decodes):  # verify passes: every row a decode at its own position, not SDPA
            flagged = {token_starts[i] for i, as_decodes in enumerate(batch.as_decodes) if as_decodes}
            metadata.prefills = [p for p in metadata.prefills if p.token_start not in flagged]
        # (sequence, first row, query rows) of every row the kernel attends as a decode
        decode_seqs = [
            (i, token_starts[i], q)
            for i, q in enumerate(batch.query_lens)
            if q == 1 or batch.as_decodes[i : i + 1] == [True]
        ]
        if decode_seqs:
            rows = [start + j for _, start, q in decode_seqs for j in range(q)]
            seq_of_row = torch.tensor([i for i, _, q in decode_seqs for _ in range(q)], dtype=torch.int64)
            metadata.kernel_decodes = KernelDecodes(
                token_indices=torch.tensor(rows, dtype=torch.int64),
                block_tables=batch.block_tables.index_select(0, seq_of_row).to(torch.int32),
                # a row sees the keys up to its own position
                context_lens=(batch.positions[rows] + 1).to(torch.int32),
                in_order=len(rows) == batch.num_tokens,
            )
        return metadata

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(metadata, CpuPagedAttentionMetadata)
        num_tokens, num_heads, head_dim = q.shape
        decodes, scale = metadata.kernel_decodes, 1.0 / math.sqrt(head_dim)
        if decodes is not None and decodes.in_order:
            return kernels.paged_decode_attention(
                q, key_cache, value_cache, decodes.block_tables, decodes.context_lens, scale
            )
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        if decodes is not None:
            queries = q.index_select(0, decodes.token_indices)
            attended = kernels.paged_decode_attention(
                queries, key_cache, value_cache, decodes.block_tables, decodes.context_lens, scale
            )
            out.index_copy_(0, decodes.token_indices, attended)
        for p in metadata.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
        return out
