"""Protobuf <-> allocator types for the nanoserve.v1 Allocation contract: pool status, allocation
events, audit reports, and the WatchEvents / Audit request fields.

The allocator and the engine never see protobuf; ``convert`` does the same for the Generation contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from nanoserve.allocator import EventKind, FreeReason
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.v1 import allocation_pb2 as apb

if TYPE_CHECKING:  # the engine proper imports torch; these are only types here
    from nanoserve.allocator.log import AuditReport, Event
    from nanoserve.engine import PoolStatus

# One table per enum of the contract: the allocator's names <-> proto values. An UNSPECIFIED (0)
# value is never in a table: on the way out it stands for a name this table lacks.
EVENT_KINDS: dict[str, apb.EventKind] = {
    EventKind.POOL_INIT.value: apb.EVENT_KIND_POOL_INIT,
    EventKind.ALLOCATE.value: apb.EVENT_KIND_ALLOCATE,
    EventKind.ALLOCATE_FOR.value: apb.EVENT_KIND_ALLOCATE_FOR,
    EventKind.FREE.value: apb.EVENT_KIND_FREE,
    EventKind.FREE_ALL.value: apb.EVENT_KIND_FREE_ALL,
    EventKind.SNAPSHOT.value: apb.EVENT_KIND_SNAPSHOT,
    EventKind.POOL_CLOSE.value: apb.EVENT_KIND_POOL_CLOSE,
    EventKind.REGISTER.value: apb.EVENT_KIND_REGISTER,
    EventKind.SHARE.value: apb.EVENT_KIND_SHARE,
    EventKind.RELEASE.value: apb.EVENT_KIND_RELEASE,
    EventKind.EVICT.value: apb.EVENT_KIND_EVICT,
    EventKind.CACHE_RESET.value: apb.EVENT_KIND_CACHE_RESET,
    EventKind.FORK.value: apb.EVENT_KIND_FORK,
    EventKind.COPY.value: apb.EVENT_KIND_COPY,
}
FREE_REASONS: dict[str, apb.FreeReason] = {
    FreeReason.FINISHED.value: apb.FREE_REASON_FINISHED,
    FreeReason.ABORTED.value: apb.FREE_REASON_ABORTED,
    FreeReason.PREEMPTED.value: apb.FREE_REASON_PREEMPTED,
    FreeReason.REJECTED_DRAFT.value: apb.FREE_REASON_REJECTED_DRAFT,
    FreeReason.DRAFT.value: apb.FREE_REASON_DRAFT,
}
# the rules the allocator's replay and audit check (``Violation.rule``)
AUDIT_RULES: dict[str, apb.AuditRule] = {
    "missing_events": apb.AUDIT_RULE_MISSING_EVENTS,
    "out_of_order": apb.AUDIT_RULE_OUT_OF_ORDER,
    "hash_mismatch": apb.AUDIT_RULE_HASH_MISMATCH,
    "seq_mismatch": apb.AUDIT_RULE_SEQ_MISMATCH,
    "bad_record": apb.AUDIT_RULE_BAD_RECORD,
    "column_mismatch": apb.AUDIT_RULE_COLUMN_MISMATCH,
    "torn_batch": apb.AUDIT_RULE_TORN_BATCH,
    "after_close": apb.AUDIT_RULE_AFTER_CLOSE,
    "misplaced_init": apb.AUDIT_RULE_MISPLACED_INIT,
    "unknown_kind": apb.AUDIT_RULE_UNKNOWN_KIND,
    "allocate_of_allocated": apb.AUDIT_RULE_ALLOCATE_OF_ALLOCATED,
    "foreign_block": apb.AUDIT_RULE_FOREIGN_BLOCK,
    "free_of_free_block": apb.AUDIT_RULE_FREE_OF_FREE_BLOCK,
    "owner_mismatch": apb.AUDIT_RULE_OWNER_MISMATCH,
    "bad_snapshot": apb.AUDIT_RULE_BAD_SNAPSHOT,
    "snapshot_mismatch": apb.AUDIT_RULE_SNAPSHOT_MISMATCH,
    "missing_close": apb.AUDIT_RULE_MISSING_CLOSE,
    "leaked_block": apb.AUDIT_RULE_LEAKED_BLOCK,
    "unreadable": apb.AUDIT_RULE_UNREADABLE,
    "ref_count_mismatch": apb.AUDIT_RULE_REF_COUNT_MISMATCH,
    "ref_on_evicted": apb.AUDIT_RULE_REF_ON_EVICTED,
    "stale_key": apb.AUDIT_RULE_STALE_KEY,
    "double_register": apb.AUDIT_RULE_DOUBLE_REGISTER,
    "register_of_unheld": apb.AUDIT_RULE_REGISTER_OF_UNHELD,
    "append_to_shared": apb.AUDIT_RULE_APPEND_TO_SHARED,
    "fork_of_unheld": apb.AUDIT_RULE_FORK_OF_UNHELD,
    "copy_source_not_parents": apb.AUDIT_RULE_COPY_SOURCE_NOT_PARENTS,
    "copy_of_unheld": apb.AUDIT_RULE_COPY_OF_UNHELD,
    "copy_of_unshared": apb.AUDIT_RULE_COPY_OF_UNSHARED,
    "rollback_of_non_draft": apb.AUDIT_RULE_ROLLBACK_OF_NON_DRAFT,
}


# the largest epoch the log's Integer column holds
MAX_EPOCH = 2**31 - 1


def to_from_seq(request: apb.WatchEventsRequest) -> int:
    """The first seq a WatchEvents stream asks for (0 and 1 both mean the first); InvalidRequestError
    ("from_seq") when negative. Whether it is past the epoch's next event is the servicer's check."""
    if request.from_seq < 0:
        raise InvalidRequestError("from_seq", f"must be >= 0, got {request.from_seq}")
    return max(request.from_seq, 1)


MAX_EVENTS_PER_MESSAGE = 1024  # WatchEventsRequest.max_events_per_message: at most this many events a message


def to_max_events_per_message(request: apb.WatchEventsRequest) -> int:
    """The events one WatchEvents message may hold (0 is 1); InvalidRequestError ("max_events_per_message")
    outside [0, MAX_EVENTS_PER_MESSAGE]."""
    if not 0 <= request.max_events_per_message <= MAX_EVENTS_PER_MESSAGE:
        raise InvalidRequestError(
            "max_events_per_message", f"must be in [0, {MAX_EVENTS_PER_MESSAGE}], got {request.max_events_per_message}"
        )
    return max(request.max_events_per_message, 1)


def to_audit_epoch(request: apb.AuditRequest, default: int) -> int:
    """The epoch an Audit asks for (``default`` when unset); InvalidRequestError ("epoch") outside
    [1, MAX_EPOCH], the range the log can hold."""
    if not request.HasField("epoch"):
        return default
    if not 1 <= request.epoch <= MAX_EPOCH:
        raise InvalidRequestError("epoch", f"must be in [1, {MAX_EPOCH}], got {request.epoch}")
    return request.epoch


def to_pool_status(status: PoolStatus) -> apb.GetPoolStatusResponse:
    return apb.GetPoolStatusResponse(
        pool_id=status.pool_id,
        epoch=status.epoch or 0,
        num_blocks=status.num_blocks,
        block_size=status.block_size,
        num_free=status.num_free,
        num_allocated=status.num_allocated,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        last_seq=status.last_seq or 0,
        durable_seq=status.durable_seq or 0,
        num_cached=status.num_cached,
        num_cached_free=status.num_cached_free,
        num_shared=status.num_shared,
        prefix_cache_queries=status.prefix_cache_queries,
        prefix_cache_hits=status.prefix_cache_hits,
        enable_prefix_caching=status.enable_prefix_caching,
        tenants=[
            apb.TenantUsage(
                tenant=usage.scope,
                num_running=usage.num_running,
                num_waiting=usage.num_waiting,
                num_blocks_held=usage.num_blocks_held,
            )
            for usage in status.scopes
        ],
        num_forked_blocks=status.num_forked_blocks,
        num_copied_blocks=status.num_copied_blocks,
        num_draft_tokens=status.num_draft_tokens,
        num_accepted_draft_tokens=status.num_accepted_draft_tokens,
    )


def to_event(event: Event) -> apb.AllocationEvent:
    """A stored event; a kind or free reason the tables lack (a newer log) is UNSPECIFIED."""
    wall_time = Timestamp()
    wall_time.FromNanoseconds(event.wall_time_ns)
    monotonic_time = Duration()
    monotonic_time.FromNanoseconds(event.monotonic_ns)
    message = apb.AllocationEvent(
        seq=event.seq,
        pool_id=event.pool_id,
        epoch=event.epoch,
        kind=EVENT_KINDS.get(event.kind, apb.EVENT_KIND_UNSPECIFIED),
        block_ids=event.block_ids,
        owner=event.owner or "",
        free_reason=FREE_REASONS.get(event.reason or "", apb.FREE_REASON_UNSPECIFIED),
        wall_time=wall_time,
        monotonic_time=monotonic_time,
        hash=event.hash.hex(),
        keys=event.keys,
        parent_keys=[parent or "" for parent in event.parent_keys],
        ref_counts=event.ref_counts,
        parent=event.parent or "",
        partial=event.partial,
    )
    if event.step is not None:
        message.step = event.step
    return message


def to_audit_response(report: AuditReport, live_epoch: int | None = None) -> apb.AuditResponse:
    """``live_epoch``: the serving process's own epoch of the report's pool: open, it is running; an
    older open one crashed (this server opened the pool after it, as ``log audit`` says too). A rule
    ``AUDIT_RULES`` lacks is UNSPECIFIED, its name leading the violation's message."""
    open_status = "open (running, or crashed)"
    if live_epoch is not None and report.epoch == live_epoch:
        open_status = "open (live: this server's epoch)"
    elif live_epoch is not None and report.epoch < live_epoch:
        open_status = f"crashed; epoch {live_epoch} (this server's) opened the pool after it"
    message = apb.AuditResponse(
        pool_id=report.pool_id,
        epoch=report.epoch,
        clean=report.clean,
        closed=report.closed,
        num_events=report.num_events,
        last_seq=report.last_seq,
        summary=report.render(open_status=open_status),
    )
    for violation in report.violations:
        rule = AUDIT_RULES.get(violation.rule, apb.AUDIT_RULE_UNSPECIFIED)
        entry = apb.Violation(
            seq=violation.seq,
            rule=rule,
            owner=violation.owner or "",
            message=violation.message if rule else f"{violation.rule}: {violation.message}",
        )
        if violation.block_id is not None:
            entry.block_id = violation.block_id
        if violation.plot_range is not None:
            entry.plot_from_seq, entry.plot_to_seq = violation.plot_range
        message.violations.append(entry)
    held = report.leaked if report.closed else report.state.owners
    message.held_blocks.extend(apb.BlockOwner(block_id=b, owner=o or "") for b, o in sorted(held.items()))
    return message
