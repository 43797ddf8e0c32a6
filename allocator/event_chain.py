"""Stored records and the hash chain over an epoch's events.

An event is stored as one line of text, its *record*::

    seq|batch_seq|kind|block_ids|step|reason|wall_time_ns|monotonic_ns|tail

``block_ids`` is comma-separated; ``step`` and ``reason`` are empty when
None; ``tail`` is the owner for block events and JSON ``data`` for POOL_INIT,
SNAPSHOT and POOL_CLOSE. The tail is last, so it may hold any character.

Each record's hash is ``sha256(previous_hash + record)``; the first record of an
epoch chains from ``genesis_hash(pool_id, epoch)``, so a record that is edited,
missing, reordered or moved to another epoch breaks the chain right there. The
writer thread builds and hashes records; replay hashes the stored text as it
is, then parses it.
"""

from __future__ import annotations

import hashlib

from nanoserve.allocator.events import DATA_KINDS

__all__ = ["DATA_KINDS", "chain_hash", "encode_record", "genesis_hash", "split_record"]

_sha256 = hashlib.sha256


def genesis_hash(pool_id: str, epoch: int) -> bytes:
    """The hash the first record of ``(pool_id, epoch)`` chains from."""
    return _sha256(f"nanoserve-allocator-log|{len(pool_id)}:{pool_id}|{epoch}".encode()).digest()


def encode_record(
    seq: int,
    batch_seq: int,
    kind: str,
    block_ids: str,
    step: int | None,
    reason: str | None,
    wall_time_ns: int,
    monotonic_ns: int,
    tail: str,
) -> str:
    """One event as its stored line (see the module docstring)."""
    step_text = "" if step is None else step
    return f"{seq}|{batch_seq}|{kind}|{block_ids}|{step_text}|{reason or ''}|{wall_time_ns}|{monotonic_ns}|{tail}"


def split_record(record: str) -> list[str]:
    """The nine fields of a record as text; fewer when the record is malformed."""
    return record.split("|", 8)


def chain_hash(previous: bytes, record: str) -> bytes:
    """sha256(previous + record as UTF-8): 32 bytes."""
    return _sha256(previous + record.encode()).digest()
