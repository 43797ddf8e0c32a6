"""Paged attention: attend through block tables to the K/V the model wrote through the slot mapping.

One small interface, ``AttentionBackend``: ``prepare(batch, block_size)`` turns a
``ForwardBatch`` into per-step metadata once (masks, decode block tables, the slot
mapping), and ``forward(q, k, v, key_cache, value_cache, metadata)`` runs one layer.
Backends only read the caches: the model writes each layer's new K/V into their slots
before it calls ``forward`` (``write_kv`` here, or its fused rope kernel on a float32
CPU model), one writer for every backend.
``select_backend`` picks flash-attn on CUDA where it can run (``flash_attention.py``),
``CpuPagedAttentionBackend`` on a float32 CPU model where nanoserve's kernels load
(decodes read K/V straight through the block tables, ``kernels/paged_attention.cpp``;
``cpu_paged_attention.py``),
and this module's torch backend otherwise; the torch backend runs on CPU and CUDA
with ``scaled_dot_product_attention``:

- decodes (query_len 1) are sorted by context length into at most
  ``MAX_DECODE_BUCKETS`` buckets, chosen once per step in ``prepare`` to minimise the
  padded keys read; each bucket is attended at once: its sequences' K/V blocks are
  gathered through the block tables into ``[bucket_size, L, kv_heads, D]`` (L = the
  bucket's longest context, rounded up to whole blocks) and positions past each
  sequence's context are masked; the query heads sharing one KV head become ``G``
  query rows of that head (grouped-query attention without repeating K/V);
- prefill chunks are attended one sequence at a time over their varlen slice
  (no padding to the longest prompt), causally, offset by the tokens already cached:
  query ``i`` (position ``start + i``) sees keys ``0 .. start + i``.

Attention follows Vaswani et al. 2017; the paged layout follows vLLM
(Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F

from nanoserve.allocator import cdiv
from nanoserve.engine.model import kernels
from nanoserve.engine.model.forward_batch import ForwardBatch


class AttentionMetadata(Protocol):
    """What every backend's per-step metadata carries for the model: where the new K/V go."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: each new token's cache slot


# the per-step metadata type of one backend: what its prepare makes and its forward reads
MetadataT = TypeVar("MetadataT", bound=AttentionMetadata)


class AttentionBackend(Protocol[MetadataT]):
    """What the model needs from an attention implementation."""

    name: str

    def prepare(self, batch: ForwardBatch, block_size: int) -> MetadataT:
        """Per-step metadata shared by every layer."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: MetadataT,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        caches: [num_blocks, block_size, num_kv_heads, head_dim], k and v already written
        at ``metadata.slot_mapping`` (by the model; backends do not write). Returns
        [num_tokens, num_heads * head_dim]."""
        ...


@dataclass
class PrefillSlice:
    """One sequence with query_len > 1: rows ``token_start .. token_end`` of the batch."""

    token_start: int
    token_end: int
    context_len: int
    block_ids: torch.Tensor  # [num_blocks_for_context] int64
    mask: torch.Tensor | None  # [query_len, context_len] bool, None: plain causal from position 0
    # the mask as SDPA adds it (0 / -inf, the queries' dtype), made at the first layer and reused by the
    # others: SDPA converts a bool mask on every call, which doubled the time of a prefill that starts
    # mid-sequence (a chunk, or the tail after a prefix-cache hit) on CPU
    additive_mask: torch.Tensor | None = None


@dataclass
class DecodeBucket:
    """Decoding sequences attended together, padded to the longest context among them.

    Keys are read up to ``num_keys`` (the longest context), so a bucket whose contexts
    are all equal (a single sequence always) needs no mask.
    """

    token_indices: torch.Tensor  # [bucket_size] int64: their rows in the batch
    block_ids: torch.Tensor  # [bucket_size * num_blocks_read] int64: block tables, row-major
    mask: torch.Tensor | None  # [bucket_size, 1, 1, num_keys] bool; None: every context is num_keys long
    num_keys: int = 0  # the longest context in the bucket
    # the mask as SDPA adds it (0 / -inf, the queries' dtype), made at the first layer and reused
    additive_mask: torch.Tensor | None = None


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_tokens: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSlice] = field(default_factory=list)
    # every token is a decode and one bucket holds them in batch order: its output is the
    # layer's output as it is, no row gather or scatter
    decode_only_in_order: bool = False


def write_kv(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """This step's K/V [num_tokens, num_kv_heads, head_dim] into their slots, before any read of the cache.

    K and V are cast to the cache's dtype (rounded to nearest even when it is narrower).
    The model's unfused path calls it per layer; ``kernels.rope_and_write_kv`` does the same
    writes for a float32 CPU model.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [.., head_dim] as a cache of ``cache_dtype`` holds it, in x's dtype: x itself when the
    dtypes agree, else rounded to the cache's dtype and back. Prefill attends over this
    chunk's K/V as computed; this makes it read what decode will later read from the cache
    (and what a prefix-cache hit or a recompute after preemption reads)."""
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)


