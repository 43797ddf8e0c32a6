"""The request journal's tables as the event log's companion: records in, histories out.

``JournalRecord`` is what the engine hands ``EventLog.append_batch`` beside a
step's events; it names ``JOURNAL_TABLE``, through which the log's writer
stores a step's records as one ``journal_steps`` row (``step_codec``, chained by
``journal_chain``) in the same transaction as the events (the log's
``companion`` protocol). The readers here turn the stored rows, of either
layout (``request_journal``'s row per record before migration 0005), back into
``JournalEntry``s and ``RequestHistory``s (``records``); ``audit_journal``
checks the chain.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa

from nanoserve.allocator.log.companion import CompanionRow
from nanoserve.allocator.log.errors import LogNotFoundError, safe_url
from nanoserve.allocator.log.segment import companion_cut
from nanoserve.allocator.log.store import create_log_engine, insert_through_driver
from nanoserve.engine.errors import JournalGapError
from nanoserve.engine.journal.journal_chain import (
    JournalDamage,
    StepRow,
    journal_genesis,
    step_hash,
    verify_journal_chain,
)
from nanoserve.engine.journal.live_requests import (
    CheckpointRow,
    LiveCheckpoints,
    LiveRequests,
    checkpoint_hash,
    decode_live,
)
from nanoserve.engine.journal.records import JournalEntry, JournalKind, RequestHistory, request_history
from nanoserve.engine.journal.schema import journal_checkpoints, journal_requests, journal_steps, request_journal
from nanoserve.engine.journal.step_codec import AdmissionNames, decode_step, encode_step


class JournalRecord(NamedTuple):
    """One journal record as the engine makes it; the log stamps journal_seq, step and time.

    A companion record of the event log (``nanoserve.allocator.log.companion``): its
    ``table`` is the request journal's, which the log asks to store it."""

    kind: JournalKind
    request_id: str
    data: dict[str, Any]

    @property
    def table(self) -> JournalTable:
        return JOURNAL_TABLE


# the old layout (before migration 0005): one request_journal row per record, in JOURNAL_COLUMNS order
JOURNAL_COLUMNS = ("pool_id", "epoch", "journal_seq", "request_id", "kind", "step", "wall_ns", "record")
# one journal_steps row, in STEP_COLUMNS order, then its admissions rows (INDEX_COLUMNS order), then its
# checkpoint (a CheckpointRow, or None)
STEP_COLUMNS = ("pool_id", "epoch", "first_seq", "last_seq", "step", "wall_ns", "body", "hash")
INDEX_COLUMNS = ("pool_id", "epoch", "journal_seq", "request_id")
CHECKPOINT_COLUMNS = CheckpointRow._fields
_ROW_OVERHEAD_BYTES = 64  # a step row's fixed columns and hash, near enough for the pending-bytes figure
_NUM_HEADS_KEPT = 256


