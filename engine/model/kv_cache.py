"""The paged KV cache: per layer, K and V tensors split into fixed-size blocks.

Layout of one layer's K (V is the same)::

    k[block_id, offset, kv_head, :]      shape [num_blocks, block_size, num_kv_heads, head_dim]
      block 0: slots 0 .. block_size-1
      block 1: slots block_size .. 2*block_size-1
      ...

A token's slot is ``block_id * block_size + offset``; viewing a layer as
``[num_blocks * block_size, num_kv_heads, head_dim]`` turns a batch's slot mapping
into one ``index_copy_``. The block ids themselves belong to the allocator.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the cache for one model: what a block costs in bytes."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of ``block_size`` tokens in every layer, in bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole blocks fit in ``memory_bytes``.

        Raises ValueError when not even one block fits.
        """
        num_blocks = memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {memory_bytes} bytes holds no block; one block needs {self.bytes_per_block} bytes"
            )
        return num_blocks


class KVCache:
    """K and V block tensors for every layer, allocated once at start-up, all zeros.

    ``key_caches[i]`` and ``value_caches[i]``: [num_blocks, block_size, num_kv_heads, head_dim].

    Zeros, not uninitialized memory: decode attention reads whole blocks, the slots
    not yet written included (masked to weight 0), and 0 x NaN garbage would be NaN.
    On the CPU the tensors are views of one anonymous memory map, whose pages the
    kernel hands out zeroed on first touch: start-up neither writes the cache nor
    makes it resident (``torch.zeros`` of the default 1 GiB budget did both).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        caches = _zeros(2 * spec.num_layers, shape, spec.dtype, device)
        self.key_caches = caches[: spec.num_layers]
        self.value_caches = caches[spec.num_layers :]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_tokens(self) -> int:
        """Token capacity of the whole cache."""
        return self.num_blocks * self.spec.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every layer's K and V rows of block ``source`` into block ``destination``, for each pair.

        pairs: (source, destination) block ids, destinations distinct from every source (a block
        copied on write: ``BlockTable.take_copies``). One gather and one scatter per tensor.
        """
        if not pairs:
            return
        device = self.key_caches[0].device
        sources = torch.tensor([source for source, _ in pairs], dtype=torch.int64, device=device)  # [num_pairs]
        destinations = torch.tensor([dest for _, dest in pairs], dtype=torch.int64, device=device)  # [num_pairs]
        for cache in (*self.key_caches, *self.value_caches):  # [num_blocks, block_size, num_kv_heads, head_dim]
            cache.index_copy_(0, destinations, cache.index_select(0, sources))


def _zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``count`` zero tensors of ``shape``: on the CPU views of one lazily zeroed anonymous map."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    numel = 1
    for size in shape:
        numel *= size
    element_size = torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, count * numel * element_size)  # MAP_ANONYMOUS: zero-filled, resident once touched
    flat = torch.frombuffer(pages, dtype=dtype)  # holds a reference to the map
    return [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]