MAX_DECODE_BUCKETS = 4
# A bucket costs a fixed amount (an index_select and an SDPA call per layer); counted as
# this many blocks of padding, so a split must save more than that to be made.
BUCKET_COST_BLOCKS = 16


def bucket_by_num_blocks(num_blocks: list[int], max_buckets: int, bucket_cost: int) -> list[int]:
    """Split sorted block counts into at most ``max_buckets`` contiguous runs.

    num_blocks: blocks each decode reads, ascending. Minimises
    ``sum(run_size * run_max) + bucket_cost * num_runs`` (blocks gathered plus the fixed
    cost of each bucket) by dynamic programming over the distinct block counts.
    Returns the exclusive end index of each run, ascending; the last is ``len(num_blocks)``.
    """
    ends = [i + 1 for i in range(len(num_blocks)) if i + 1 == len(num_blocks) or num_blocks[i + 1] != num_blocks[i]]
    n = len(ends)
    inf = float("inf")
    # best[k][j]: least cost covering the first ends[j - 1] decodes with k runs; j = 0 is empty
    best = [[inf] * (n + 1) for _ in range(max_buckets + 1)]
    choice = [[0] * (n + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0
    for k in range(1, max_buckets + 1):
        for j in range(1, n + 1):
            run_max = num_blocks[ends[j - 1] - 1]
            for i in range(j):
                start = ends[i - 1] if i else 0
                cost = best[k - 1][i] + (ends[j - 1] - start) * run_max + bucket_cost
                if cost < best[k][j]:
                    best[k][j], choice[k][j] = cost, i
    k = min(range(1, max_buckets + 1), key=lambda k: best[k][n])
    cuts, j = [], n
    while j:
        cuts.append(ends[j - 1])
        j = choice[k][j]
        k -= 1
    return cuts[::-1]


class TorchAttentionBackend:
    """Paged attention in plain torch (CPU and CUDA)."""

    name = "torch-sdpa"

    def prepare(self, batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
        metadata = TorchAttentionMetadata(slot_mapping=batch.slot_mapping, num_tokens=batch.num_tokens)
        token_starts = first_rows(batch.query_lens)
        self._prepare_decode_buckets(batch, block_size, token_starts, metadata)
        self._prepare_prefills(batch, block_size, token_starts, metadata)
        return metadata

    @staticmethod
    def _prepare_decode_buckets(
        batch: ForwardBatch, block_size: int, token_starts: list[int], metadata: TorchAttentionMetadata
    ) -> None:
        device = batch.input_ids.device
        decode_seq_ids = [i for i, q in enumerate(batch.query_lens) if q == 1]
        if not decode_seq_ids:
            return
        decode_seq_ids.sort(key=lambda i: batch.context_lens[i])
        num_blocks = [cdiv(batch.context_lens[i], block_size) for i in decode_seq_ids]
        ends = bucket_by_num_blocks(num_blocks, MAX_DECODE_BUCKETS, BUCKET_COST_BLOCKS)
        if len(ends) == 1:  # one bucket: batch order, so that a decode-only step needs no row scatter
            decode_seq_ids.sort()
        start = 0
        for end in ends:
            seq_ids = decode_seq_ids[start:end]
            num_blocks_read = max(num_blocks[start:end])
            context_lens = [batch.context_lens[i] for i in seq_ids]
            num_keys = max(context_lens)
            seq_index = torch.tensor(seq_ids, dtype=torch.int64, device=device)
            tables = batch.block_tables.index_select(0, seq_index)[:, :num_blocks_read].long()
            mask = None
            if min(context_lens) != num_keys:
                lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
                key_positions = torch.arange(num_keys, device=device)
                mask = (key_positions[None, :] < lens[:, None])[:, None, None, :]
            rows = [token_starts[i] for i in seq_ids]
            metadata.decode_buckets.append(
                DecodeBucket(
                    token_indices=torch.tensor(rows, dtype=torch.int64, device=device),
                    block_ids=tables.flatten(),
                    mask=mask,
                    num_keys=num_keys,
                )
            )
            start = end
        metadata.decode_only_in_order = len(ends) == 1 and len(decode_seq_ids) == batch.num_tokens

    @staticmethod
    def _prepare_prefills(
        batch: ForwardBatch, block_size: int, token_starts: list[int], metadata: TorchAttentionMetadata
    ) -> None:
        device = batch.input_ids.device
        for i, query_len in enumerate(batch.query_lens):
            if query_len == 1:
                continue
            context_len = batch.context_lens[i]
            start = context_len - query_len
            num_context_blocks = cdiv(context_len, block_size)
            mask = None
            if start > 0:
                query_positions = torch.arange(start, context_len, device=device)
                mask = torch.arange(context_len, device=device)[None, :] <= query_positions[:, None]
            metadata.prefills.append(
                PrefillSlice(
                    token_start=token_starts[i],
                    token_end=token_starts[i] + query_len,
                    context_len=context_len,
                    block_ids=batch.block_tables[i, :num_context_blocks].long(),
                    mask=mask,
                )
            )

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
        group = num_heads // k.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        if metadata.decode_only_in_order:
            return self._decode(q, key_cache, value_cache, metadata.decode_buckets[0], group, scale)
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        for bucket in metadata.decode_buckets:
            rows = bucket.token_indices
            attended = self._decode(q.index_select(0, rows), key_cache, value_cache, bucket, group, scale)
            out.index_copy_(0, rows, attended)
        for p in metadata.prefills:
            out[p.token_start : p.token_end] = self._prefill(q, k, v, key_cache, value_cache, p, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        bucket: DecodeBucket,
        group: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, H, D] (any strides) -> [B, H * D]."""
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = key_cache.shape[2]
        # [B * nb, block_size, Hkv, D] -> [B, Hkv, L, D]; index_select copies whole blocks,
        # 5x faster on CPU than advanced indexing with the 2-D table; L cut to the longest context
        shape = (num_decodes, -1, num_kv_heads, head_dim)
        keys = key_cache.index_select(0, bucket.block_ids).view(shape)[:, : bucket.num_keys].transpose(1, 2)
        values = value_cache.index_select(0, bucket.block_ids).view(shape)[:, : bucket.num_keys].transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a no-op unless the cache is narrower
        queries = q.reshape(num_decodes, num_kv_heads, group, head_dim)  # G query rows per KV head
        if bucket.mask is not None and (bucket.additive_mask is None or bucket.additive_mask.dtype != q.dtype):
            bucket.additive_mask = torch.zeros(bucket.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~bucket.mask, float("-inf")
            )  # [B, 1, 1, num_keys]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bucket.additive_mask, scale=scale)
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
        if p.mask is None:  # the whole context is this chunk: use it as computed (as the cache holds it)
            keys = as_cached(k[p.token_start : p.token_end], key_cache.dtype).transpose(0, 1)
            values = as_cached(v[p.token_start : p.token_end], value_cache.dtype).transpose(0, 1)
        else:  # earlier tokens live only in the cache
            keys = key_cache.index_select(0, p.block_ids).flatten(0, 1)[: p.context_len].transpose(0, 1)
            values = value_cache.index_select(0, p.block_ids).flatten(0, 1)[: p.context_len].transpose(0, 1)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if p.mask is not None and (p.additive_mask is None or p.additive_mask.dtype != q.dtype):
            p.additive_mask = torch.zeros(p.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~p.mask, float("-inf")
            )  # [query_len, context_len]
        out = F.scaled_dot_product_attention(
            queries.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=p.additive_mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1).flatten(1)


def first_rows(query_lens: list[int]) -> list[int]:
    """The first batch row of each sequence."""
    starts = [0] * len(query_lens)
    for i in range(1, len(query_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]
    return starts


def _flash_attn_version() -> tuple[int, ...] | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return tuple(int(part) for part in flash_attn.__version__.split(".")[:2] if part.isdigit())


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    block_size: int,
    batch_invariant: bool = False,
) -> tuple[AttentionBackend[Any], str]:
    """The attention backend for this device, and why it was chosen (for the start-up log).

    dtype: the model's; kv_cache_dtype: the cache's. nanoserve's paged decode kernel for a
    float32 model on the CPU (any cache dtype; with batch_invariant, prefill queries through
    it too, ``CpuPagedAttentionBackend``); flash-attn when on CUDA, importable (>= 2.6,
    paged KV), with fp16/bf16, the cache in the model's dtype and a block size that is a
    multiple of 256; the torch backend otherwise.
    """
    if device.type == "cpu" and dtype == torch.float32 and kernels.load():
        from nanoserve.engine.model.cpu_paged_attention import CpuPagedAttentionBackend

        cache = str(kv_cache_dtype).removeprefix("torch.")
        prefill = "prefill queries too" if batch_invariant else "prefill by SDPA"
        return (
            CpuPagedAttentionBackend(prefill_by_decode_kernel=batch_invariant),
            f"float32 on the CPU: nanoserve's paged decode kernel ({cache} cache, {prefill})",
        )
    if device.type != "cuda":
        return TorchAttentionBackend(), f"device is {device.type}"
    version = _flash_attn_version()
    if version is None:
        return TorchAttentionBackend(), "flash-attn not installed (pip install 'nanoserve[cuda]')"
    if version < (2, 6):
        return TorchAttentionBackend(), f"flash-attn {version} predates paged KV (2.6)"
    if dtype not in (torch.float16, torch.bfloat16):
        return TorchAttentionBackend(), f"flash-attn needs float16/bfloat16, dtype is {dtype}"
    if kv_cache_dtype != dtype:
        return TorchAttentionBackend(), f"flash-attn needs the KV cache in the model's {dtype}, it is {kv_cache_dtype}"
    if block_size % 256:
        return TorchAttentionBackend(), f"flash-attn paged KV needs block_size % 256 == 0, block_size is {block_size}"
    from nanoserve.engine.model.flash_attention import FlashAttentionBackend

    return FlashAttentionBackend(), f"flash-attn {'.'.join(map(str, version))} importable on CUDA"
