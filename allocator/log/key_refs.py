"""Key references: a packed row's prefix-cache keys stored once per epoch, its records naming them by id.

A block key is a sha256 digest: 32 random bytes that zlib cannot shrink, and
one key recurs in the records of many commits (REGISTER, SHARE, RELEASE,
EVICT). A packed row written with a key table (migration 0009) stores the
bytes of each key once per epoch, in ``allocator_keys`` (``key_table``), and
its records name the key by its *key id*::

    the record (what the chain covers)   ...|;~<43 base64url characters>=2,...|...
    the packed text (what the row holds)  ...|;\\x1f<key id in decimal>=2,...|...

A REGISTER entry names its parent's key without the ``~`` (``~KEY:PARENT:TOKENS``,
``record_codec``): since byte 2 (raw deflate) such a bare key, 43 characters
between two ``:``, is named ``\\x1f^<key id>``; a block registered in decode
names the block before it, registered by an earlier commit, so its row held
the parent's 43 random characters (about 32 bytes deflated) where it now
holds a few. (``\\x1f^`` never occurs in byte-1 text, where a marker in the
record is written twice, so one reader reads both.)

An epoch's key ids are 0, 1, 2, ... in the order its keys are first stored;
the keys one group commit stores first are one ``allocator_keys`` row, their
32 bytes back to back from its ``first_key_id``. Only ``~`` and the canonical
unpadded base64url of 32 bytes, not followed by another base64url character
(or those 43 characters alone between two ``:``), becomes a reference, and
the marker ``\\x1f`` itself is written twice, so any text comes back
exactly: ``expand(refer(text)) == text``. What the chain covers is therefore
unchanged; this is a storage encoding only.

Imports only the standard library: the chain verifier, which runs as a
script of its own (``hash_chain_verifier``), loads this file by its path.
"""

from __future__ import annotations

import base64
import bisect
import re
import zlib
from collections.abc import Callable, Iterable

__all__ = [
    "BARE",
    "DEFLATED_KEYED_FORMAT",
    "KEYED_FORMAT",
    "KEY_BYTES",
    "MARKER",
    "KeyChunks",
    "KeyIds",
    "MissingKeys",
    "ZLIB_LEVEL",
    "deflate_records",
    "inflate_records",
    "referenced_ids",
]

# the marker before a key id in packed text; a marker in the record is written twice
MARKER = "\x1f"
# the first byte of a packed row's blob whose text names its keys by id, the rest a zlib stream (rows written
# from migration 0009 until raw deflate); a zlib stream's own first byte is 0x78
KEYED_FORMAT = b"\x01"
# ... the rest raw deflate: no zlib header and Adler-32 (6 bytes a row), as the hash chain covers the records
DEFLATED_KEYED_FORMAT = b"\x02"
_KEYED_FORMATS = (KEYED_FORMAT, DEFLATED_KEYED_FORMAT)
# packed rows' deflate level: zlib's default; 9 saves under 0.1 % on bench.log_bytes' records
ZLIB_LEVEL = 6
# bytes of one stored key (a sha256 digest)
KEY_BYTES = 32
# a key in a record: "~" and 43 base64url characters (32 bytes), not followed by another one
# ... or (group 2) 43 base64url characters alone between two ":": a REGISTER entry's parent
_KEY = re.compile(r"~([A-Za-z0-9_-]{43})(?![A-Za-z0-9_-])|(?<=:)([A-Za-z0-9_-]{43})(?=:)")
# a reference in packed text: the marker and a key id, or the marker written twice
_REF = re.compile("\x1f(\x1f|\\^?[0-9]+)")
# after the marker: the key id names the key's 43 characters without the "~"
BARE = "^"
_ESCAPED = MARKER + MARKER
# keys a writer keeps ids for, in each of its two generations: a key named by no record for longer is
# stored again under a new id (the pool's cached blocks bound the keys records name at a time)
NUM_KEYS_HELD = 1 << 16
# key texts a reader keeps; past this it forgets them all and reads the rows it needs again
_NUM_TEXTS_HELD = 1 << 17


