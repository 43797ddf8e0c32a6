"""Audit: replay a whole epoch from its genesis and report what it shows.

An epoch is clean when its log breaks no rule (see ``replay``, and
``draft_audit`` for speculative decoding's rollbacks). At a clean
close every block must be free; blocks still held are leaks (a violation,
listed with their owners). An epoch without POOL_CLOSE crashed: that is not a
violation of the log, and the report gives the pool as it stood at the last
durable event (which owner held which blocks).

Each violation carries the seq range to plot to see what led to it
(``Violation.plot_range``, see ``plot_range.HoldingStarts``): found by one more
read of the epoch, made only when there are violations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import sqlalchemy as sa

from nanoserve.allocator.log.draft_audit import draft_violations
from nanoserve.allocator.log.errors import LogNotFoundError
from nanoserve.allocator.log.intact_fold import fold_intact
from nanoserve.allocator.log.plot_range import HoldingStarts, plot_range
from nanoserve.allocator.log.reader import (
    EpochInfo,
    connect,
    event_rows,
    list_epochs,
    resolve_epoch,
    to_event,
)
from nanoserve.allocator.log.replay import checkpoint_start, replay_epoch
from nanoserve.allocator.log.row_scan import packed_row_holding
from nanoserve.allocator.log.segment import cut_start
from nanoserve.allocator.pool_state import PoolState, Violation


@dataclass
class AuditReport:
    """What the audit of one epoch found.

    state: the pool after the last stored event (for a crashed epoch: as it
        stood at the crash, as far as it is durable).
    leaked: block_id -> owner of blocks still held at a clean close.
    from_seq: the seq the audit began at (1: from genesis; else a checkpoint,
        and ``num_events`` counts the rows from there).
    """

    pool_id: str
    epoch: int
    num_events: int
    last_seq: int
    closed: bool
    state: PoolState
    violations: list[Violation] = field(default_factory=list)
    leaked: dict[int, str] = field(default_factory=dict)
    from_seq: int = 1  # the first seq read: 1 for a full audit, a checkpoint's seq for a tail audit
    num_archived: int = 0  # seqs 1..num_archived are archived as segments (a full audit starts after them)
    # which path replayed it: True the C fold of an intact epoch (``intact_fold``), False the Python replay;
    # both give the same report, so it takes no part in ``==``
    folded: bool = field(default=False, compare=False)

    @property
    def clean(self) -> bool:
        return not self.violations

    @property
    def crashed(self) -> bool:
        return not self.closed

    @property
    def first_bad_seq(self) -> int | None:
        return min((violation.seq for violation in self.violations), default=None)

    def render(self, open_status: str = "open (running, or crashed)") -> str:
        """A short human-readable account; ``open_status`` names an epoch without
        POOL_CLOSE (the log alone cannot tell a running server from a crashed one,
        the server that writes the epoch can)."""
        head = f"pool {self.pool_id!r} epoch {self.epoch}: {self.num_events} events, last seq {self.last_seq}, "
        head += "closed" if self.closed else open_status
        lines = [head]
        if self.num_archived:
            lines.append(
                f"  seqs 1..{self.num_archived} archived (audited from seq {self.from_seq}, chained to the manifest's "
                "head hash; `log audit --archive FILE` audits each segment file)"
            )
        if self.clean:
            lines.append("  clean")
        else:
            lines.append(f"  {len(self.violations)} violation(s), first bad seq {self.first_bad_seq}:")
            lines.extend(f"    {violation}{_plot_hint(violation)}" for violation in self.violations)
        if not self.closed:
            held = self.state.blocks_by_owner()
            lines.append(f"  at the last durable event (seq {self.last_seq}): {self.state.num_free} free blocks")
            lines.extend(f"    {owner!r} held blocks {blocks}" for owner, blocks in held.items())
        return "\n".join(lines)


def audit_epoch(
    conn: sa.Connection, info: EpochInfo, *, from_checkpoint: bool = False, fold: bool = True
) -> AuditReport:
    """Audit one epoch on an open connection (see ``audit``).

    An intact epoch is folded in C (``intact_fold``; ``AuditReport.folded``),
    any other replayed by the Python ``Replayer``, which names what is wrong:
    the report is the same either way. ``fold`` False: the Python replay
    alone (the reference the fold is tested and benchmarked against).

    from_checkpoint: audit only the tail since the epoch's newest verified
    checkpoint (``replay.checkpoint_start``: a SNAPSHOT whose own hash links
    to the stored hash before it), trusting the rows before it unread: what
    recovery does before serving, in constant time. The report's
    ``from_seq`` is then the checkpoint's seq and ``num_events`` counts the
    rows from there; the full audit (the default, and ``log audit``) reads
    the epoch from genesis, or from its cut when its older part is archived
    (``segment.cut_start``: the first stored row chained to the manifest's head hash).
    """
    folded = fold_intact(conn, info) if fold and not from_checkpoint else None
    if folded is not None:
        replayer = folded.replayer
    else:
        start = (lambda: checkpoint_start(conn, info)) if from_checkpoint else (lambda: cut_start(conn, info))
        replayer = replay_epoch(conn, info, None, start)
        replayer.finish()
    closed_seq = replayer.closed_seq
    closed = closed_seq is not None
    leaked: dict[int, str] = {}
    if closed_seq is not None:
        leaked = dict(sorted(replayer.pool.owners.items()))
        for block_id, owner in leaked.items():
            replayer.violate(closed_seq, "leaked_block", "block still allocated at POOL_CLOSE", block_id, owner)
    state = replayer.state()
    found = list(replayer.violations)
    if folded is None or folded.has_drafts:  # the fold saw every record: without a draft reason, the rule holds
        found += draft_violations(conn, info, replayer.start_seq)
    violations = _in_packed_rows(conn, info, sorted(found, key=lambda violation: violation.seq))
    return AuditReport(
        pool_id=info.pool_id,
        epoch=info.epoch,
        num_events=replayer.num_events,
        last_seq=replayer.last_seq,
        closed=closed,
        state=state,
        violations=_with_plot_ranges(conn, info, violations, replayer.last_seq),
        leaked=leaked,
        from_seq=replayer.start_seq,
        num_archived=0 if from_checkpoint else replayer.start_seq - 1,
        folded=folded is not None,
    )


def _in_packed_rows(conn: sa.Connection, info: EpochInfo, violations: list[Violation]) -> list[Violation]:
    """The violations, each ``hash_mismatch`` at the last seq of a packed row naming the row's seqs: its
    stored hash covers them all (and the keys it names by id, ``key_refs``)."""
    named = []
    for violation in violations:
        row = (
            None
            if violation.rule != "hash_mismatch"
            else packed_row_holding(conn, info.pool_id, info.epoch, violation.seq)
        )
        if row is not None and (row[0] < row[1] or row[2]):
            first, last, keyed = row
            where = f"seqs {first}..{last} are one packed row" if first < last else f"seq {first} is a packed row"
            what = "one of its records, or a key it names by id (allocator_keys)," if keyed else "one of its records"
            violation = dataclasses.replace(violation, message=f"{violation.message} ({where}: {what} changed)")
        named.append(violation)
    return named


def _with_plot_ranges(
    conn: sa.Connection, info: EpochInfo, violations: list[Violation], last_seq: int
) -> list[Violation]:
    """The violations with their ``plot_range``, from the holdings of their blocks up to the last violation."""
    if not violations:
        return violations
    holdings = HoldingStarts()
    until_seq = min(max(violation.seq for violation in violations), last_seq)
    try:
        for chunk in event_rows(conn, info.pool_id, info.epoch, 1, until_seq):
            holdings.apply(to_event(info.pool_id, info.epoch, row) for row in chunk)
    except ValueError:
        pass  # a malformed record: the holdings read so far still place the violations before it
    return [
        dataclasses.replace(
            violation,
            plot_range=plot_range(violation.seq, holdings.holding_start(violation.seq, violation.block_id), last_seq),
        )
        for violation in violations
    ]


def _plot_hint(violation: Violation) -> str:
    if violation.plot_range is None:
        return ""
    first, last = violation.plot_range
    return f" (plot --from {first} --to {last})"


def audit(url: str, pool_id: str | None = None, epoch: int | None = None, *, fold: bool = True) -> AuditReport:
    """Audit one epoch: ``pool_id`` None means the log's only pool, ``epoch`` None its newest; ``fold``
    False replays it in Python alone (see ``audit_epoch``).

    Raises LogNotFoundError (a ValueError) for an unknown log, pool or epoch.
    """
    with connect(url) as conn:
        return audit_epoch(conn, resolve_epoch(conn, pool_id, epoch), fold=fold)


def audit_all(url: str, pool_id: str | None = None) -> list[AuditReport]:
    """Audit every epoch of one pool (or of every pool when ``pool_id`` is None)."""
    with connect(url) as conn:
        epochs = list_epochs(conn, pool_id)
        if not epochs:
            raise LogNotFoundError(
                "the log holds no pools" if pool_id is None else f"the log holds no pool {pool_id!r}"
            )
        return [audit_epoch(conn, info) for info in epochs]
