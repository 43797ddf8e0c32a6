"""The stored form of an event, both ways: every record is encoded and decoded here.

An event is stored as one line of text, its *record*::

    seq|batch_seq|kind|block_ids|step|reason|wall_time_ns|monotonic_ns|tail

``block_ids`` is comma-separated; ``step`` and ``reason`` are empty when
None. For the prefix-cache kinds (REGISTER, SHARE, RELEASE, EVICT,
CACHE_RESET) the ``reason`` field holds ``reason;entries``: the free reason
(empty but for RELEASE), then one comma-separated entry per block: ``key:parent``
for REGISTER (parent empty for a first block), ``key=count`` (the reference
count after the event) for SHARE and RELEASE, ``key`` for EVICT and
CACHE_RESET. Keys are hex, so neither ``|`` nor ``,`` nor ``;`` occurs in them.
A CACHE_RESET of an empty cache has no block ids. ``tail`` is the owner for block events and canonical JSON ``data``
(sorted keys, no spaces) for POOL_INIT, SNAPSHOT and POOL_CLOSE. The tail is
last, so it may hold any character. The record is what the hash chain covers
(``event_chain``), so its encoding never changes for a kind once written.

Readers get an ``Event`` (``decode_event``); replay splits the text itself
(``split_record``) and turns block records into the allocator's
``BlockEvent`` (``decode_block_event``) to apply them.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.log.event import Event
from nanoserve.allocator.pool_state import PoolState
from nanoserve.allocator.transition import CACHE_KINDS, TRANSITIONS

NUM_FIELDS = 9
# kinds whose record tail is JSON data rather than an owner
DATA_KINDS = frozenset((EventKind.POOL_INIT.value, EventKind.SNAPSHOT.value, EventKind.POOL_CLOSE.value))
# kinds that change blocks: stored text -> the EventKind that ``transition.apply`` knows
BLOCK_KINDS = {kind.value: kind for kind in TRANSITIONS}
# stored reason text -> FreeReason; "" is None
REASONS: dict[str, FreeReason | None] = {"": None, **{reason.value: reason for reason in FreeReason}}
# stored text of the kinds whose reason field carries keys
CACHE_KIND_VALUES = frozenset(kind.value for kind in CACHE_KINDS)


def encode_detail(event: BlockEvent) -> str:
    """The reason field of a block record: the reason, and for a prefix-cache kind its keys."""
    reason = "" if event.reason is None else event.reason.value
    if event.kind not in CACHE_KINDS:
        return reason
    if event.parent_keys:
        entries = [f"{key}:{parent or ''}" for key, parent in zip(event.keys, event.parent_keys, strict=True)]
    elif event.ref_counts:
        entries = [f"{key}={count}" for key, count in zip(event.keys, event.ref_counts, strict=True)]
    else:
        entries = list(event.keys)
    return f"{reason};{','.join(entries)}"


def decode_detail(kind: str, detail: str) -> tuple[str, tuple[str, ...], tuple[str | None, ...], tuple[int, ...]]:
    """(reason text, keys, parent keys, ref counts) of a block record's reason field.

    ValueError naming the field when a prefix-cache record's entries are malformed.
    """
    if kind not in CACHE_KIND_VALUES:
        return detail, (), (), ()
    reason, separator, entry_text = detail.partition(";")
    if not separator:
        raise ValueError(f"reason {detail!r} of a {kind} record lacks its ';keys'")
    keys: list[str] = []
    parents: list[str | None] = []
    counts: list[int] = []
    for entry in entry_text.split(",") if entry_text else ():
        if kind == EventKind.REGISTER.value:
            key, colon, parent = entry.partition(":")
            if not colon:
                raise ValueError(f"register entry {entry!r} is not key:parent")
            parents.append(parent or None)
        elif kind in (EventKind.SHARE.value, EventKind.RELEASE.value):
            key, equals, count = entry.partition("=")
            if not equals or not count.isdigit():
                raise ValueError(f"{kind} entry {entry!r} is not key=count")
            counts.append(int(count))
        else:
            key = entry
        keys.append(key)
    return reason, tuple(keys), tuple(parents), tuple(counts)


def encode_block_record(
    seq: int, batch_seq: int, event: BlockEvent, step: int | None, wall_time_ns: int, monotonic_ns: int
) -> str:
    """A block event as its stored line (see the module docstring)."""
    reason = event.reason
    detail = encode_detail(event) if event.kind in CACHE_KINDS else "" if reason is None else reason.value
    return (
        f"{seq}|{batch_seq}|{event.kind.value}|{','.join(map(str, event.block_ids))}|{'' if step is None else step}"
        f"|{detail}|{wall_time_ns}|{monotonic_ns}|{event.owner}"
    )


def encode_data_record(
    seq: int, batch_seq: int, kind: EventKind, data: Any, step: int | None, wall_time_ns: int, monotonic_ns: int
) -> str:
    """A POOL_INIT, SNAPSHOT or POOL_CLOSE record carrying ``data`` (JSON-serialisable)."""
    assert kind.value in DATA_KINDS, f"{kind} carries no data"
    step_text = "" if step is None else step
    return f"{seq}|{batch_seq}|{kind.value}||{step_text}||{wall_time_ns}|{monotonic_ns}|{encode_data(data)}"


def encode_data(data: Any) -> str:
    """Canonical JSON: sorted keys, no spaces. TypeError when ``data`` is not JSON-serialisable."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def split_record(record: str) -> list[str]:
    """The nine fields of a record as text; fewer when the record is malformed."""
    return record.split("|", NUM_FIELDS - 1)


def record_owner(kind: str, tail: str) -> str | None:
    """The owner a record names: its tail, except for the data kinds."""
    return None if kind in DATA_KINDS else tail


