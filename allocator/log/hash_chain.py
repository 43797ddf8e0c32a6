"""The hash chain over an epoch's records.

Each record's hash is ``sha256(previous_hash + record)`` (the record as UTF-8,
see ``record_codec``); the first record of an epoch chains from
``genesis_hash(pool_id, epoch)``, so a record that is edited, missing,
reordered or moved to another epoch breaks the chain right there. The writer
thread hashes records as it commits them; replay hashes the stored text as it
is, then decodes it. (``chain_verifier`` repeats ``chain_hash`` with the
standard library alone, to start fast in its own process.)
"""

from __future__ import annotations

import hashlib

__all__ = ["chain_hash", "genesis_hash"]

_sha256 = hashlib.sha256


def genesis_hash(pool_id: str, epoch: int) -> bytes:
    """The hash the first record of ``(pool_id, epoch)`` chains from."""
    return _sha256(f"nanoserve-allocator-log|{len(pool_id)}:{pool_id}|{epoch}".encode()).digest()


def chain_hash(previous: bytes, record: str) -> bytes:
    """sha256(previous + record as UTF-8): 32 bytes."""
    return _sha256(previous + record.encode()).digest()