class JournalTable:
    """The request journal as the event log's companion table: one ``journal_steps`` row per batch.

    Keeps the chain's head of each epoch it writes (``(writer_id, pool_id, epoch,
    last_seq) -> hash``, the last few only): the writer hands it an epoch's batches in seq
    order, so each row chains from the one built before it; a retry reuses its
    sealed rows and builds nothing again. Follows each epoch's live requests too
    (``checkpoints``), and stores them with a step row every
    ``checkpoints.records_per_checkpoint`` records (``live_requests``). One table serves
    every log of the process, so both are keyed by the writing log (``writer_id``) as well:
    two logs of one pool id and epoch (two ``LLM``s in one process, each with its own file)
    once chained from each other's heads, and their journals audited as altered."""

    def __init__(self) -> None:
        self._heads: OrderedDict[tuple[str, str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.checkpoints = LiveCheckpoints()

    def rows(
        self,
        records: Sequence[JournalRecord],
        pool_id: str,
        epoch: int,
        first_seq: int,
        step: int | None,
        wall_ns: int,
        writer_id: str,
    ) -> list[CompanionRow]:
        """One step row holding ``records`` (journal seqs ``first_seq``, ...), chained to the epoch's
        row that ends at ``first_seq - 1``; the row carries its ADMITs' and FINISHes' index rows, then
        the checkpoint stored with it (or None), last."""
        last_seq = first_seq + len(records) - 1
        kinds = [(record.kind.value, record.request_id) for record in records]
        with self._lock:
            admit_seqs = self.checkpoints.admit_seqs(pool_id, epoch, first_seq, kinds, writer_id)
            body = encode_step([(record.kind.value, record.request_id, record.data) for record in records], admit_seqs)
            previous = (
                journal_genesis(pool_id, epoch)
                if first_seq == 1
                else self._heads.get((writer_id, pool_id, epoch, first_seq - 1))
            )
            assert previous is not None, f"journal seq {first_seq} of epoch {epoch} sealed before seq {first_seq - 1}"
            digest = step_hash(previous, first_seq, last_seq, step, wall_ns, body)
            self._heads[(writer_id, pool_id, epoch, last_seq)] = digest
            while len(self._heads) > _NUM_HEADS_KEPT:
                self._heads.popitem(last=False)
            checkpoint = self.checkpoints.follow(pool_id, epoch, first_seq, kinds, digest, writer_id)
        index = tuple(
            (pool_id, epoch, seq, record.request_id)
            for seq, record in enumerate(records, first_seq)
            if record.kind in (JournalKind.ADMIT, JournalKind.FINISH)
        )
        return [(pool_id, epoch, first_seq, last_seq, step, wall_ns, body, digest, index, checkpoint)]

    def insert(self, conn: sa.Connection, rows: Sequence[CompanionRow]) -> None:
        """Insert step rows, their index rows and checkpoints inside ``conn``'s transaction (COPY / executemany)."""
        insert_through_driver(conn, journal_steps, STEP_COLUMNS, [row[:-2] for row in rows])
        insert_through_driver(conn, journal_requests, INDEX_COLUMNS, [a for row in rows for a in row[-2]])
        insert_through_driver(conn, journal_checkpoints, CHECKPOINT_COLUMNS, [row[-1] for row in rows if row[-1]])

    def holds(self, conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> bool:
        """Whether the epoch's journal holds journal seq ``seq``."""
        table = journal_steps
        found = conn.execute(
            sa.select(table.c.first_seq).where(
                table.c.pool_id == pool_id,
                table.c.epoch == epoch,
                table.c.first_seq <= seq,
                table.c.last_seq >= seq,
            )
        ).first()
        return found is not None

    def num_bytes(self, rows: Sequence[CompanionRow]) -> int:
        """The bytes of the rows' bodies (and checkpoints') plus a fixed allowance per row."""
        return sum(len(row[6]) + _ROW_OVERHEAD_BYTES + (len(row[-1].body) if row[-1] else 0) for row in rows)


JOURNAL_TABLE = JournalTable()


def read_request_history(conn: sa.Connection, pool_id: str, request_id: str) -> RequestHistory | None:
    """``request_id``'s history in ``pool_id`` across every epoch; None when the journal never saw it.

    JournalGapError when a step row in its range is missing or altered, or a released delta is missing."""
    records = _old_request_records(conn, pool_id, request_id)
    if _has_steps(conn):
        records += _step_request_records(conn, pool_id, request_id)
    records.sort(key=lambda record: record[:2])
    return request_history(((epoch, kind, data) for epoch, _, kind, data in records), request_id)


def read_journal(conn: sa.Connection, pool_id: str, epoch: int | None = None) -> list[JournalEntry]:
    """The journal records of one epoch (None: every epoch) of ``pool_id``, in order (old and new layout),
    each OUTPUT named as ``step_entries`` names it."""
    entries = []
    table = request_journal
    if sa.inspect(conn).has_table(table.name):
        query = sa.select(table).where(table.c.pool_id == pool_id)
        if epoch is not None:
            query = query.where(table.c.epoch == epoch)
        entries = [
            JournalEntry(r.epoch, r.journal_seq, r.request_id, r.kind, r.step, r.wall_ns, json.loads(r.record))
            for r in conn.execute(query)
        ]
    if _has_steps(conn):
        entries += step_entries(read_step_rows(conn, pool_id, epoch))
    entries.sort(key=lambda entry: (entry.epoch, entry.journal_seq))
    return entries


def recovering_epoch(conn: sa.Connection, pool_id: str, epoch: int) -> int | None:
    """The epoch whose RECOVER record took crashed ``epoch`` over: ``epoch + 1`` when its journal opens
    with one naming ``epoch`` (recovery commits it in the transaction that opens the epoch, so it is the
    first step row's); None otherwise (``epoch`` closed, no journal, or the next epoch is not here).
    Reads one row."""
    if not has_journal_table(conn):
        return None
    following = epoch + 1
    entries: list[JournalEntry] = []
    if _has_steps(conn):
        table = journal_steps
        first = (
            sa.select(*_step_columns())
            .where(table.c.pool_id == pool_id, table.c.epoch == following)
            .order_by(table.c.first_seq)
            .limit(1)
        )
        entries += step_entries([StepRow(*row) for row in conn.execute(first)])
    if sa.inspect(conn).has_table(request_journal.name):  # the layout before journal_steps
        table = request_journal
        query = sa.select(table.c.record).where(
            table.c.pool_id == pool_id, table.c.epoch == following, table.c.kind == JournalKind.RECOVER.value
        )
        entries += [
            JournalEntry(following, 0, "", JournalKind.RECOVER.value, None, 0, json.loads(r))
            for r in conn.execute(query).scalars()
        ]
    named = any(e.kind == JournalKind.RECOVER.value and e.data.get("epoch") == epoch for e in entries)
    return following if named else None


def step_entries(rows: Sequence[StepRow]) -> list[JournalEntry]:
    """The records of step rows (ordered by epoch, first_seq), each named: an OUTPUT stored by its
    ADMIT's seq takes that ADMIT's id, or, where the ADMIT is not among ``rows``, its request's FINISH's
    (the live table after a segment left: such a request had finished, its FINISH lies after the
    cut). Failing both (a segment file whose request was admitted in an older file and finished in
    a later part) it reads as ``unnamed_request_id(admit_seq)``."""
    entries: list[JournalEntry] = []
    names = AdmissionNames()
    unnamed: list[tuple[int, int]] = []  # (index in entries, admit seq) of the epoch's refs not named yet
    for i, row in enumerate(rows):
        for seq, (kind, request_id, data, admit_seq) in enumerate(
            names.name(row.first_seq, decode_step(row.body)), row.first_seq
        ):
            if request_id is None:
                assert admit_seq is not None, "a record is stored by its id or by its ADMIT's seq"
                unnamed.append((len(entries), admit_seq))
            entries.append(JournalEntry(row.epoch, seq, request_id or "", kind, row.step, row.wall_ns, data))
        if i + 1 == len(rows) or rows[i + 1].epoch != row.epoch:
            for index, admit_seq in unnamed:
                request_id = names.by_seq.get(admit_seq, unnamed_request_id(admit_seq))
                entries[index] = dataclasses.replace(entries[index], request_id=request_id)
            names, unnamed = AdmissionNames(), []
    return entries


def unnamed_request_id(admit_seq: int) -> str:
    """What ``step_entries`` calls a request whose ADMIT (journal seq ``admit_seq``) and FINISH it did not read."""
    return f"<ADMIT at journal seq {admit_seq}>"


def read_step_rows(conn: sa.Connection, pool_id: str, epoch: int | None = None, from_seq: int = 1) -> list[StepRow]:
    """The ``journal_steps`` rows of one epoch (None: every epoch) of ``pool_id``, by (epoch, first_seq);
    with ``from_seq``, only those whose first seq is ``from_seq`` or later."""
    table = journal_steps
    query = sa.select(*_step_columns()).where(table.c.pool_id == pool_id)
    if epoch is not None:
        query = query.where(table.c.epoch == epoch)
    if from_seq > 1:
        query = query.where(table.c.first_seq >= from_seq)
    return [StepRow(*row) for row in conn.execute(query.order_by(table.c.epoch, table.c.first_seq))]


def read_live_requests(conn: sa.Connection, pool_id: str, epoch: int) -> tuple[LiveRequests, int] | None:
    """The requests live at the end of the epoch's journal (admitted, no FINISH), from its newest
    checkpoint and the step rows after it, with the checkpoint's journal seq; None when the epoch has
    no checkpoint (written before migration 0006, or shorter than one) or it does not verify: its hash
    must link to its step row, that row to the row before it, and the rows after it must chain."""
    if not sa.inspect(conn).has_table(journal_checkpoints.name):
        return None
    table = journal_checkpoints
    found = conn.execute(
        sa.select(table.c.last_seq, table.c.body, table.c.hash)
        .where(table.c.pool_id == pool_id, table.c.epoch == epoch)
        .order_by(table.c.last_seq.desc())
        .limit(1)
    ).first()
    if found is None:
        return None
    last_seq, body, digest = found
    steps = journal_steps
    anchor = conn.execute(
        sa.select(steps.c.first_seq)
        .where(steps.c.pool_id == pool_id, steps.c.epoch == epoch, steps.c.first_seq <= last_seq)
        .order_by(steps.c.first_seq.desc())
        .limit(1)
    ).scalar()
    if anchor is None:
        return None
    rows = read_step_rows(conn, pool_id, epoch, from_seq=anchor)
    previous, next_seq = _chain_before(conn, pool_id, epoch, anchor)
    if rows[0].last_seq != last_seq or verify_journal_chain(pool_id, rows, previous=previous, first_seq=next_seq):
        return None
    if checkpoint_hash(rows[0].hash, last_seq, body) != digest:
        return None
    try:
        live = decode_live(body)
    except ValueError:
        return None
    for row in rows[1:]:
        for seq, record in enumerate(decode_step(row.body), row.first_seq):
            if record.request_id is not None:  # an ADMIT or FINISH is named; an OUTPUT changes nothing
                live.apply(seq, record.kind, record.request_id)
    return live, last_seq


def _chain_before(conn: sa.Connection, pool_id: str, epoch: int, seq: int) -> tuple[bytes, int]:
    """The hash the epoch's step row holding ``seq`` (or the first after it) chains from, and that row's
    first seq as the chain has it: the row before's (hash, last_seq + 1), else the cut's (the manifest's
    companion head hash, the cut's first seq) when older rows are archived, else (genesis, 1)."""
    table = journal_steps
    before = conn.execute(
        sa.select(table.c.last_seq, table.c.hash)
        .where(table.c.pool_id == pool_id, table.c.epoch == epoch, table.c.first_seq < seq, table.c.last_seq < seq)
        .order_by(table.c.first_seq.desc())
        .limit(1)
    ).first()
    if before is not None:
        return before.hash, before.last_seq + 1
    cut = companion_cut(conn, pool_id, epoch)  # the epoch's first kept row: after its genesis, or its segments
    return (journal_genesis(pool_id, epoch), 1) if cut is None else (cut.previous_hash, cut.first_seq)


def audit_journal(conn: sa.Connection, pool_id: str, epoch: int | None = None) -> list[JournalDamage]:
    """The first damaged or missing step row of each epoch (None: every epoch) of ``pool_id``, then each
    journal checkpoint whose hash does not link to its step row (kind "checkpoint"); [] when clean.

    An epoch whose older rows are archived as segments is checked from its cut,
    chained from the manifest's companion head hash; its checkpoints before the cut
    (their step rows archived) are not checked here."""
    if not _has_steps(conn):
        return []
    rows = read_step_rows(conn, pool_id, epoch)
    starts = {}
    for row_epoch in sorted({row.epoch for row in rows}):
        cut = companion_cut(conn, pool_id, row_epoch)
        if cut is not None:
            starts[row_epoch] = (cut.previous_hash, cut.first_seq)
    damages = verify_journal_chain(pool_id, rows, starts=starts)
    if not sa.inspect(conn).has_table(journal_checkpoints.name):
        return damages
    step_hashes = {(row.epoch, row.last_seq): row.hash for row in rows}
    table = journal_checkpoints
    query = sa.select(table.c.epoch, table.c.last_seq, table.c.body, table.c.hash).where(table.c.pool_id == pool_id)
    if epoch is not None:
        query = query.where(table.c.epoch == epoch)
    for checkpoint in conn.execute(query.order_by(table.c.epoch, table.c.last_seq)):
        start = starts.get(checkpoint.epoch)
        if start is not None and checkpoint.last_seq < start[1]:
            continue  # its step row went into a segment file with the rows before the cut
        step_hash = step_hashes.get((checkpoint.epoch, checkpoint.last_seq))
        if step_hash is None or checkpoint_hash(step_hash, checkpoint.last_seq, checkpoint.body) != checkpoint.hash:
            damages.append(JournalDamage(checkpoint.epoch, "checkpoint", checkpoint.last_seq, checkpoint.last_seq))
    return damages


def _step_columns() -> list[sa.ColumnElement[Any]]:
    table = journal_steps
    return [
        table.c.epoch,
        table.c.first_seq,
        table.c.last_seq,
        table.c.step,
        table.c.wall_ns,
        table.c.body,
        table.c.hash,
    ]


# (epoch, journal_seq, kind, payload)
_Record = tuple[int, int, str, dict[str, Any]]


def _old_request_records(conn: sa.Connection, pool_id: str, request_id: str) -> list[_Record]:
    table = request_journal
    if not sa.inspect(conn).has_table(table.name):
        return []
    rows = conn.execute(
        sa.select(table.c.epoch, table.c.journal_seq, table.c.kind, table.c.record).where(
            table.c.pool_id == pool_id, table.c.request_id == request_id
        )
    )
    return [(r.epoch, r.journal_seq, r.kind, json.loads(r.record)) for r in rows]


def _step_request_records(conn: sa.Connection, pool_id: str, request_id: str) -> list[_Record]:
    """The request's records in the step rows: in each epoch that indexes it, from its first ADMIT or
    FINISH there to its FINISH (or the epoch's end), the rows checked contiguous and unaltered."""
    admissions = journal_requests
    spans: dict[int, tuple[int, int]] = {}  # epoch -> (first, last) indexed seq of the id there
    for epoch, seq in conn.execute(
        sa.select(admissions.c.epoch, admissions.c.journal_seq).where(
            admissions.c.pool_id == pool_id, admissions.c.request_id == request_id
        )
    ):
        first, last = spans.get(epoch, (seq, seq))
        spans[epoch] = (min(first, seq), max(last, seq))
    records: list[_Record] = []
    for epoch, (first, last) in sorted(spans.items()):
        records += _epoch_request_records(conn, pool_id, epoch, first, last, request_id)
    return records


def _epoch_request_records(
    conn: sa.Connection, pool_id: str, epoch: int, first: int, last: int, request_id: str
) -> list[_Record]:
    """The id's records of one epoch from ``first`` on: up to the FINISH at ``last`` (an id reused in the
    epoch holds one request after another), or to the epoch's end when ``last`` is no FINISH."""
    table = journal_steps
    in_epoch = (table.c.pool_id == pool_id, table.c.epoch == epoch)
    previous, next_seq = _chain_before(conn, pool_id, epoch, first)
    rows = conn.execute(
        # first_seq >= next_seq: an index range from the row holding ``first``, not a scan of the epoch
        sa.select(*_step_columns())
        .where(*in_epoch, table.c.first_seq >= next_seq, table.c.last_seq >= first)
        .order_by(table.c.first_seq)
    )
    records: list[_Record] = []
    admissions: set[int] = set()  # the seqs of the id's ADMITs: its OUTPUTs name one, at ``first`` or after
    for row in rows:
        step_row = StepRow(*row)
        damage = verify_journal_chain(pool_id, [step_row], previous=previous, first_seq=next_seq)
        if damage:
            raise JournalGapError(request_id, damage[0].describe())
        previous, next_seq = step_row.hash, step_row.last_seq + 1
        for seq, (kind, rid, data, admit_seq) in enumerate(decode_step(step_row.body), step_row.first_seq):
            if rid == request_id and kind == JournalKind.ADMIT.value:
                admissions.add(seq)
            if (rid == request_id or (rid is None and admit_seq in admissions)) and seq >= first:
                records.append((epoch, seq, kind, data))
                if kind == JournalKind.FINISH.value and seq >= last:
                    return records
    return records


def check_journal_schema(url: str) -> None:
    """LogNotFoundError when the log at ``url`` lacks the journal's tables (its schema predates migration 0006)."""
    engine = create_log_engine(url)
    try:
        with engine.connect() as conn:
            if not (_has_steps(conn) and sa.inspect(conn).has_table(journal_checkpoints.name)):
                shown = safe_url(url)
                raise LogNotFoundError(
                    f"{shown!r} lacks the request journal's tables (run `nanoserve db upgrade {shown}`, or serve with "
                    "--no-journal)"
                )
    finally:
        engine.dispose()


def has_journal_table(conn: sa.Connection) -> bool:
    """Whether the database holds a journal (a log older than migration 0003 does not)."""
    inspector = sa.inspect(conn)
    return bool(inspector.has_table(request_journal.name) or inspector.has_table(journal_steps.name))


def _has_steps(conn: sa.Connection) -> bool:
    """Whether the database holds the step rows' table (migration 0005)."""
    return bool(sa.inspect(conn).has_table(journal_steps.name))
