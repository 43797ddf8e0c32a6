"""The stored form of an event, both ways: every record is encoded and decoded here.

An event is stored as one line of text, its *record*::

    seq|batch_seq|kind|block_ids|step|reason|wall_time_ns|monotonic_ns|tail

``block_ids`` is comma-separated; ``step`` and ``reason`` are empty when
None. For the prefix-cache kinds (REGISTER, SHARE, RELEASE, EVICT,
CACHE_RESET) the ``reason`` field holds ``reason;entries``: the free reason
(empty but for RELEASE), then one comma-separated entry per block:
``~key:parent:tokens`` for REGISTER (the sha256 key's 32 bytes in unpadded
base64url, the parent the same, ``^`` for the entry before's key, or empty for a
first block; the block's token ids as LEB128 varints in base64url); records
written before it hold ``key:parent:token_ids`` (hex keys, the token ids joined
by ``.``), or ``key:parent`` before the token ids were logged, and still decode
(an event whose keys are not sha256 hex, a test's, is still written that way),
``key=count`` (the reference
count after the event) for SHARE and RELEASE, ``key`` for EVICT and
CACHE_RESET, each key written ``~`` + base64url of its 32 bytes (hex in records
written before, which still decode). Keys are hex or base64url, so neither ``|`` nor ``,`` nor ``;`` nor
``:`` occurs in them.
A CACHE_RESET of an empty cache has no block ids. ``tail`` is the owner for block events and canonical JSON ``data``
(sorted keys, no spaces) for POOL_INIT, SNAPSHOT and POOL_CLOSE. The tail is
last, so it may hold any character. The record is what the hash chain covers
(``event_chain``), so a record once written always decodes to the same event:
a kind gains information only as an optional suffix of its entries (REGISTER's
token ids), which older records lack.

A record is stored as it is, in a row of its own or with the other block records of its
commit in one packed row (``packed_rows``: joined and compressed, each line unchanged),
so the text the chain covers is the same either way.

Readers get an ``Event`` (``decode_event``), and views that fold the
allocator's ``apply`` turn it into a ``BlockEvent`` (``block_event_of``);
replay splits records into their fields (``split_record``, or
``split_records`` for a whole chunk in its fast loop) and turns block records
into ``BlockEvent``s (``decode_block_event``) to apply them. Nothing outside
this module splits a record; the prefix-cache entries of the reason field are written and
read in ``cache_entries``, the SNAPSHOT tail in ``snapshot_codec``.
"""

from __future__ import annotations

import binascii
import json
import operator
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from nanoserve.allocator.events import BlockEvent, EventKind, FreeReason
from nanoserve.allocator.log.cache_entries import (
    b64,
    compact_register_entries,
    decode_compact_register_entry,
    decode_register_entry,
    is_sha256_hex,
    key_of,
    key_text,
    unb64,
)
from nanoserve.allocator.log.stored_event import Event
from nanoserve.allocator.transition import CACHE_KINDS, FAMILY_KINDS, TRANSITIONS

NUM_FIELDS = 9
# kinds whose record tail is JSON data rather than an owner
DATA_KINDS = frozenset((EventKind.POOL_INIT.value, EventKind.SNAPSHOT.value, EventKind.POOL_CLOSE.value))
# kinds that change blocks: stored text -> the EventKind that ``transition.apply`` knows
BLOCK_KINDS = {kind.value: kind for kind in TRANSITIONS}
# stored reason text -> FreeReason; "" is None
REASONS: dict[str, FreeReason | None] = {"": None, **{reason.value: reason for reason in FreeReason}}
# stored text of the kinds whose reason field carries keys
CACHE_KIND_VALUES = frozenset(kind.value for kind in CACHE_KINDS)
# stored text of the parallel-sampling kinds, whose reason field carries the parent
FAMILY_KIND_VALUES = frozenset(kind.value for kind in FAMILY_KINDS)


def encode_detail(event: BlockEvent) -> str:
    """The reason field of a block record: the reason, and for a prefix-cache kind its keys."""
    reason = "" if event.reason is None else event.reason.value
    if event.kind in FAMILY_KINDS:
        counts = ".".join(map(str, event.ref_counts))
        return f"{reason};{b64((event.parent or '').encode())}:{int(event.partial)}:{counts}"
    if event.kind not in CACHE_KINDS:
        return reason
    if event.parent_keys:
        if event.token_ids and all(map(is_sha256_hex, event.keys)):
            return f"{reason};{compact_register_entries(event)}"
        entries = [f"{key}:{parent or ''}" for key, parent in zip(event.keys, event.parent_keys, strict=True)]
        if event.token_ids:
            tokens = (".".join(map(str, block_tokens)) for block_tokens in event.token_ids)
            entries = [f"{entry}:{text}" for entry, text in zip(entries, tokens, strict=True)]
    elif event.ref_counts:
        entries = [f"{key_text(key)}={count}" for key, count in zip(event.keys, event.ref_counts, strict=True)]
    else:
        entries = [key_text(key) for key in event.keys]
    return f"{reason};{','.join(entries)}"


