"""``BlockKey``: what a full KV block holds, and the chained hash that names it.

A full block's key is sha256 over its parent block's key, its token ids and
its extra keys (the request's ``cache_salt``), so a key names the whole
prefix up to the block's end (vLLM's automatic prefix caching, hashed blocks
as in nano-vllm). Only full blocks have keys; the last, partial block of a
sequence is never cached.

The hash is one indirection away (``digest``) so a test can force collisions:
the allocator never trusts a key alone, it compares the stored token ids,
extra keys and parent of every candidate block (``BlockAllocator.share_prefix``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import NamedTuple


def sha256_hex(payload: bytes) -> str:
    """The default ``digest``: hex sha256 (64 characters)."""
    return hashlib.sha256(payload).hexdigest()


# payload -> hex key; tests replace it (a constant forces every key to collide)
digest: Callable[[bytes], str] = sha256_hex


class BlockKey(NamedTuple):
    """The key of one full block and the content it stands for.

    key: hex digest of (parent, token_ids, extra_keys).
    parent: the key of the block before it; None for a sequence's first block.
    token_ids: the block's ``block_size`` token ids.
    extra_keys: what else the KV depends on (the ``cache_salt``); () for none.
    """

    key: str
    parent: str | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


def hash_block(parent: str | None, token_ids: Sequence[int], extra_keys: Sequence[str]) -> BlockKey:
    """The ``BlockKey`` of one full block after ``parent``."""
    tokens = tuple(token_ids)
    extras = tuple(extra_keys)
    payload = json.dumps([parent, tokens, extras], separators=(",", ":")).encode()
    return BlockKey(digest(payload), parent, tokens, extras)


def extend_block_keys(
    keys: list[BlockKey], token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = ()
) -> list[BlockKey]:
    """Append to ``keys`` the keys of the full blocks of ``token_ids`` it lacks; returns ``keys``.

    ``keys`` must be the keys of the first ``len(keys)`` blocks of ``token_ids``
    (a sequence only grows). The partial last block gets no key.
    """
    num_full = len(token_ids) // block_size
    parent = keys[-1].key if keys else None
    for index in range(len(keys), num_full):
        block = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra_keys)
        keys.append(block)
        parent = block.key
    return keys


HashFunction = Callable[[bytes], str]
__all__ = ["BlockKey", "HashFunction", "digest", "extend_block_keys", "hash_block", "sha256_hex"]
