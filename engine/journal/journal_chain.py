"""The hash chain over an epoch's journal step rows, and its verification.

Each ``journal_steps`` row's ``hash`` is ``sha256(previous hash + header + body)``,
the header naming the row's seq range, step and wall time
(``first_seq:last_seq:step:wall_ns``); an epoch's first row chains from
``journal_genesis(pool_id, epoch)``. Rows number the epoch's journal records
without a hole (a row's ``first_seq`` is the row before's ``last_seq + 1``), so
a row that is edited breaks its hash and a row that is deleted leaves a hole in
the seqs; ``verify_journal_chain`` names the first of either. (The last rows of
an epoch, deleted together, leave neither: the chain's head is not stored
elsewhere.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

__all__ = ["JournalDamage", "journal_genesis", "step_hash", "verify_journal_chain"]


def journal_genesis(pool_id: str, epoch: int) -> bytes:
    """The hash the first journal step row of ``(pool_id, epoch)`` chains from (32 bytes)."""
    return hashlib.sha256(f"nanoserve-request-journal|{len(pool_id)}:{pool_id}|{epoch}".encode()).digest()


def step_hash(previous: bytes, first_seq: int, last_seq: int, step: int | None, wall_ns: int, body: bytes) -> bytes:
    """The hash of one step row chained to ``previous`` (32 bytes)."""
    header = f"{first_seq}:{last_seq}:{'' if step is None else step}:{wall_ns}|".encode()
    return hashlib.sha256(previous + header + body).digest()


class StepRow(NamedTuple):
    """The chained columns of one ``journal_steps`` row."""

    epoch: int
    first_seq: int
    last_seq: int
    step: int | None
    wall_ns: int
    body: bytes
    hash: bytes


class JournalDamage(NamedTuple):
    """The first damage of an epoch's journal: ``kind`` "missing" (records ``first_seq..last_seq``
    absent) or "altered" (the row holding ``first_seq..last_seq`` does not hash to its stored hash);
    or "checkpoint": the journal checkpoint at record ``first_seq`` (= ``last_seq``) does not hash
    to its stored hash over its step row's (``live_requests``)."""

    epoch: int
    kind: str
    first_seq: int
    last_seq: int

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"epoch {self.epoch}: journal checkpoint at record {self.last_seq} altered (hash mismatch)"
        what = "missing" if self.kind == "missing" else "altered (hash mismatch)"
        return f"epoch {self.epoch}: journal records {self.first_seq}..{self.last_seq} {what}"


def verify_journal_chain(
    pool_id: str,
    rows: Iterable[StepRow],
    previous: bytes | None = None,
    first_seq: int = 1,
    starts: Mapping[int, tuple[bytes, int]] | None = None,
) -> list[JournalDamage]:
    """The first damage of each epoch among ``rows`` (ordered by epoch, first_seq); [] for a clean journal.

    ``previous``/``first_seq``: where the first epoch's rows start, for a check of
    part of an epoch (default: its genesis and seq 1). ``starts``: epoch ->
    (hash, first seq) where that epoch's kept rows start (its rows before are
    archived as segments, ``segment.companion_cut``). An epoch's check stops at
    its first damage (every row after an altered one would fail too); the next
    epoch is checked from its own genesis (or start)."""
    damages: list[JournalDamage] = []
    epoch: int | None = None
    next_seq = first_seq
    damaged = False
    for row in rows:
        if row.epoch != epoch:
            if epoch is not None or previous is None:
                start = None if starts is None else starts.get(row.epoch)
                previous, next_seq = start if start is not None else (journal_genesis(pool_id, row.epoch), 1)
            epoch, damaged = row.epoch, False
        if damaged:
            continue
        if row.first_seq != next_seq:
            damages.append(JournalDamage(row.epoch, "missing", next_seq, row.first_seq - 1))
            damaged = True
            continue
        assert previous is not None, "set where the epoch starts"
        expected = step_hash(previous, row.first_seq, row.last_seq, row.step, row.wall_ns, row.body)
        if expected != row.hash:
            damages.append(JournalDamage(row.epoch, "altered", row.first_seq, row.last_seq))
            damaged = True
            continue
        previous, next_seq = row.hash, row.last_seq + 1
    return damages
