"""The cut of an epoch whose older part is archived: where its stored rows begin, and what they chain from.

A long-running epoch sheds its older rows into archive files while it stays
open (``segment_archive``); each move is one ``archived_segments`` row naming
seqs ``first_seq..last_seq`` and the stored hash at ``last_seq``. The epoch's
rows then begin at the newest such row's ``last_seq + 1``, always a SNAPSHOT
checkpoint (the pool as it stood there), whose stored hash must equal
``sha256(head_hash + record)``. Every reader that would start the epoch at its
genesis starts at the cut instead (``cut_start``), so the audit of what is
stored checks the link to the manifest, and the archive file's own audit
checks the rows before it: together they verify the whole chain.

The same table travels into an archive file (a segment file holds the earlier
segments' rows, an epoch archived whole holds all of its own), so a file is
read the same way as the live log.

    seqs:   1 ........ c-1 | c (SNAPSHOT) ......... durable_seq
            archive file(s) | live log
            head_hash = hash[c-1] -> sha256(head_hash + record[c]) == hash[c]
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from nanoserve.allocator.events import EventKind
from nanoserve.allocator.log.reader import EpochInfo, connect, event_rows
from nanoserve.allocator.log.record_codec import NUM_FIELDS, split_record
from nanoserve.allocator.log.replay_state import Replayer
from nanoserve.allocator.log.schema import archived_segments

_SNAPSHOT = EventKind.SNAPSHOT.value


@dataclass(frozen=True)
class Cut:
    """Where an epoch's stored rows begin: ``first_seq`` (a SNAPSHOT), chained from ``previous_hash``
    (the archived row ``first_seq - 1``'s hash, 32 bytes, from the manifest)."""

    first_seq: int
    previous_hash: bytes

    @property
    def num_archived(self) -> int:
        """Seqs 1..first_seq - 1 are archived: this many."""
        return self.first_seq - 1


def has_segments_table(conn: sa.Connection) -> bool:
    """Whether the database holds the segment manifest (migration 0007)."""
    return bool(sa.inspect(conn).has_table(archived_segments.name))


def epoch_cut(conn: sa.Connection, pool_id: str, epoch: int) -> Cut | None:
    """The epoch's cut (its newest archived segment); None when nothing of it is archived as a segment."""
    if not has_segments_table(conn):
        return None
    table = archived_segments
    row = conn.execute(
        sa.select(table.c.last_seq, table.c.head_hash)
        .where(table.c.pool_id == pool_id, table.c.epoch == epoch)
        .order_by(table.c.last_seq.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    return Cut(first_seq=int(row.last_seq) + 1, previous_hash=bytes(row.head_hash))


def archived_through(url: str, pool_id: str, epoch: int) -> int:
    """The last seq of ``epoch`` moved into a segment file (0: none; its stored rows then start at seq 1).

    Raises LogNotFoundError / LogUnavailableError as ``reader.connect`` does.
    """
    with connect(url) as conn:
        cut = epoch_cut(conn, pool_id, epoch)
    return 0 if cut is None else cut.num_archived


def segment_path(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> str | None:
    """The file of the archived segment of ``epoch`` that holds ``seq`` (None: no segment holds it)."""
    if not has_segments_table(conn):
        return None
    table = archived_segments
    found = conn.execute(
        sa.select(table.c.path).where(
            table.c.pool_id == pool_id, table.c.epoch == epoch, table.c.first_seq <= seq, table.c.last_seq >= seq
        )
    ).scalar()
    return None if found is None else str(found)


def companion_cut(conn: sa.Connection, pool_id: str, epoch: int) -> Cut | None:
    """Where the epoch's kept companion rows (its request journal) begin: the companion seq after the
    newest segment that moved some, chained from its companion head hash; None when none moved."""
    if not has_segments_table(conn):
        return None
    table = archived_segments
    row = conn.execute(
        sa.select(table.c.companion_last_seq, table.c.companion_head_hash)
        .where(table.c.pool_id == pool_id, table.c.epoch == epoch, table.c.companion_last_seq.is_not(None))
        .order_by(table.c.companion_last_seq.desc())
        .limit(1)
    ).first()
    if row is None or row.companion_head_hash is None:
        return None
    return Cut(first_seq=int(row.companion_last_seq) + 1, previous_hash=bytes(row.companion_head_hash))


def cut_start(conn: sa.Connection, info: EpochInfo) -> Replayer:
    """A replayer at the epoch's start as stored: its genesis, or its cut with the checkpoint loaded.

    At a cut the first stored row must be a SNAPSHOT whose hash links to the
    manifest's head hash: a row that is missing, altered or no loadable
    SNAPSHOT is a violation at the cut's seq (``hash_mismatch`` from the chain
    check, ``bad_snapshot`` here), never an exception.
    """
    cut = epoch_cut(conn, info.pool_id, info.epoch)
    if cut is None:
        return Replayer(info)
    replayer = Replayer(info, start_seq=cut.first_seq, previous_hash=cut.previous_hash)
    rows = [row for chunk in event_rows(conn, info.pool_id, info.epoch, cut.first_seq, cut.first_seq) for row in chunk]
    try:
        if not rows or rows[0][0] != cut.first_seq:
            raise ValueError("the row is missing")
        fields = split_record(rows[0][3])
        if len(fields) != NUM_FIELDS or fields[2] != _SNAPSHOT:
            raise ValueError("it is no SNAPSHOT record")
        replayer.load_snapshot(fields[-1])
    except (ValueError, TypeError, IndexError) as exc:
        replayer.violate(
            cut.first_seq,
            "bad_snapshot",
            f"the checkpoint after the archived seqs 1..{cut.num_archived} cannot be loaded: {exc}",
        )
    replayer.apply_rows(rows)
    return replayer
