import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_POOL_INIT: _ClassVar[EventKind]
    EVENT_KIND_ALLOCATE: _ClassVar[EventKind]
    EVENT_KIND_ALLOCATE_FOR: _ClassVar[EventKind]
    EVENT_KIND_FREE: _ClassVar[EventKind]
    EVENT_KIND_FREE_ALL: _ClassVar[EventKind]
    EVENT_KIND_SNAPSHOT: _ClassVar[EventKind]
    EVENT_KIND_POOL_CLOSE: _ClassVar[EventKind]
    EVENT_KIND_REGISTER: _ClassVar[EventKind]
    EVENT_KIND_SHARE: _ClassVar[EventKind]
    EVENT_KIND_RELEASE: _ClassVar[EventKind]
    EVENT_KIND_EVICT: _ClassVar[EventKind]
    EVENT_KIND_CACHE_RESET: _ClassVar[EventKind]
    EVENT_KIND_FORK: _ClassVar[EventKind]
    EVENT_KIND_COPY: _ClassVar[EventKind]

class FreeReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FREE_REASON_UNSPECIFIED: _ClassVar[FreeReason]
    FREE_REASON_FINISHED: _ClassVar[FreeReason]
    FREE_REASON_ABORTED: _ClassVar[FreeReason]
    FREE_REASON_PREEMPTED: _ClassVar[FreeReason]
    FREE_REASON_REJECTED_DRAFT: _ClassVar[FreeReason]
    FREE_REASON_DRAFT: _ClassVar[FreeReason]

class AuditRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIT_RULE_UNSPECIFIED: _ClassVar[AuditRule]
    AUDIT_RULE_MISSING_EVENTS: _ClassVar[AuditRule]
    AUDIT_RULE_OUT_OF_ORDER: _ClassVar[AuditRule]
    AUDIT_RULE_HASH_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_SEQ_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_BAD_RECORD: _ClassVar[AuditRule]
    AUDIT_RULE_COLUMN_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_TORN_BATCH: _ClassVar[AuditRule]
    AUDIT_RULE_AFTER_CLOSE: _ClassVar[AuditRule]
    AUDIT_RULE_MISPLACED_INIT: _ClassVar[AuditRule]
    AUDIT_RULE_UNKNOWN_KIND: _ClassVar[AuditRule]
    AUDIT_RULE_ALLOCATE_OF_ALLOCATED: _ClassVar[AuditRule]
    AUDIT_RULE_FOREIGN_BLOCK: _ClassVar[AuditRule]
    AUDIT_RULE_FREE_OF_FREE_BLOCK: _ClassVar[AuditRule]
    AUDIT_RULE_OWNER_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_BAD_SNAPSHOT: _ClassVar[AuditRule]
    AUDIT_RULE_SNAPSHOT_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_MISSING_CLOSE: _ClassVar[AuditRule]
    AUDIT_RULE_LEAKED_BLOCK: _ClassVar[AuditRule]
    AUDIT_RULE_UNREADABLE: _ClassVar[AuditRule]
    AUDIT_RULE_REF_COUNT_MISMATCH: _ClassVar[AuditRule]
    AUDIT_RULE_REF_ON_EVICTED: _ClassVar[AuditRule]
    AUDIT_RULE_STALE_KEY: _ClassVar[AuditRule]
    AUDIT_RULE_DOUBLE_REGISTER: _ClassVar[AuditRule]
    AUDIT_RULE_REGISTER_OF_UNHELD: _ClassVar[AuditRule]
    AUDIT_RULE_APPEND_TO_SHARED: _ClassVar[AuditRule]
    AUDIT_RULE_FORK_OF_UNHELD: _ClassVar[AuditRule]
    AUDIT_RULE_COPY_SOURCE_NOT_PARENTS: _ClassVar[AuditRule]
    AUDIT_RULE_COPY_OF_UNHELD: _ClassVar[AuditRule]
    AUDIT_RULE_COPY_OF_UNSHARED: _ClassVar[AuditRule]
    AUDIT_RULE_ROLLBACK_OF_NON_DRAFT: _ClassVar[AuditRule]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_POOL_INIT: EventKind