def decode_block_ids(text: str) -> tuple[int, ...]:
    """Stored block ids (``"3,4"``) as a tuple; ``""`` is none. ValueError on a malformed list."""
    return tuple(map(int, text.split(","))) if text else ()


def decode_block_event(kind: str, block_text: str, reason_text: str, owner: str) -> BlockEvent:
    """The ``BlockEvent`` of a block record's fields (``kind`` one of BLOCK_KINDS).

    ValueError, with a message naming the field, when the block ids are not a
    non-empty list of integers (a CACHE_RESET may have none), the reason is
    not a ``FreeReason``, or a prefix-cache record's keys do not match its blocks.
    """
    try:
        if not block_text and kind == EventKind.CACHE_RESET.value:
            block_ids: tuple[int, ...] = ()
        else:
            block_ids = tuple(map(int, block_text.split(",")))
    except ValueError:
        raise ValueError(f"block_ids {block_text!r} is not a list of block ids") from None
    reason_text, keys, parents, counts = decode_detail(kind, reason_text)
    if reason_text not in REASONS:
        raise ValueError(f"reason {reason_text!r} is not a FreeReason")
    if kind in CACHE_KIND_VALUES and len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} block_ids")
    return BlockEvent(BLOCK_KINDS[kind], block_ids, owner, REASONS[reason_text], keys, parents, counts)


def decode_event(pool_id: str, epoch: int, seq: int, record: str, hash_: bytes) -> Event:
    """An ``Event`` from its stored record. ValueError when the record is malformed."""
    fields = split_record(record)
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"seq {seq}: record has {len(fields)} fields, expected {NUM_FIELDS}")
    _, batch_seq, kind, block_ids, step, reason, wall_ns, mono_ns, tail = fields
    is_data = kind in DATA_KINDS
    reason, keys, parents, counts = decode_detail(kind, reason)
    return Event(
        pool_id=pool_id,
        epoch=epoch,
        seq=seq,
        batch_seq=int(batch_seq),
        kind=kind,
        block_ids=decode_block_ids(block_ids),
        owner=None if is_data else tail,
        step=int(step) if step else None,
        reason=reason or None,
        wall_time_ns=int(wall_ns),
        monotonic_ns=int(mono_ns),
        data=json.loads(tail) if is_data else None,
        hash=bytes(hash_),
        keys=keys,
        parent_keys=parents,
        ref_counts=counts,
    )


def snapshot_data(state: PoolState) -> dict[str, Any]:
    """The data of a SNAPSHOT record: the free stack (bottom to top), the owner map and,
    once prefix caching used the pool, the cached-free list, the sharers and the key index.

    Refers to ``state``'s stack and map (no copy): pass a state nothing changes
    any more, such as ``BlockAllocator.snapshot()``.
    """
    data: dict[str, Any] = {"free_block_ids": state.free_block_ids, "owners": state.owners}
    if state.block_keys or state.cached_free or state.sharers:
        data["cached_free"] = state.cached_free
        data["sharers"] = state.sharers
        data["block_keys"] = state.block_keys  # block_id -> [key, parent or null]; key_blocks is its inverse
    return data


def decode_snapshot(tail: str, num_blocks: int, block_size: int) -> PoolState:
    """The pool a SNAPSHOT record's tail holds.

    ValueError, naming what is wrong, when the tail is not JSON of the shape
    ``snapshot_data`` writes: an object with ``free_block_ids`` (a list of
    integers) and ``owners`` (an object mapping block ids to owner strings).
    """
    try:
        data = json.loads(tail)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not {"free_block_ids", "owners"} <= set(data):
        shape = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"expected an object with free_block_ids and owners, got {shape}")
    free_block_ids, owners = data["free_block_ids"], data["owners"]
    if not isinstance(free_block_ids, list) or not all(type(block_id) is int for block_id in free_block_ids):
        raise ValueError("free_block_ids is not a list of integers")
    if not isinstance(owners, dict) or not all(type(owner) is str for owner in owners.values()):
        raise ValueError("owners is not an object of owner strings")
    try:
        owner_map = {int(block_id): owner for block_id, owner in owners.items()}
    except ValueError:
        raise ValueError("owners has a key that is not a block id") from None
    state = PoolState(num_blocks, block_size, free_block_ids, owner_map)
    _decode_cache(data, state)
    return state


def _decode_cache(data: dict[str, Any], state: PoolState) -> None:
    """The prefix-cache part of a snapshot (absent in snapshots written before it), into ``state``."""
    cached_free = data.get("cached_free", [])
    sharers = data.get("sharers", {})
    block_keys = data.get("block_keys", {})
    if not isinstance(cached_free, list) or not all(type(block_id) is int for block_id in cached_free):
        raise ValueError("cached_free is not a list of integers")
    if not isinstance(sharers, dict) or not all(
        isinstance(holders, list) and all(type(owner) is str for owner in holders) for holders in sharers.values()
    ):
        raise ValueError("sharers is not an object of owner lists")
    if not isinstance(block_keys, dict) or not all(
        isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is str and type(entry[1]) in (str, type(None))
        for entry in block_keys.values()
    ):
        raise ValueError("block_keys is not an object of [key, parent] pairs")
    try:
        state.sharers = {int(block_id): list(holders) for block_id, holders in sharers.items()}
        state.block_keys = {int(block_id): (entry[0], entry[1]) for block_id, entry in block_keys.items()}
    except ValueError:
        raise ValueError("sharers or block_keys has a key that is not a block id") from None
    state.cached_free = list(cached_free)
    state.key_blocks = {key: block_id for block_id, (key, _) in state.block_keys.items()}
