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

POOL_INIT, SNAPSHOT and POOL_CLOSE stay rows of their own (recovery finds the
newest SNAPSHOT by ``kind``, and a segment is cut at one, so a cut never
splits a packed row), as does a record holding a newline (an owner may hold
any character) and a run of one event.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.allocator.log.record_codec import DATA_KINDS, NUM_FIELDS

if TYPE_CHECKING:
    from nanoserve.allocator.log.store import Row

__all__ = [
    "MAX_EVENTS_PER_PACKED_ROW",
    "MIN_EVENTS_PER_PACKED_ROW",
    "PACKED_KIND",
    "STORED_COLUMNS",
    "StoredRow",
    "UnreadableRecords",
    "expand_packed",
    "may_hold",
    "pack_rows",
    "unpack_records",
]

# the kind column of a packed row; no event has it
PACKED_KIND = "packed"
# a shorter run stays one row per event (a run of one gains nothing from packing)
MIN_EVENTS_PER_PACKED_ROW = 2
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
# zlib's level: its default; 9 saves under 0.1 % on bench.log_bytes' records
_ZLIB_LEVEL = 6


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


def pack_rows(rows: Sequence[Row]) -> list[StoredRow]:
    """The stored rows of one commit's event rows (seqs in a run): each run of MIN_EVENTS_PER_PACKED_ROW
    or more block events whose records hold no newline becomes one packed row (MAX_EVENTS_PER_PACKED_ROW
    at most), every other row stays as it is."""
    stored: list[StoredRow] = []
    run: list[Row] = []
    for row in rows:
        if row[3] in DATA_KINDS or _SEPARATOR in row[5]:
            _flush(run, stored)
            stored.append((*row, None, None))
        else:
            run.append(row)
            if len(run) == MAX_EVENTS_PER_PACKED_ROW:
                _flush(run, stored)
    _flush(run, stored)
    return stored


def _flush(run: list[Row], stored: list[StoredRow]) -> None:
    if len(run) < MIN_EVENTS_PER_PACKED_ROW:
        stored += [(*row, None, None) for row in run]
    else:
        first, last = run[0], run[-1]
        blob = zlib.compress(_SEPARATOR.join([row[5] for row in run]).encode(), _ZLIB_LEVEL)
        stored.append((first[0], first[1], first[2], PACKED_KIND, None, "", last[6], None, last[2], blob))
    run.clear()


def unpack_records(first_seq: int, last_seq: int, blob: Any) -> list[str]:
    """The records of a packed row of seqs ``first_seq..last_seq``.

    ValueError naming what is wrong when ``blob`` is not bytes, does not
    inflate, is not UTF-8, or holds another number of records.
    """
    return _unpacked(first_seq, last_seq, blob)[0]


def _unpacked(first_seq: int, last_seq: int, blob: Any) -> tuple[list[str], list[bytes]]:
    """The records of a packed row as text and as UTF-8 (what the chain hashes); ValueError as ``unpack_records``."""
    if not isinstance(blob, (bytes, memoryview)):
        raise ValueError(f"records column holds {type(blob).__name__}, not bytes")
    try:
        raw = zlib.decompress(blob)
        records = raw.decode().split(_SEPARATOR)
    except zlib.error as exc:
        raise ValueError(f"records do not inflate ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"records are not UTF-8 (byte {exc.start})") from None
    if len(records) != last_seq - first_seq + 1:
        raise ValueError(f"{len(records)} records stored for seqs {first_seq}..{last_seq}")
    return records, raw.split(_SEPARATOR.encode())  # a newline byte is never inside a UTF-8 character


def may_hold(blob: Any, needles: tuple[bytes, ...]) -> bool:
    """Whether a packed row's records may contain one of ``needles`` (True when they cannot be read:
    ``expand_packed`` then names the row), without expanding it."""
    try:
        raw = zlib.decompress(blob)
    except (zlib.error, TypeError):
        return True
    return any(needle in raw for needle in needles)


def expand_packed(
    first_seq: int, last_seq: Any, blob: Any, stored_hash: Any, previous_hash: bytes | None
) -> list[tuple[Any, ...]]:
    """The ``(seq, kind, owner, record, hash)`` rows of a packed row, as one row per event stored them.

    Each record's hash is sha256(the hash before + record), chained from
    ``previous_hash`` (the stored hash of the row before); the last one is the
    stored ``hash``, so a record changed anywhere in the row shows as that
    hash not matching. ``previous_hash`` None: hashes are not wanted (every
    row's is None). A row that cannot be read comes as one row at
    ``first_seq`` whose record is an ``UnreadableRecords``. (Replay reads
    every event through here: the common case runs at C speed, in ``map``s.)
    """
    if type(last_seq) is not int or last_seq < first_seq:
        return [(first_seq, PACKED_KIND, None, UnreadableRecords(first_seq, f"last_seq {last_seq!r}"), stored_hash)]
    try:
        records, encoded = _unpacked(first_seq, last_seq, blob)
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