class MissingKeys(ValueError):
    """Packed text names key ids that no stored ``allocator_keys`` row holds."""

    def __init__(self, key_ids: list[int]) -> None:
        self.key_ids = key_ids
        shown = ", ".join(map(str, key_ids[:5])) + (f" and {len(key_ids) - 5} more" if len(key_ids) > 5 else "")
        super().__init__(f"records name key id(s) {shown}, which no allocator_keys row holds")


class KeyIds:
    """The writer's side: key -> key id of one epoch, as committed, and the keys the commit in flight adds.

    Invariant: the committed ids are 0..n-1, each held by a committed
    ``allocator_keys`` row, and an id is never given twice. A commit attempt
    starts with ``begin`` (which drops what an earlier, failed attempt
    staged), refers its records' keys (``refer``: new keys are staged with
    the next ids), stores ``staged_row`` in the transaction of its packed
    rows, and ``commit`` is called once that transaction is known
    committed. Staging is a function of the committed map and the records
    alone, so a retried attempt stages the same ids, and an attempt whose
    acknowledgement was lost (found committed afterwards) is committed with
    what it staged. The map is bounded: two generations of at most
    ``num_keys_held`` keys (the older forgotten when the newer fills; a key
    named again moves to the newer), so a key no record named for that long
    is stored again, under a new id.
    """

    def __init__(self, num_keys_held: int = NUM_KEYS_HELD) -> None:
        self._recent: dict[str, int] = {}  # key as 43 base64url characters -> key id, committed
        self._older: dict[str, int] = {}  # the generation before (committed ids too)
        self._staged: dict[str, int] = {}  # keys the attempt in flight stores first -> key id (in id order)
        self._num_committed = 0  # ids 0.._num_committed - 1 are committed
        self._num_keys_held = num_keys_held

    def __len__(self) -> int:
        """The number of ids committed."""
        return self._num_committed

    def begin(self) -> None:
        """Start a commit attempt: nothing staged."""
        self._staged = {}

    def refer(self, text: str) -> str:
        """``text`` with each key replaced by its reference (new keys staged) and each marker doubled."""
        if MARKER in text:
            text = text.replace(MARKER, _ESCAPED)
        return _KEY.sub(self._reference, text)

    def _reference(self, match: re.Match[str]) -> str:
        key = match.group(1) or match.group(2)
        key_id = self._recent.get(key)
        if key_id is None:
            key_id = self._older.get(key)
            if key_id is not None:
                self._recent[key] = key_id  # a committed id: valid whatever this attempt's fate
        if key_id is None:
            key_id = self._staged.get(key)
        if key_id is None:
            if _key_bytes(key) is None:
                return match.group(0)  # not the canonical text of 32 bytes: stays as it is
            key_id = self._staged[key] = self._num_committed + len(self._staged)
        return f"{MARKER}{key_id}" if match.group(1) else f"{MARKER}{BARE}{key_id}"

    def staged_row(self) -> tuple[int, bytes] | None:
        """(first key id, the staged keys' bytes back to back, in id order); None when nothing is staged."""
        if not self._staged:
            return None
        return self._num_committed, b"".join(_key_bytes(key) or b"" for key in self._staged)

    def commit(self) -> None:
        """The attempt's transaction committed: its staged keys are the epoch's."""
        self._recent.update(self._staged)
        self._num_committed += len(self._staged)
        self._staged = {}
        if len(self._recent) >= self._num_keys_held:
            self._older, self._recent = self._recent, {}