class Detail(NamedTuple):
    """A block record's reason field, decoded: the reason text and the prefix-cache entries."""

    reason: str
    keys: tuple[str, ...] = ()
    parent_keys: tuple[str | None, ...] = ()
    ref_counts: tuple[int, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    parent: str | None = None
    partial: bool = False


def _decode_family_detail(kind: str, detail: str) -> Detail:
    """FORK and COPY: ``reason;parent:partial:counts`` (the parent's UTF-8 in base64url, partial 0 or 1,
    the counts after the event joined by ``.``)."""
    reason, separator, entry = detail.partition(";")
    parts = entry.split(":")
    if not separator or len(parts) != 3 or parts[1] not in ("0", "1"):
        raise ValueError(f"reason {detail!r} of a {kind} record is not reason;parent:partial:counts")
    try:
        parent = unb64(parts[0]).decode()
        counts = tuple(map(int, parts[2].split("."))) if parts[2] else ()
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"reason {detail!r} of a {kind} record: {exc}") from None
    return Detail(reason, ref_counts=counts, parent=parent, partial=parts[1] == "1")


def decode_detail(kind: str, detail: str) -> Detail:
    """The reason, keys, parent keys, ref counts and token ids of a block record's reason field.

    ValueError naming the field when a prefix-cache record's entries are malformed
    (a REGISTER record's entries all carry token ids, or none does).
    """
    if kind in FAMILY_KIND_VALUES:
        return _decode_family_detail(kind, detail)
    if kind not in CACHE_KIND_VALUES:
        return Detail(detail)
    reason, separator, entry_text = detail.partition(";")
    if not separator:
        raise ValueError(f"reason {detail!r} of a {kind} record lacks its ';keys'")
    keys: list[str] = []
    parents: list[str | None] = []
    counts: list[int] = []
    tokens: list[tuple[int, ...]] = []
    for entry in entry_text.split(",") if entry_text else ():
        if kind == EventKind.REGISTER.value:
            if entry.startswith("~"):
                key, parent, block_tokens = decode_compact_register_entry(entry, keys[-1] if keys else None)
            else:
                key, parent, block_tokens = decode_register_entry(entry)
            parents.append(parent)
            if block_tokens is not None:
                tokens.append(block_tokens)
        elif kind in (EventKind.SHARE.value, EventKind.RELEASE.value):
            key, equals, count = entry.partition("=")
            if not equals or not count.isdigit():
                raise ValueError(f"{kind} entry {entry!r} is not key=count")
            key = key_of(key)
            counts.append(int(count))
        else:
            key = key_of(entry)
        keys.append(key)
    if tokens and len(tokens) != len(keys):
        raise ValueError(f"register record has token ids for {len(tokens)} of its {len(keys)} blocks")
    return Detail(reason, tuple(keys), tuple(parents), tuple(counts), tuple(tokens))


def encode_block_record(
    seq: int, batch_seq: int, event: BlockEvent, step: int | None, wall_time_ns: int, monotonic_ns: int
) -> str:
    """A block event as its stored line (see the module docstring)."""
    reason = event.reason
    detail = (
        encode_detail(event)
        if event.kind in CACHE_KINDS or event.kind in FAMILY_KINDS
        else ""
        if reason is None
        else reason.value
    )
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


_split_fields = operator.methodcaller("split", "|", NUM_FIELDS - 1)


def split_records(records: Iterable[str]) -> Iterator[list[str]]:
    """``split_record`` of each record, lazily and at C speed (replay's fast loop zips it with its rows).

    Lazy on purpose: a chunk split at once keeps thousands of lists alive, and the
    garbage collector's passes over them made replay three times slower.
    """
    return map(_split_fields, records)


def decode_block_id_list(text: str) -> list[int]:
    """Stored block ids (``"3,4"``) as a list, for replay's fast loop. ValueError when not a non-empty list."""
    return list(map(int, text.split(",")))


# a REGISTER record's entries as replay's fast loop takes them: each key:parent:token_ids, token ids ASCII digits
_REGISTER_ENTRIES = re.compile(r"[^:,]*:[^:,]*:[0-9]+(?:\.[0-9]+)*(?:,[^:,]*:[^:,]*:[0-9]+(?:\.[0-9]+)*)*")


def fast_entries(detail: str, num_blocks: int) -> list[str] | None:
    """The entries of a prefix-cache record's reason field, for replay's fast loop.

    None (the record is then the checked path's to decode and judge) unless the
    reason before ``;`` is a ``FreeReason`` (or empty) and there is exactly one
    non-empty entry list of ``num_blocks`` entries. What it returns
    ``decode_detail`` splits alike.
    """
    reason, separator, text = detail.partition(";")
    if not separator or not text or reason not in REASONS:
        return None
    entries = text.split(",")
    return entries if len(entries) == num_blocks else None


