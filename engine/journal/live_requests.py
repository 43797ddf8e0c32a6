"""The live requests of an epoch's journal, and the checkpoints that store them.

Recovery wants the requests of the crashed epoch admitted without a FINISH.
Read from the journal alone that means every step row of the epoch, which grows
with the server's uptime. So the journal's table follows the live requests as
it stores each step (``LiveRequests``, fed in journal seq order on the log's
writer thread) and, every ``records_per_checkpoint`` records, stores them as one
``journal_checkpoints`` row beside the step row that ends there::

    step rows   ... [first..last=4096] [4097..4130] ... [..8192] [8193..] ...  (head)
    checkpoints          (4096: r7@12, r9@4088)             (8192: r9@4088, r31@8170)
                                                               ^ recovery starts here and
                                                                 decodes only the rows after it

A checkpoint's ``body`` is version byte 1, then zlib of the JSON list
``[[request_id, admit_seq], ...]`` in admission order; its ``hash`` is
sha256(``CHECKPOINT_TAG`` + the step row's hash + ``last_seq|`` + body), so it
is verified against the journal's own chain (``journal_chain``) as the
allocator's SNAPSHOT is against the log's: a checkpoint whose hash does not
link is not trusted, and recovery reads the epoch's whole journal instead.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["CheckpointRow", "LiveCheckpoints", "LiveRequests", "checkpoint_hash", "decode_live", "encode_live"]

VERSION = 1
CHECKPOINT_TAG = b"nanoserve-journal-checkpoint|"
RECORDS_PER_CHECKPOINT = 8192  # journal records between two checkpoints: what recovery decodes at most
_NUM_EPOCHS_KEPT = 64


class CheckpointRow(NamedTuple):
    """One ``journal_checkpoints`` row, in its columns' order."""

    pool_id: str
    epoch: int
    last_seq: int
    body: bytes
    hash: bytes


class LiveRequests:
    """The requests admitted and not finished so far in one epoch's journal.

    ``admitted``: request id -> the journal seq of its ADMIT, in admission order
    (an id admitted again before its FINISH keeps its first place; one that is
    finished and admitted again moves to the end)."""

    def __init__(self, admitted: dict[str, int] | None = None) -> None:
        self.admitted: dict[str, int] = dict(admitted or {})

    def apply(self, seq: int, kind: str, request_id: str) -> None:
        """Follow journal record ``seq`` (a ``JournalKind`` value)."""
        if kind == "admit":
            self.admitted.setdefault(request_id, seq)
        elif kind == "finish":
            self.admitted.pop(request_id, None)

    def ids(self) -> list[str]:
        """The live request ids in admission order."""
        return list(self.admitted)


def encode_live(live: LiveRequests) -> bytes:
    """A checkpoint's body (see the module's docstring)."""
    listed = [[request_id, seq] for request_id, seq in live.admitted.items()]
    return bytes([VERSION]) + zlib.compress(json.dumps(listed, separators=(",", ":")).encode())


def decode_live(body: bytes) -> LiveRequests:
    """The live requests a checkpoint's body holds. ValueError for a body this version cannot read."""
    if not body or body[0] != VERSION:
        raise ValueError(f"journal checkpoint version {body[:1].hex() or 'missing'}, expected {VERSION}")
    try:
        listed = json.loads(zlib.decompress(body[1:]))
    except (zlib.error, ValueError) as exc:
        raise ValueError(f"journal checkpoint body unreadable: {exc}") from exc
    return LiveRequests({str(request_id): int(seq) for request_id, seq in listed})


def checkpoint_hash(step_hash: bytes, last_seq: int, body: bytes) -> bytes:
    """The hash of a checkpoint at ``last_seq`` whose step row there hashes to ``step_hash`` (32 bytes)."""
    return hashlib.sha256(CHECKPOINT_TAG + step_hash + f"{last_seq}|".encode() + body).digest()


class LiveCheckpoints:
    """Follows each epoch's live requests as its step rows are built, and says when to checkpoint them.

    Only epochs followed from journal seq 1 are checkpointed (this process wrote
    them from their start); the last ``_NUM_EPOCHS_KEPT`` epochs are kept.
    Not thread-safe: ``JournalTable`` calls it under its lock."""

    def __init__(self, records_per_checkpoint: int = RECORDS_PER_CHECKPOINT) -> None:
        if records_per_checkpoint < 1:
            raise ValueError(f"records_per_checkpoint must be >= 1, got {records_per_checkpoint}")
        self.records_per_checkpoint = records_per_checkpoint
        # (writer_id, pool_id, epoch) -> (its live requests, records since its last checkpoint)
        self._epochs: OrderedDict[tuple[str, str, int], tuple[LiveRequests, int]] = OrderedDict()

    def admit_seqs(
        self, pool_id: str, epoch: int, first_seq: int, records: Sequence[tuple[str, str]], writer_id: str = ""
    ) -> list[int | None]:
        """Per ``(kind, request_id)`` record of the step row about to be built (seqs ``first_seq``, ...):
        for an OUTPUT or FINISH, the journal seq of its request's ADMIT in the epoch, the one the live
        requests hold (``step_codec`` stores the OUTPUT by it); None for other kinds, for a request not
        live, or in an epoch not followed from its start. Changes nothing (``follow`` then does)."""
        followed = (LiveRequests(), 0) if first_seq == 1 else self._epochs.get((writer_id, pool_id, epoch))
        if followed is None:
            return [None] * len(records)
        admitted = followed[0].admitted
        changed: dict[str, int | None] = {}  # request id -> its ADMIT's seq after this row's records so far
        seqs: list[int | None] = []
        for seq, (kind, request_id) in enumerate(records, first_seq):
            current = changed[request_id] if request_id in changed else admitted.get(request_id)
            seqs.append(current if kind in ("output", "finish") else None)
            if kind == "admit" and current is None:  # as LiveRequests.apply: the first ADMIT keeps its place
                changed[request_id] = seq
            elif kind == "finish":
                changed[request_id] = None
        return seqs

    def follow(
        self,
        pool_id: str,
        epoch: int,
        first_seq: int,
        records: Iterable[tuple[str, str]],
        step_hash: bytes,
        writer_id: str = "",
    ) -> CheckpointRow | None:
        """Apply one step row's ``(kind, request_id)`` records (seqs ``first_seq``, ...), whose row hashes
        to ``step_hash``; the checkpoint to store with that row, or None. ``writer_id`` names the log
        that writes the epoch (``CompanionTable.rows``): two logs of one pool id and epoch are two epochs."""
        key = (writer_id, pool_id, epoch)
        if first_seq == 1:
            self._epochs[key] = (LiveRequests(), 0)
            while len(self._epochs) > _NUM_EPOCHS_KEPT:
                self._epochs.popitem(last=False)
        followed = self._epochs.get(key)
        if followed is None:
            return None
        live, num_since = followed
        seq = first_seq - 1
        for seq, (kind, request_id) in enumerate(records, first_seq):
            live.apply(seq, kind, request_id)
        num_since += seq - first_seq + 1
        if num_since < self.records_per_checkpoint:
            self._epochs[key] = (live, num_since)
            return None
        self._epochs[key] = (live, 0)
        body = encode_live(live)
        return CheckpointRow(pool_id, epoch, seq, body, checkpoint_hash(step_hash, seq, body))