EVENT_KIND_ALLOCATE: EventKind
EVENT_KIND_ALLOCATE_FOR: EventKind
EVENT_KIND_FREE: EventKind
EVENT_KIND_FREE_ALL: EventKind
EVENT_KIND_SNAPSHOT: EventKind
EVENT_KIND_POOL_CLOSE: EventKind
EVENT_KIND_REGISTER: EventKind
EVENT_KIND_SHARE: EventKind
EVENT_KIND_RELEASE: EventKind
EVENT_KIND_EVICT: EventKind
EVENT_KIND_CACHE_RESET: EventKind
EVENT_KIND_FORK: EventKind
EVENT_KIND_COPY: EventKind
FREE_REASON_UNSPECIFIED: FreeReason
FREE_REASON_FINISHED: FreeReason
FREE_REASON_ABORTED: FreeReason
FREE_REASON_PREEMPTED: FreeReason
FREE_REASON_REJECTED_DRAFT: FreeReason
FREE_REASON_DRAFT: FreeReason
AUDIT_RULE_UNSPECIFIED: AuditRule
AUDIT_RULE_MISSING_EVENTS: AuditRule
AUDIT_RULE_OUT_OF_ORDER: AuditRule
AUDIT_RULE_HASH_MISMATCH: AuditRule
AUDIT_RULE_SEQ_MISMATCH: AuditRule
AUDIT_RULE_BAD_RECORD: AuditRule
AUDIT_RULE_COLUMN_MISMATCH: AuditRule
AUDIT_RULE_TORN_BATCH: AuditRule
AUDIT_RULE_AFTER_CLOSE: AuditRule
AUDIT_RULE_MISPLACED_INIT: AuditRule
AUDIT_RULE_UNKNOWN_KIND: AuditRule
AUDIT_RULE_ALLOCATE_OF_ALLOCATED: AuditRule
AUDIT_RULE_FOREIGN_BLOCK: AuditRule
AUDIT_RULE_FREE_OF_FREE_BLOCK: AuditRule
AUDIT_RULE_OWNER_MISMATCH: AuditRule
AUDIT_RULE_BAD_SNAPSHOT: AuditRule
AUDIT_RULE_SNAPSHOT_MISMATCH: AuditRule
AUDIT_RULE_MISSING_CLOSE: AuditRule
AUDIT_RULE_LEAKED_BLOCK: AuditRule
AUDIT_RULE_UNREADABLE: AuditRule
AUDIT_RULE_REF_COUNT_MISMATCH: AuditRule
AUDIT_RULE_REF_ON_EVICTED: AuditRule
AUDIT_RULE_STALE_KEY: AuditRule
AUDIT_RULE_DOUBLE_REGISTER: AuditRule
AUDIT_RULE_REGISTER_OF_UNHELD: AuditRule
AUDIT_RULE_APPEND_TO_SHARED: AuditRule
AUDIT_RULE_FORK_OF_UNHELD: AuditRule
AUDIT_RULE_COPY_SOURCE_NOT_PARENTS: AuditRule
AUDIT_RULE_COPY_OF_UNHELD: AuditRule
AUDIT_RULE_COPY_OF_UNSHARED: AuditRule
AUDIT_RULE_ROLLBACK_OF_NON_DRAFT: AuditRule

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_blocks_reset",)
    NUM_BLOCKS_RESET_FIELD_NUMBER: _ClassVar[int]
    num_blocks_reset: int
    def __init__(self, num_blocks_reset: _Optional[int] = ...) -> None: ...

class GetPoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolStatusResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "num_blocks", "block_size", "num_free", "num_allocated", "num_running", "num_waiting", "last_seq", "durable_seq", "num_cached", "num_cached_free", "num_shared", "prefix_cache_queries", "prefix_cache_hits", "enable_prefix_caching", "tenants", "num_forked_blocks", "num_copied_blocks", "num_draft_tokens", "num_accepted_draft_tokens")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    num_blocks: int
    block_size: int
    num_free: int
    num_allocated: int
    num_running: int
    num_waiting: int
    last_seq: int
    durable_seq: int
    num_cached: int
    num_cached_free: int
    num_shared: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    enable_prefix_caching: bool
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    num_forked_blocks: int
    num_copied_blocks: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free: _Optional[int] = ..., num_allocated: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., last_seq: _Optional[int] = ..., durable_seq: _Optional[int] = ..., num_cached: _Optional[int] = ..., num_cached_free: _Optional[int] = ..., num_shared: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., num_forked_blocks: _Optional[int] = ..., num_copied_blocks: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "num_running", "num_waiting", "num_blocks_held")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    num_running: int
    num_waiting: int
    num_blocks_held: int
    def __init__(self, tenant: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_blocks_held: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "max_events_per_message")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    max_events_per_message: int
    def __init__(self, from_seq: _Optional[int] = ..., max_events_per_message: _Optional[int] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("event", "events")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    event: AllocationEvent
    events: _containers.RepeatedCompositeFieldContainer[AllocationEvent]
    def __init__(self, event: _Optional[_Union[AllocationEvent, _Mapping]] = ..., events: _Optional[_Iterable[_Union[AllocationEvent, _Mapping]]] = ...) -> None: ...

class AllocationEvent(_message.Message):
    __slots__ = ("seq", "pool_id", "epoch", "kind", "block_ids", "owner", "step", "free_reason", "wall_time", "monotonic_time", "hash", "keys", "parent_keys", "ref_counts", "parent", "partial")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FREE_REASON_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_FIELD_NUMBER: _ClassVar[int]
    MONOTONIC_TIME_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pool_id: str
    epoch: int
    kind: EventKind
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    owner: str
    step: int
    free_reason: FreeReason
    wall_time: _timestamp_pb2.Timestamp
    monotonic_time: _duration_pb2.Duration
    hash: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    parent_keys: _containers.RepeatedScalarFieldContainer[str]
    ref_counts: _containers.RepeatedScalarFieldContainer[int]
    parent: str
    partial: bool
    def __init__(self, seq: _Optional[int] = ..., pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., owner: _Optional[str] = ..., step: _Optional[int] = ..., free_reason: _Optional[_Union[FreeReason, str]] = ..., wall_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., monotonic_time: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., hash: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., parent_keys: _Optional[_Iterable[str]] = ..., ref_counts: _Optional[_Iterable[int]] = ..., parent: _Optional[str] = ..., partial: _Optional[bool] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("seq", "block_id", "owner", "message", "rule", "plot_from_seq", "plot_to_seq")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    PLOT_FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    PLOT_TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_id: int
    owner: str
    message: str
    rule: AuditRule
    plot_from_seq: int
    plot_to_seq: int
    def __init__(self, seq: _Optional[int] = ..., block_id: _Optional[int] = ..., owner: _Optional[str] = ..., message: _Optional[str] = ..., rule: _Optional[_Union[AuditRule, str]] = ..., plot_from_seq: _Optional[int] = ..., plot_to_seq: _Optional[int] = ...) -> None: ...

class BlockOwner(_message.Message):
    __slots__ = ("block_id", "owner")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    owner: str
    def __init__(self, block_id: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class AuditResponse(_message.Message):
    __slots__ = ("pool_id", "epoch", "clean", "closed", "num_events", "last_seq", "violations", "held_blocks", "summary")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    clean: bool
    closed: bool
    num_events: int
    last_seq: int
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    held_blocks: _containers.RepeatedCompositeFieldContainer[BlockOwner]
    summary: str
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., clean: _Optional[bool] = ..., closed: _Optional[bool] = ..., num_events: _Optional[int] = ..., last_seq: _Optional[int] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., held_blocks: _Optional[_Iterable[_Union[BlockOwner, _Mapping]]] = ..., summary: _Optional[str] = ...) -> None: ...
