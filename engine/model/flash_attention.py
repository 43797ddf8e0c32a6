"""flash-attn (Dao 2023, "FlashAttention-2") as an ``AttentionBackend`` for CUDA.

Optional: installed with ``pip install 'nanoserve[cuda]'`` and chosen by
``attention.select_backend`` only where it can run. This module imports
without flash-attn (the kernel is imported on first use), so its metadata
is tested on CPU-only machines.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.engine.model.forward_batch import ForwardBatch


@dataclass
class FlashAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, start row of each sequence's queries
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32, running sum of context lengths
    max_query_len: int
    max_context_len: int
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32


class FlashAttentionBackend:
    """flash-attn 2.6+ on CUDA: one varlen call with a block table covers prefill and decode.

    ``flash_attn_varlen_func(..., block_table=...)`` reads K/V straight from the
    paged cache, and its causal mask is aligned bottom-right, which is exactly
    "query i at position start + i sees keys 0 .. start + i". flash-attn requires
    fp16/bf16 and a block size that is a multiple of 256; ``select_backend`` checks both.
    The model has written this step's K/V into the cache before ``forward`` (``write_kv``).
    Not exercised by the test suite on CPU-only machines (``prepare`` is).
    """

    name = "flash-attn"

    def __init__(self) -> None:
        self._varlen: Callable[..., torch.Tensor] | None = None  # flash_attn_varlen_func, imported on first use

    def prepare(self, batch: ForwardBatch, block_size: int) -> FlashAttentionMetadata:
        device = batch.input_ids.device
        cu_q = [0]
        cu_k = [0]
        for query_len, context_len in zip(batch.query_lens, batch.context_lens, strict=True):
            cu_q.append(cu_q[-1] + query_len)
            cu_k.append(cu_k[-1] + context_len)
        return FlashAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            max_query_len=max(batch.query_lens),
            max_context_len=max(batch.context_lens),
            block_tables=batch.block_tables,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: FlashAttentionMetadata,
    ) -> torch.Tensor:
        varlen = self._varlen
        if varlen is None:
            from flash_attn import flash_attn_varlen_func

            varlen = self._varlen = flash_attn_varlen_func
        num_tokens, num_heads, head_dim = q.shape
        out = varlen(
            q,
            key_cache,
            value_cache,
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_query_len,
            metadata.max_context_len,
            softmax_scale=1.0 / math.sqrt(head_dim),
            causal=True,
            block_table=metadata.block_tables,
        )  # [T, H, D]
        return out.reshape(num_tokens, num_heads * head_dim)