def fast_register_entries(detail: str, num_blocks: int) -> tuple[list[str], list[str | None]] | None:
    """(keys, parent keys) of a REGISTER record whose every entry carries token ids: all compact
    (``~key:parent:tokens``, decoded as ``decode_detail`` decodes them) or all ``key:parent:token_ids``
    with ASCII-digit token ids (token ids unread); None for anything else (the checked path's)."""
    entries = fast_entries(detail, num_blocks)
    if entries is None:
        return None
    keys: list[str] = []
    parents: list[str | None] = []
    if all(entry.startswith("~") for entry in entries):
        try:
            for entry in entries:
                key, parent, _ = decode_compact_register_entry(entry, keys[-1] if keys else None)
                keys.append(key)
                parents.append(parent)
        except ValueError:
            return None
        return keys, parents
    if _REGISTER_ENTRIES.fullmatch(detail, detail.index(";") + 1) is None:
        return None
    for entry in entries:
        key, parent, _ = entry.split(":", 2)
        keys.append(key)
        parents.append(parent or None)
    return keys, parents


def entries_are(detail: str, keys: list[str], counts: list[int] | None = None) -> bool:
    """Whether a SHARE or RELEASE record's reason field (``counts`` given) or an EVICT's (without) is
    exactly what its event with these keys and ref counts writes, its reason any ``FreeReason``.

    Replay's fast loop compares what it expects instead of decoding: True means
    ``decode_detail`` gives these keys and counts; False leaves the record to
    the checked path, which decodes and judges it.
    """
    reason, separator, text = detail.partition(";")
    if not separator or reason not in REASONS:
        return False
    # separators counted too: a key holding "," or "=" (a snapshot's keys are any text) decodes otherwise
    if text.count(",") != len(keys) - 1 or (counts is not None and text.count("=") != len(keys)):
        return False
    # as written now (``~`` + base64url for a sha256 key), else as written before (the key as it is)
    for names in ([key_text(key) for key in keys], keys):
        if counts is None:
            written = ",".join(names)
        else:
            written = ",".join([f"{name}={count}" for name, count in zip(names, counts, strict=True)])
        if written == text:
            return True
    return False


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
    detail = decode_detail(kind, reason_text)
    if detail.reason not in REASONS:
        raise ValueError(f"reason {detail.reason!r} is not a FreeReason")
    if kind in CACHE_KIND_VALUES and len(detail.keys) != len(block_ids):
        raise ValueError(f"{len(detail.keys)} keys for {len(block_ids)} block_ids")
    return BlockEvent(
        BLOCK_KINDS[kind],
        block_ids,
        owner,
        REASONS[detail.reason],
        detail.keys,
        detail.parent_keys,
        detail.ref_counts,
        detail.token_ids,
        detail.parent,
        detail.partial,
    )


def block_event_of(event: Event) -> BlockEvent | None:
    """The allocator's ``BlockEvent`` of a read ``Event``; None for a kind ``transition.apply`` does not know
    (the data kinds, and kinds newer than this code).

    ValueError when its reason is not a ``FreeReason``.
    """
    kind = BLOCK_KINDS.get(event.kind)
    if kind is None:
        return None
    reason = event.reason or ""
    if reason not in REASONS:
        raise ValueError(f"seq {event.seq}: reason {reason!r} is not a FreeReason")
    return BlockEvent(
        kind,
        event.block_ids,
        event.owner or "",
        REASONS[reason],
        event.keys,
        event.parent_keys,
        event.ref_counts,
        event.token_ids,
        event.parent,
        event.partial,
    )


def decode_event(pool_id: str, epoch: int, seq: int, record: str, hash_: bytes) -> Event:
    """An ``Event`` from its stored record. ValueError when the record is malformed."""
    fields = split_record(record)
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"seq {seq}: record has {len(fields)} fields, expected {NUM_FIELDS}")
    _, batch_seq, kind, block_ids, step, reason, wall_ns, mono_ns, tail = fields
    is_data = kind in DATA_KINDS
    detail = decode_detail(kind, reason)
    return Event(
        pool_id=pool_id,
        epoch=epoch,
        seq=seq,
        batch_seq=int(batch_seq),
        kind=kind,
        block_ids=decode_block_ids(block_ids),
        owner=None if is_data else tail,
        step=int(step) if step else None,
        reason=detail.reason or None,
        wall_time_ns=int(wall_ns),
        monotonic_ns=int(mono_ns),
        data=json.loads(tail) if is_data else None,
        hash=bytes(hash_),
        keys=detail.keys,
        parent_keys=detail.parent_keys,
        ref_counts=detail.ref_counts,
        token_ids=detail.token_ids,
        parent=detail.parent,
        partial=detail.partial,
    )
