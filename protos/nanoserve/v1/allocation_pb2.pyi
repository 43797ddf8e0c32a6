from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool_id", "epoch", "num_blocks", "block_size", "num_free", "num_allocated", "num_running", "num_waiting", "last_seq", "durable_seq")
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
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_free: _Optional[int] = ..., num_allocated: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., last_seq: _Optional[int] = ..., durable_seq: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class AllocationEvent(_message.Message):
    __slots__ = ("seq", "pool_id", "epoch", "kind", "block_ids", "owner", "step", "reason", "wall_time_s", "mono_time_s", "hash")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MONO_TIME_S_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pool_id: str
    epoch: int
    kind: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    owner: str
    step: int
    reason: str
    wall_time_s: float
    mono_time_s: float
    hash: str
    def __init__(self, seq: _Optional[int] = ..., pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., kind: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., owner: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., wall_time_s: _Optional[float] = ..., mono_time_s: _Optional[float] = ..., hash: _Optional[str] = ...) -> None: ...

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
    rule: str
    plot_from_seq: int
    plot_to_seq: int
    def __init__(self, seq: _Optional[int] = ..., block_id: _Optional[int] = ..., owner: _Optional[str] = ..., message: _Optional[str] = ..., rule: _Optional[str] = ..., plot_from_seq: _Optional[int] = ..., plot_to_seq: _Optional[int] = ...) -> None: ...

class BlockOwner(_message.Message):
    __slots__ = ("block_id", "owner")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    owner: str
    def __init__(self, block_id: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class AuditReport(_message.Message):
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
