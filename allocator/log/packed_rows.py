"""Packed rows: a run of block events stored as one ``allocator_events`` row (migration 0008).

One row per event spent most of a row on what every row repeats (pool id,
epoch, a 32-byte hash, index entries) and on text that the records of one
step share (its batch seq, step and times). ``pack_rows`` stores each run of
block events of one group commit as one row instead::

    seq=F  last_seq=L  kind='packed'  owner=NULL  record=''  block_key=NULL
    records = zlib(record[F] + "\\n" + record[F+1] + ... + "\\n" + record[L])
    hash    = the chain's hash at L

The records are kept exactly as the hash chain covers them
(``hash_chain``), so the chain's definition per event is unchanged: a reader
expanding the row (``expand_packed``) chains each record from the stored hash
of the row before, and the last one must give the stored hash. What a
reader sees of a packed row is therefore the same events, seqs and hashes
that one row per event gave. What the row does not store is each event's own
hash: damage inside a packed row is found at its last seq (a hash that does
not match) or, for bytes that no longer inflate, named for the whole row
(``UnreadableRecords``).

Written with a key table (migration 0009), a row's records name their
prefix-cache keys by key id (``key_refs``: each key's 32 bytes stored once
per epoch in ``allocator_keys``) and its blob is byte 2 then the raw deflate
of that text (``key_refs.deflate_records``; byte 1 then its zlib stream in rows
written before; a zlib stream begins with 0x78, so rows written before 0009
read as they are). ``expand_packed`` turns the ids back into the keys, so the records it
gives are the same text; a key id no stored row holds makes the row
unreadable, and an altered key row shows as the chain's hash not matching
at the row's last seq.

POOL_INIT, SNAPSHOT and POOL_CLOSE stay rows of their own (recovery finds the
newest SNAPSHOT by ``kind``, and a segment is cut at one, so a cut never
splits a packed row), as does a record holding a newline (an owner may hold
any character) and a run of one event (but one naming prefix-cache keys in a
log that stores them: its row names them by id).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.allocator.log.key_refs import (
    DEFLATED_KEYED_FORMAT,
    KEYED_FORMAT,
    ZLIB_LEVEL,
    KeyChunks,
    KeyIds,
    deflate_records,
    inflate_records,
    referenced_ids,
)
from nanoserve.allocator.log.record_codec import DATA_KINDS, NUM_FIELDS

if TYPE_CHECKING:
    from nanoserve.allocator.log.store import Row

__all__ = [
    "MAX_EVENTS_PER_PACKED_ROW",
    "MIN_EVENTS_PER_PACKED_ROW",
    "MIN_KEYED_EVENTS_PER_PACKED_ROW",
    "PACKED_KIND",
    "STORED_COLUMNS",
    "StoredRow",
    "UnreadableRecords",
    "expand_packed",
    "is_keyed",
    "key_ids_of",
    "may_hold",
    "pack_rows",
    "unpack_records",
]

# the kind column of a packed row; no event has it
PACKED_KIND = "packed"
# a shorter run stays one row per event (a run of one gains nothing from packing)
MIN_EVENTS_PER_PACKED_ROW = 2
# ... unless it names prefix-cache keys and the log stores them (``key_refs``): a lone REGISTER's record
# holds a key of 43 characters per block, which its packed row names by a short id
MIN_KEYED_EVENTS_PER_PACKED_ROW = 1
# a longer run is cut into rows of this many: zlib looks back 32 KiB (about 400 records), so larger rows
# compress no better, and a reader expands at most this many events to reach one
MAX_EVENTS_PER_PACKED_ROW = 1024
# one stored row: an event row (``store.ROW_COLUMNS``) and its last_seq and records (None: one event)
StoredRow = tuple[Any, ...]
STORED_COLUMNS = ("pool_id", "epoch", "seq", "kind", "owner", "record", "hash", "block_key", "last_seq", "records")
# records of a packed row are joined by this byte; a record holding it stays a row of its own
_SEPARATOR = "\n"
_split_fields = operator.methodcaller("split", "|", NUM_FIELDS - 1)
_split_kind = operator.methodcaller("split", "|", 3)
_count_separators = operator.methodcaller("count", "|")
_kind_of, _tail_of = operator.itemgetter(2), operator.itemgetter(NUM_FIELDS - 1)
_sha256 = hashlib.sha256


@dataclass(frozen=True, slots=True)
class UnreadableRecords:
    """The record of an expanded packed row whose records cannot be read (stands in for its text).

    Readers get one row for the whole packed row, at its first seq, carrying
    this instead of a record: the row's ``last_seq`` and why it cannot be read.
    """

    last_seq: int
    cause: str

    def __str__(self) -> str:
        return f"packed records up to seq {self.last_seq} cannot be read: {self.cause}"


def pack_rows(rows: Sequence[Row], key_ids: KeyIds | None = None) -> list[StoredRow]:
    """The stored rows of one commit's event rows (seqs in a run): each run of MIN_EVENTS_PER_PACKED_ROW
    or more block events whose records hold no newline becomes one packed row (MAX_EVENTS_PER_PACKED_ROW
    at most), every other row stays as it is. With ``key_ids`` (a log with ``allocator_keys``) the packed
    records name their keys by id, new keys staged there (``KeyIds.staged_row``), and a shorter run
    (MIN_KEYED_EVENTS_PER_PACKED_ROW or more events) that names keys is packed too."""
    stored: list[StoredRow] = []
    run: list[Row] = []
    for row in rows:
        if row[3] in DATA_KINDS or _SEPARATOR in row[5]:
            _flush(run, stored, key_ids)
            stored.append((*row, None, None))
        else:
            run.append(row)
            if len(run) == MAX_EVENTS_PER_PACKED_ROW:
                _flush(run, stored, key_ids)
    _flush(run, stored, key_ids)
    return stored


def _flush(run: list[Row], stored: list[StoredRow], key_ids: KeyIds | None) -> None:
    if not run:
        return
    text = _SEPARATOR.join([row[5] for row in run])
    referred = text if key_ids is None or len(run) < MIN_KEYED_EVENTS_PER_PACKED_ROW else key_ids.refer(text)
    if len(run) < MIN_EVENTS_PER_PACKED_ROW and referred == text:
        stored += [(*row, None, None) for row in run]
    else:
        first, last = run[0], run[-1]
        # no key, no marker: the form of rows written before 0009
        blob = zlib.compress(text.encode(), ZLIB_LEVEL) if referred == text else deflate_records(referred)
        stored.append((first[0], first[1], first[2], PACKED_KIND, None, "", last[6], None, last[2], blob))
    run.clear()


def is_keyed(blob: Any) -> bool:
    """Whether a packed row's records name their keys by id (``key_refs``: its reader needs the epoch's keys)."""
    return isinstance(blob, (bytes, memoryview)) and bytes(blob[:1]) in (KEYED_FORMAT, DEFLATED_KEYED_FORMAT)


def unpack_records(first_seq: int, last_seq: int, blob: Any, keys: KeyChunks | None = None) -> list[str]:
    """The records of a packed row of seqs ``first_seq..last_seq``; ``keys``: the epoch's stored keys, for a
    row that names its keys by id (``is_keyed``).

    ValueError naming what is wrong when ``blob`` is not bytes, does not
    inflate, is not UTF-8, holds another number of records, or names a key
    id ``keys`` does not hold (``key_refs.MissingKeys``).
    """
    return _unpacked(first_seq, last_seq, blob, keys)[0]


def _unpacked(first_seq: int, last_seq: int, blob: Any, keys: KeyChunks | None) -> tuple[list[str], list[bytes]]:
    """The records of a packed row as text and as UTF-8 (what the chain hashes); ValueError as ``unpack_records``."""
    if not isinstance(blob, (bytes, memoryview)):
        raise ValueError(f"records column holds {type(blob).__name__}, not bytes")
    try:
        keyed, raw = inflate_records(blob)
        text = raw.decode()
    except zlib.error as exc:
        raise ValueError(f"records do not inflate ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"records are not UTF-8 (byte {exc.start})") from None
    if keyed:
        if keys is None:
            raise ValueError("records name their keys by id and the epoch's stored keys were not read")
        text = keys.expand(text)
        raw = text.encode()
    records = text.split(_SEPARATOR)
    if len(records) != last_seq - first_seq + 1:
        raise ValueError(f"{len(records)} records stored for seqs {first_seq}..{last_seq}")
    return records, raw.split(_SEPARATOR.encode())  # a newline byte is never inside a UTF-8 character


def may_hold(blob: Any, needles: tuple[bytes, ...]) -> bool:
    """Whether a packed row's records may contain one of ``needles`` (True when they cannot be read:
    ``expand_packed`` then names the row), without expanding it."""
    try:
        _, raw = inflate_records(blob)
    except (zlib.error, TypeError):
        return True
    return any(needle in raw for needle in needles)


def key_ids_of(blob: Any) -> set[int]:
    """The key ids a packed row's records name (``key_refs``; none for a row that stores its keys, or
    cannot be read: ``expand_packed`` names that one)."""
    if not is_keyed(blob):
        return set()
    try:
        return referenced_ids(inflate_records(blob)[1].decode())
    except (zlib.error, UnicodeDecodeError):
        return set()


def expand_packed(
    first_seq: int,
    last_seq: Any,
    blob: Any,
    stored_hash: Any,
    previous_hash: bytes | None,
    keys: KeyChunks | None = None,
) -> list[tuple[Any, ...]]:
    """The ``(seq, kind, owner, record, hash)`` rows of a packed row, as one row per event stored them.

    Each record's hash is sha256(the hash before + record), chained from
    ``previous_hash`` (the stored hash of the row before); the last one is the
    stored ``hash``, so a record changed anywhere in the row shows as that
    hash not matching. ``previous_hash`` None: hashes are not wanted (every
    row's is None). ``keys``: the epoch's stored keys (``key_table.stored_keys``),
    which a row naming its keys by id needs. A row that cannot be read (one
    of those ids not stored among them) comes as one row at ``first_seq``
    whose record is an ``UnreadableRecords``. (Replay reads
    every event through here: the common case runs at C speed, in ``map``s.)
    """
    if type(last_seq) is not int or last_seq < first_seq:
        return [(first_seq, PACKED_KIND, None, UnreadableRecords(first_seq, f"last_seq {last_seq!r}"), stored_hash)]
    try:
        records, encoded = _unpacked(first_seq, last_seq, blob, keys)
    except ValueError as exc:
        return [(first_seq, PACKED_KIND, None, UnreadableRecords(last_seq, str(exc)), stored_hash)]
    kinds: list[str | None]
    owners: list[str | None]
    # no split record is kept: thousands of live lists made the garbage collector's passes cost more than the work
    if min(map(_count_separators, records)) >= NUM_FIELDS - 1:
        kinds = list(map(_kind_of, map(_split_kind, records)))
        owners = list(map(_tail_of, map(_split_fields, records)))
        if not DATA_KINDS.isdisjoint(kinds):  # a data kind has no owner (the writer packs none: damage)
            owners = [None if kind in DATA_KINDS else owner for kind, owner in zip(kinds, owners, strict=True)]
    else:  # a malformed record: no kind, no owner (replay names it)
        kinds, owners = [], []
        for record in records:
            parts = record.split("|", NUM_FIELDS - 1)
            kind = parts[2] if len(parts) == NUM_FIELDS else None
            kinds.append(kind)
            owners.append(None if kind is None or kind in DATA_KINDS else parts[-1])
    hashes: list[Any]
    if previous_hash is None:
        hashes = [None] * len(records)
    else:
        hashes = list(itertools.accumulate(encoded[:-1], _link, initial=previous_hash))[1:]
        hashes.append(bytes(stored_hash) if isinstance(stored_hash, memoryview) else stored_hash)
    return list(zip(range(first_seq, last_seq + 1), kinds, owners, records, hashes, strict=True))


def _link(previous: bytes, record: bytes) -> bytes:
    return _sha256(previous + record).digest()
