"""The hash chain over an epoch's events.

Each record's hash is ``sha256(previous_hash + canonical(record))``; the first
record of an epoch chains from ``genesis_hash(pool_id, epoch)``, so a record
that is edited, missing, reordered or moved to another epoch breaks the chain at
that record. The writer thread computes hashes as it seals rows; replay
recomputes them from the stored columns.

The canonical payload is a ``|``-separated line of every stored column except
the hash. ``owner`` is length-prefixed (the only free-form text besides ``data``,
which comes last), so no two different records share a payload.
"""

from __future__ import annotations

import hashlib

_sha256 = hashlib.sha256


def genesis_hash(pool_id: str, epoch: int) -> bytes:
    """The hash the first record of ``(pool_id, epoch)`` chains from."""
    return _sha256(f"nanoserve-allocator-log|{len(pool_id)}:{pool_id}|{epoch}".encode()).digest()


def canonical(
    seq: int,
    batch_seq: int,
    kind: str,
    block_ids: str,
    owner: str | None,
    step: int | None,
    reason: str | None,
    wall_time_ns: int,
    monotonic_ns: int,
    data: str | None,
) -> bytes:
    """The bytes a record's hash covers (its stored columns, in a fixed order)."""
    owner_field = "" if owner is None else f"{len(owner)}:{owner}"
    step_field = "" if step is None else step
    return (
        f"{seq}|{batch_seq}|{kind}|{block_ids}|{owner_field}|{step_field}|{reason or ''}"
        f"|{wall_time_ns}|{monotonic_ns}|{'' if data is None else data}"
    ).encode()


def chain_hash(previous: bytes, payload: bytes) -> bytes:
    """sha256(previous + payload): 32 bytes."""
    return _sha256(previous + payload).digest()