class KeyChunks:
    """The reader's side: key id -> key of one epoch, from the ``allocator_keys`` rows read so far.

    ``fetch(key_ids)`` (ascending ids not held yet) returns ``(first_key_id,
    keys)`` rows that hold them (and may hold more); None: only the rows
    ``add``ed are known.
    """

    def __init__(self, fetch: Callable[[list[int]], Iterable[tuple[int, bytes]]] | None = None) -> None:
        self._fetch = fetch
        self._starts: list[int] = []  # first_key_id of each row held, ascending
        self._keys: list[bytes] = []  # its keys, back to back
        self._texts: dict[str, str] = {MARKER: MARKER}  # key id as written -> "~" + base64url of the key

    def add(self, first_key_id: int, keys: bytes) -> None:
        """Hold one ``allocator_keys`` row (a row already held is kept as it was)."""
        at = bisect.bisect_left(self._starts, first_key_id)
        if at < len(self._starts) and self._starts[at] == first_key_id:
            return
        self._starts.insert(at, first_key_id)
        self._keys.insert(at, bytes(keys))

    def rows(self) -> list[tuple[int, bytes]]:
        """The rows held, by first key id."""
        return list(zip(self._starts, self._keys, strict=True))

    def key_of(self, key_id: int) -> bytes | None:
        """The 32 bytes of key ``key_id`` from the rows held; None when none holds it."""
        at = bisect.bisect_right(self._starts, key_id) - 1
        if at < 0:
            return None
        offset = (key_id - self._starts[at]) * KEY_BYTES
        key = self._keys[at][offset : offset + KEY_BYTES]
        return key if len(key) == KEY_BYTES else None

    def expand(self, packed: str) -> str:
        """The text ``refer`` made ``packed`` from. MissingKeys naming the ids no row holds (after ``fetch``)."""
        if MARKER not in packed:
            return packed
        if len(self._texts) > _NUM_TEXTS_HELD and self._fetch is not None:  # forget; read again what is needed
            self._starts, self._keys, self._texts = [], [], {MARKER: MARKER}
        texts = self._texts
        # the text between references, then each reference's id (or the marker), alternately: joined at C speed
        parts = _REF.split(packed)
        written = parts[1::2]
        new = set(written).difference(texts)
        if new:
            unknown = [key_id for key_id in new if not self._known(key_id)]
            if unknown and self._fetch is not None:
                for first_key_id, keys in self._fetch(sorted({_id_of(key_id) for key_id in unknown})):
                    self.add(first_key_id, keys)
                unknown = [key_id for key_id in unknown if not self._known(key_id)]
            if unknown:
                raise MissingKeys(sorted({_id_of(key_id) for key_id in unknown}))
        parts[1::2] = map(texts.__getitem__, written)
        return "".join(parts)

    def _known(self, key_id: str) -> bool:
        """Whether a held row holds the id written ``key_id`` (its text then cached)."""
        if key_id in self._texts:
            return True
        key = self.key_of(_id_of(key_id))
        if key is None:
            return False
        text = base64.urlsafe_b64encode(key).decode().rstrip("=")
        self._texts[key_id] = text if key_id.startswith(BARE) else "~" + text
        return True


def deflate_records(packed: str) -> bytes:
    """The blob of a packed row whose text ``packed`` names its keys by id: DEFLATED_KEYED_FORMAT, raw deflate."""
    deflate = zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, -15)
    return DEFLATED_KEYED_FORMAT + deflate.compress(packed.encode()) + deflate.flush()


def inflate_records(blob: bytes | memoryview) -> tuple[bool, bytes]:
    """(whether its text names keys by id, the text's UTF-8) of a packed row's blob, in any of its forms:
    a zlib stream (rows written before 0009 or naming no key), or KEYED_FORMAT or DEFLATED_KEYED_FORMAT and
    the stream. zlib.error when it does not inflate, or a raw deflate stream is cut or followed by more bytes.
    A raw deflate stream has no checksum: an altered one may inflate to other text, which the hash chain
    then does not match."""
    form = bytes(blob[:1])
    if form not in _KEYED_FORMATS:
        return False, zlib.decompress(blob)
    if form == KEYED_FORMAT:
        return True, zlib.decompress(blob[1:])
    inflate = zlib.decompressobj(-15)
    raw = inflate.decompress(blob[1:])
    if not inflate.eof or inflate.unused_data:
        raise zlib.error("raw deflate stream cut short or followed by other bytes")
    return True, raw


def referenced_ids(packed: str) -> set[int]:
    """The key ids packed text refers to."""
    return {_id_of(key_id) for key_id in _REF.findall(packed) if key_id != MARKER}


def _id_of(written: str) -> int:
    """The key id of a reference as written after the marker (``123``, or ``^123`` for a bare key)."""
    return int(written.removeprefix(BARE))


def _key_bytes(key: str) -> bytes | None:
    """The 32 bytes of a key's 43 base64url characters; None when they are not their canonical text."""
    raw = base64.urlsafe_b64decode(key + "=")
    return raw if base64.urlsafe_b64encode(raw).decode().rstrip("=") == key else None
