"""Paged attention: write new K/V through the slot mapping, attend through block tables.

One small interface, ``AttentionBackend``: ``prepare(batch, block_size)`` turns a
``ForwardBatch`` into per-step metadata once (masks, decode block tables), and
``forward(q, k, v, key_cache, value_cache, metadata)`` runs one layer.
``select_backend`` picks flash-attn on CUDA where it can run (``flash_attention.py``)
and this module's torch backend otherwise; the torch backend runs on CPU and CUDA
with ``scaled_dot_product_attention``:

- decodes (query_len 1) are attended all at once: the K/V blocks of every decoding
  sequence are gathered through the block tables into ``[num_decodes, L, kv_heads, D]``
  (L = the longest decode context, rounded up to whole blocks) and positions past
  each sequence's context are masked; the query heads sharing one KV head become
  ``G`` query rows of that head (grouped-query attention without repeating K/V);
- prefill chunks are attended one sequence at a time over their varlen slice
  (no padding to the longest prompt), causally, offset by the tokens already cached:
  query ``i`` (position ``start + i``) sees keys ``0 .. start + i``.

Attention follows Vaswani et al. 2017; the paged layout follows vLLM
(Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from nanoserve.engine.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def prepare(self, batch: ForwardBatch, block_size: int) -> object:
        """Per-step metadata shared by every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: object,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        caches: [num_blocks, block_size, num_kv_heads, head_dim]. Writes k, v into the
        caches, returns [num_tokens, num_heads * head_dim]."""
        ...


@dataclass
class PrefillSlice:
    """One sequence with query_len > 1: rows ``token_start .. token_end`` of the batch."""

    token_start: int
    token_end: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks_for_context] int64
    mask: torch.Tensor | None  # [query_len, context_len] bool, None: plain causal from position 0


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_tokens: int
    decode_token_indices: torch.Tensor | None  # [num_decodes] int64; None: every token is a decode
    decode_block_tables: torch.Tensor | None  # [num_decodes, num_blocks_read] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, num_blocks_read * block_size] bool
    prefills: list[PrefillSlice] = field(default_factory=list)


class TorchAttentionBackend:
    """Paged attention in plain torch (CPU and CUDA)."""

    name = "torch-sdpa"

    def prepare(self, batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
        device = batch.input_ids.device
        decode_seq_ids = [i for i, q in enumerate(batch.query_lens) if q == 1]
        token_starts = [0] * batch.num_seqs
        for i in range(1, batch.num_seqs):
            token_starts[i] = token_starts[i - 1] + batch.query_lens[i - 1]
        metadata = TorchAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            num_tokens=batch.num_tokens,
            decode_token_indices=None,
            decode_block_tables=None,
            decode_mask=None,
        )
        if decode_seq_ids:
            context_lens = [batch.context_lens[i] for i in decode_seq_ids]
            num_blocks_read = -(-max(context_lens) // block_size)
            seq_index = torch.tensor(decode_seq_ids, dtype=torch.int64, device=device)
            tables = batch.block_tables.index_select(0, seq_index)[:, :num_blocks_read].long()
            lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
            key_positions = torch.arange(num_blocks_read * block_size, device=device)
            metadata.decode_block_tables = tables
            metadata.decode_mask = (key_positions[None, :] < lens[:, None])[:, None, None, :]
            if len(decode_seq_ids) != batch.num_tokens:
                rows = [token_starts[i] for i in decode_seq_ids]
                metadata.decode_token_indices = torch.tensor(rows, dtype=torch.int64, device=device)
        for i, query_len in enumerate(batch.query_lens):
            if query_len == 1:
                continue
            context_len = batch.context_lens[i]
            start = context_len - query_len
            num_blocks = -(-context_len // block_size)
            mask = None
            if start > 0:
                query_positions = torch.arange(start, context_len, device=device)
                mask = torch.arange(context_len, device=device)[None, :] <= query_positions[:, None]
            metadata.prefills.append(
                PrefillSlice(
                    token_start=token_starts[i],
                    token_end=token_starts[i] + query_len,
                    context_len=context_len,
                    block_ids=batch.block_tables[i, :num_blocks].long(),
                    mask=mask,
                )
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
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        scale = 1.0 / math.sqrt(head_dim)
        # Write this step's K/V first so every read below goes through the cache.
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)

        if metadata.decode_token_indices is None and not metadata.prefills:
            return self._decode(q, key_cache, value_cache, metadata, group, scale)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        if metadata.decode_block_tables is not None:
            rows = metadata.decode_token_indices
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), key_cache, value_cache, metadata, group, scale))
        for p in metadata.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        group: int,
        scale: float,
    ) -> torch.Tensor:
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        tables = metadata.decode_block_tables  # [B, nb]
        # [B * nb, block_size, Hkv, D] -> [B, Hkv, L, D]; index_select copies whole blocks,
        # 5x faster on CPU than advanced indexing with the 2-D table
        shape = (num_decodes, -1, num_kv_heads, head_dim)
        keys = key_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
        values = value_cache.index_select(0, tables.flatten()).view(shape).transpose(1, 2)
        queries = q.view(num_decodes, num_kv_heads, group, head_dim)  # G query rows per KV head
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=metadata.decode_mask, scale=scale)
        return out.reshape(num_decodes, num_heads * head_dim)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        p: PrefillSlice,
        scale: float,
    ) -> torch.Tensor:
        queries = q[p.token_start : p.token_end].transpose(0, 1)  # [H, T, D]
        if p.mask is None:  # the whole context is this chunk: use it as computed
            keys = k[p.token_start : p.token_end].transpose(0, 1)
            values = v[p.token_start : p.token_end].transpose(0, 1)
        else:  # earlier tokens live only in the cache
            keys = key_cache.index_select(0, p.block_ids).flatten(0, 1)[: p.context_len].transpose(0, 1)
            values = value_cache.index_select(0, p.block_ids).flatten(0, 1)[: p.context_len].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1).flatten(1)


def _flash_attn_version() -> tuple[int, ...] | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return tuple(int(part) for part in flash_attn.__version__.split(".")[:2] if part.isdigit())


def select_backend(device: torch.device, dtype: torch.dtype, block_size: int) -> tuple[AttentionBackend, str]:
    """The attention backend for this device, and why it was chosen (for the start-up log).

    flash-attn when on CUDA, importable (>= 2.6, paged KV), with fp16/bf16 and a
    block size that is a multiple of 256; the torch backend otherwise.
    """
    if device.type != "cuda":
        return TorchAttentionBackend(), f"device is {device.type}"
    version = _flash_attn_version()
    if version is None:
        return TorchAttentionBackend(), "flash-attn not installed (pip install 'nanoserve[cuda]')"
    if version < (2, 6):
        return TorchAttentionBackend(), f"flash-attn {version} predates paged KV (2.6)"
    if dtype not in (torch.float16, torch.bfloat16):
        return TorchAttentionBackend(), f"flash-attn needs float16/bfloat16, dtype is {dtype}"
    if block_size % 256:
        return TorchAttentionBackend(), f"flash-attn paged KV needs block_size % 256 == 0, block_size is {block_size}"
    from nanoserve.engine.flash_attention import FlashAttentionBackend

    return FlashAttentionBackend(), f"flash-attn {'.'.join(map(str, version))} importable on CUDA"
