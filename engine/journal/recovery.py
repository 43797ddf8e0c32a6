"""Recovery after a crash: which requests of the crashed epoch the new epoch takes over.

A server that opens a pool whose newest epoch is still open (no POOL_CLOSE:
the server died; the pool's lock, which this server holds, proves nobody
writes it) reads that epoch's journal. Every request admitted there without
a FINISH is unfinished: the new epoch re-admits it (an ADMIT with
``recovered_from``) unless its deadline has passed (FINISH, abort cause
``deadline``) or it arrived longer than ``retention_s`` ago (FINISH, abort cause
``not_recovered``), each FINISH saying why in words (``abort_detail``, which
``Resume`` and ``log requests`` show). Requests that ended (finished, aborted, cancelled) stay
ended. A RECOVER record names the crashed epoch, its last durable seq and who
held which blocks there (from its audit), and lists both groups.

The audit that gives the holders reads only the tail since the crashed
epoch's newest verified checkpoint (``audit_epoch(from_checkpoint=True)``:
a SNAPSHOT whose own hash links to the row before it, then every row after
it checked and chained to the epoch's head hash), so recovery takes the same
time after a minute's uptime as after a week's; the rows before the
checkpoint are verified offline, by ``nanoserve log audit``. The journal is read
the same way: the unfinished requests come from the epoch's newest verified
journal checkpoint (``live_requests``: the requests live at a journal seq, stored
every few thousand records) and the step rows after it; then only the unfinished
requests' own histories are read. An epoch without a checkpoint that verifies
(written before migration 0006, or damaged) is read whole, as before.

All of these records commit in the transaction that opens the new epoch
(``EventLog.open(prepare_journal=...)``): a crash during recovery leaves either
no new epoch (the next start recovers the same epoch again) or a new epoch that
holds every re-admission (the next start recovers from it). A request is
therefore recovered once, whatever the number of restarts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

from nanoserve.allocator.log.audit import audit_epoch
from nanoserve.allocator.log.reader import list_epochs
from nanoserve.engine.errors import JournalGapError
from nanoserve.engine.journal.live_requests import LiveRequests
from nanoserve.engine.journal.records import JournalKind, RequestHistory
from nanoserve.engine.journal.store import (
    JournalRecord,
    has_journal_table,
    read_journal,
    read_live_requests,
    read_request_history,
)

NOT_RECOVERED = "not_recovered"  # abort cause of a request past the retention
DEADLINE = "deadline"


@dataclass
class RecoveryPlanner:
    """``EventLog.open``'s ``prepare_journal``: plans the recovery of the pool's crashed epoch.

    After ``open``: ``recovered_epoch`` is the crashed epoch taken over (None:
    the newest epoch was closed, or there was none), ``recovered`` the histories
    of the requests re-admitted (in admission order), ``ended`` request id ->
    abort cause of those left ended; ``audit_from_seq`` the event seq the crashed
    epoch's audit began at (its checkpoint's; 1: from genesis) and
    ``journal_from_seq`` the journal seq its journal was read after (its
    checkpoint's; 0: read whole).

    retention_s: requests that arrived longer ago than this are not recovered.
    """

    retention_s: float
    recovered_epoch: int | None = None
    audit_from_seq: int | None = None
    journal_from_seq: int | None = None
    log_open_s: float | None = None  # seconds the open took, this planning included (set by its opener)
    recovered: list[RequestHistory] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)
    _ended_at: dict[str, int] = field(default_factory=dict)  # request id -> its journaled tokens
    _ended_why: dict[str, str] = field(default_factory=dict)  # request id -> why it ended, in words

    def __call__(self, engine: sa.Engine, pool_id: str, epoch: int) -> Sequence[JournalRecord]:
        with engine.connect() as conn:
            if not has_journal_table(conn):
                return []
            previous = [info for info in list_epochs(conn, pool_id) if info.epoch < epoch]
            if not previous or previous[-1].closed:
                return []
            crashed = previous[-1]
            report = audit_epoch(conn, crashed, from_checkpoint=True)  # the tail since the last checkpoint
            self.audit_from_seq = report.from_seq
            now_ns = time.time_ns()
            unfinished, self.journal_from_seq = unfinished_ids(conn, pool_id, crashed.epoch)
            for request_id in unfinished:
                try:
                    history = read_request_history(conn, pool_id, request_id)
                except JournalGapError as exc:  # its outputs cannot be restored whole: not taken over
                    self.ended[request_id] = NOT_RECOVERED
                    self._ended_at[request_id] = 0
                    self._ended_why[request_id] = f"its journaled outputs cannot be restored whole: {exc}"
                    continue
                if history is None or history.finish is not None:
                    continue
                ending = self._ending(history, now_ns)
                if ending is None:
                    self.recovered.append(history)
                else:
                    self.ended[request_id], self._ended_why[request_id] = ending
                    self._ended_at[request_id] = history.num_tokens
        self.recovered_epoch = crashed.epoch
        holders = {owner: list(blocks) for owner, blocks in report.state.blocks_by_owner().items()}
        records = [
            JournalRecord(
                JournalKind.RECOVER,
                "",
                {
                    "epoch": crashed.epoch,
                    "last_seq": report.last_seq,
                    "holders": holders,
                    "recovered": [history.request_id for history in self.recovered],
                    "ended": self.ended,
                },
            )
        ]
        for history in self.recovered:
            admit = dict(history.admit, recovered_from=crashed.epoch, num_prior_tokens=history.num_tokens)
            records.append(JournalRecord(JournalKind.ADMIT, history.request_id, admit))
        for request_id, cause in self.ended.items():
            records.append(
                JournalRecord(
                    JournalKind.FINISH,
                    request_id,
                    ended_record(cause, self._ended_at[request_id], self._ended_why[request_id]),
                )
            )
        return records

    def _ending(self, history: RequestHistory, now_ns: int) -> tuple[str, str] | None:
        """Why an unfinished request is not re-admitted (abort cause, in words); None when it is."""
        deadline_ns = history.admit.get("deadline_wall_ns")
        if deadline_ns is not None and deadline_ns <= now_ns:
            return DEADLINE, "its deadline passed before a server took the pool over"
        age_s = (now_ns - history.admit["arrival_wall_ns"]) / 1e9
        if age_s > self.retention_s:
            return NOT_RECOVERED, (
                f"it arrived {age_s:.0f} s before the restart, longer ago than the journal's retention "
                f"({self.retention_s:g} s, --journal-retention-s)"
            )
        return None


def ended_record(cause: str, start: int = 0, detail: str | None = None) -> dict[str, object]:
    """A FINISH payload for a request that recovery leaves ended (no new tokens); ``detail``, why in
    words, is its ``abort_detail``."""
    record: dict[str, object] = {
        "start": start,
        "token_ids": [],
        "text": "",
        "finish_reason": "abort",
        "stop_reason": None,
        "abort_cause": cause,
    }
    if detail is not None:
        record["abort_detail"] = detail
    return record


def unfinished_ids(conn: sa.Connection, pool_id: str, epoch: int) -> tuple[list[str], int]:
    """Request ids admitted in ``epoch`` with no FINISH there, in admission order, and the journal seq
    they were read after: the epoch's newest verified checkpoint's (``read_live_requests``), or 0 when
    the epoch has none and its whole journal was read."""
    from_checkpoint = read_live_requests(conn, pool_id, epoch)
    if from_checkpoint is not None:
        live, checkpoint_seq = from_checkpoint
        return live.ids(), checkpoint_seq
    live = LiveRequests()
    for entry in read_journal(conn, pool_id, epoch):
        live.apply(entry.journal_seq, entry.kind, entry.request_id)
    return live.ids(), 0
