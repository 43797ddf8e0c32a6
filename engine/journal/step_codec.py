"""The binary body of one journal step row: every journal record of one scheduler step.

A step's records (admissions, released deltas, endings) are stored together in
one ``journal_steps`` row, not one row each. Since version 2 the body is
columnar: each field of the step's records is written together (every head,
then every delta's start, every token id, every text, ...), so that like bytes
sit side by side where zlib finds them; and an OUTPUT names its request by the
journal seq of the request's ADMIT in the epoch (``admit_seq``, a varint delta
from the record before's), not by its id, which a server's ``uuid4().hex`` ids
made 33 bytes per request per step.

Layout (integers unsigned LEB128 varints, ``str`` a varint byte length + UTF-8)::

    body     = version:u8 (3) | packing:u8 (0: stored, 2: raw deflate; 1: zlib, as version 2 wrote)
               | columns (deflated when packing is 1 or 2)
    columns  = count | head:u8 * count | names | refs | prompts | deltas | logprobs | endings | rests
    head     = kind (bits 0-1: KIND_CODES) | NAME 4 | REF 8 | PROMPT 16 | DELTA 32 | LOGPROBS 64 | REST 128
    names    = request_id:str per NAME record
    refs     = zigzag(admit_seq - the previous REF's admit_seq) per REF record (the first's from 0)
    prompts  = (n | token_id * n) per PROMPT record
    deltas   = zigzag(start - the previous DELTA's start) per DELTA record (the first's from 0)
               | n per DELTA record | every token id | text byte length per DELTA record | every text byte
    logprobs = the LOGPROBS records' logprobs (``step_logprobs``; nothing when none has them)
    endings  = ending per FINISH record
    ending   = form:u8 (0: the fields are in its rest) | 1: reason | 2: reason | metrics
    reason   = finish_reason:value | stop_reason:value | abort_cause:value
    value    = 0 (None) | 1 str | 2 varint (an int >= 0)
    metrics  = (queue_s, ttft_s, total_s each: 0 (None) | 1 float64 little-endian) | num_preemptions
    rests    = JSON str per REST record

Who is named how (``encode_step``'s ``admit_seqs``): an ADMIT, a RECOVER and
any record whose ADMIT the writer does not know carry their id (NAME); an
OUTPUT whose ADMIT it knows carries only REF (it decodes with ``request_id``
None, which ``AdmissionNames`` fills from the epoch's ADMITs); a FINISH carries
both, so a reader of an epoch whose older rows are archived still names the
outputs after the cut of a request admitted before it (its FINISH lies after
them). ``rest`` is the JSON of the payload's other keys: an ADMIT's sampling
parameters, a RECOVER's payload, a FINISH's fields that its ending does not
hold. A FINISH carries an OUTPUT's fields (its last delta) as well, and its
ending: the reasons and timings the engine writes (``request_journal``), as
values and float64 bits (form 1 or 2) where the payload holds exactly those
keys in that order, else form 0 and the JSON rest. As JSON they took about
120 bytes a FINISH after zlib, the key names and a float's 17 digits written
out in each row again.

Logprobs are the values the client was sent, bit for bit (float32 where the
whole row's are exactly float32, else float64), in about 2.9 bytes a float32
value (``step_logprobs``). So a decoded record's payload equals the one
encoded, its floats identical.

The body is deflated only when that makes it smaller (a step of one short
delta is not), as raw deflate: without zlib's header and Adler-32 (6 bytes a
row), since the journal's hash chain covers the stored body, so the readers
that verify it (``Resume``, recovery, ``log audit``) find a damaged one.
Bodies of version 2 (zlib, no endings) and 1 (``step_codec_v1``), written
before, decode as they are: the hash chain covers their bytes, so they are
never rewritten.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from nanoserve.engine.journal.step_bytes import KIND_CODES, KIND_NAMES, StepReader, put_string, put_varint
from nanoserve.engine.journal.step_codec_v1 import VERSION_1, decode_step_v1
from nanoserve.engine.journal.step_logprobs import LogprobsColumn, read_logprobs

__all__ = ["KIND_CODES", "VERSION", "AdmissionNames", "StepRecord", "decode_step", "encode_step"]

VERSION = 3
_VERSION_2 = 2  # no endings column; zlib'd
_STORED, _ZLIB, _DEFLATE = 0, 1, 2
_KIND_MASK, _NAME, _REF, _PROMPT, _DELTA, _LOGPROBS, _REST = 3, 4, 8, 16, 32, 64, 128
_DELTA_KEYS = ("start", "token_ids", "text")
_ZLIB_LEVEL = 6
# a FINISH's fields an ending holds, in the order the engine writes them (``request_journal.output_record``)
_REASON_KEYS = ("finish_reason", "stop_reason", "abort_cause")
_TIMING_KEYS = ("queue_s", "ttft_s", "total_s")
_METRIC_KEYS = (*_TIMING_KEYS, "num_preemptions")
_IN_REST, _REASONS, _REASONS_AND_METRICS = 0, 1, 2
_NONE, _STR, _INT = 0, 1, 2


class StepRecord(NamedTuple):
    """One decoded record: its kind (a ``JournalKind`` value), request id, payload, ADMIT's seq.

    request_id: None for an OUTPUT stored by its ``admit_seq`` alone (``AdmissionNames`` names it).
    admit_seq: the journal seq of the request's ADMIT in the epoch, where the row stores it (None: not
    stored; an ADMIT's own seq is its row's first seq + its index)."""

    kind: str
    request_id: str | None
    data: dict[str, Any]
    admit_seq: int | None = None


def encode_step(
    records: Sequence[tuple[str, str, dict[str, Any]]], admit_seqs: Sequence[int | None] | None = None
) -> bytes:
    """The body of a step row holding ``records`` (kind, request id, payload) in order.

    admit_seqs: per record, the epoch's journal seq of its request's ADMIT when the writer knows it
    (None: unknown); an OUTPUT with one is stored without its id, a FINISH with both. Default: none
    known (every record carries its id)."""
    if admit_seqs is None:
        admit_seqs = [None] * len(records)
    assert len(admit_seqs) == len(records), f"{len(admit_seqs)} admit seqs for {len(records)} records"
    columns = _Columns()
    for (kind, request_id, data), admit_seq in zip(records, admit_seqs, strict=True):
        columns.add(kind, request_id, data, admit_seq)
    raw = columns.join()
    deflate = zlib.compressobj(_ZLIB_LEVEL, zlib.DEFLATED, -15)  # raw deflate: no header, no checksum
    packed = deflate.compress(raw) + deflate.flush()
    if len(packed) < len(raw):
        return bytes([VERSION, _DEFLATE]) + packed
    return bytes([VERSION, _STORED]) + raw


def decode_step(body: bytes | memoryview) -> list[StepRecord]:
    """The records of a step row's ``body`` (version 3, or 2 or 1 written before: every record named in 1).

    ValueError("journal step body version ...") for an unknown version,
    ValueError("damaged journal step body: ...") for one that does not decode
    (cut, altered, or not zlib where it says so)."""
    body = bytes(body)  # a driver may hand a bytea as a memoryview, which has no decode()
    if not body or body[0] not in (VERSION, _VERSION_2, VERSION_1):
        raise ValueError(f"journal step body version {body[:1]!r}: only versions {VERSION_1} to {VERSION} are known")
    try:
        if body[0] == VERSION_1:
            return [StepRecord(kind, request_id, data) for kind, request_id, data in decode_step_v1(body)]
        return _decode_columns(_unpack(body), endings=body[0] == VERSION)
    except (zlib.error, IndexError, struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError) as exc:
        raise ValueError(f"damaged journal step body: {exc}") from exc


class AdmissionNames:
    """The request ids of one epoch's ADMITs by their journal seq, learnt from its rows read in seq order.

    ``name`` fills the ``request_id`` of the records stored by ``admit_seq``
    alone. A reader that starts after an epoch's first row (its older rows
    archived, or a checkpoint's) may meet a ref it has not learnt: that
    record's request id stays None; the request's FINISH, later, names it
    (``by_seq`` learns FINISHes' refs too)."""

    def __init__(self, by_seq: dict[int, str] | None = None) -> None:
        self.by_seq: dict[int, str] = dict(by_seq or {})  # ADMIT journal seq -> request id

    def name(self, first_seq: int, records: Sequence[StepRecord]) -> list[StepRecord]:
        """``records`` (a row's, seqs ``first_seq``, ...) with every ref this epoch's reading has learnt
        named; learns the row's ADMITs and FINISHes."""
        by_seq = self.by_seq
        named = []
        for seq, record in enumerate(records, first_seq):
            kind, request_id, data, admit_seq = record
            if request_id is None:  # an OUTPUT by its ADMIT's seq (decode_step refuses a record with neither)
                named.append(
                    StepRecord(kind, by_seq.get(admit_seq) if admit_seq is not None else None, data, admit_seq)
                )
                continue
            if kind == "admit":
                by_seq[seq] = request_id
            elif admit_seq is not None:
                by_seq.setdefault(admit_seq, request_id)
            named.append(record)
        return named


def _unpack(body: bytes) -> bytes:
    packing = body[1]
    if packing == _DEFLATE:
        inflate = zlib.decompressobj(-15)
        raw = inflate.decompress(body[2:]) + inflate.flush()
        if not inflate.eof or inflate.unused_data:
            raise ValueError("the deflated columns are cut short or followed by other bytes")
        return raw
    if packing == _ZLIB:
        return zlib.decompress(body[2:])
    if packing == _STORED:
        return body[2:]
    raise ValueError(f"unknown packing {packing}")


class _Columns:
    """A step's records split into the layout's columns, in the order they are written."""

    def __init__(self) -> None:
        self.heads = bytearray()
        self.names = bytearray()
        self.refs = bytearray()
        self.prompts = bytearray()
        self.starts = bytearray()
        self.counts = bytearray()
        self.tokens = bytearray()
        self.text_sizes = bytearray()
        self.text = bytearray()
        self.logprobs = LogprobsColumn()
        self.endings = bytearray()
        self.rests = bytearray()
        self.previous_ref = 0
        self.previous_start = 0

    def add(self, kind: str, request_id: str, data: dict[str, Any], admit_seq: int | None) -> None:
        rest = dict(data)
        head = KIND_CODES[kind]
        if admit_seq is None or kind != "output":  # a FINISH is named and refers to its ADMIT
            head |= _NAME
            put_string(self.names, request_id)
        if admit_seq is not None and kind in ("output", "finish"):
            head |= _REF
            put_varint(self.refs, _zigzag(admit_seq - self.previous_ref))
            self.previous_ref = admit_seq
        if isinstance(rest.get("prompt_token_ids"), list):
            head |= _PROMPT
            _put_ids(self.prompts, rest.pop("prompt_token_ids"))
        if all(key in rest for key in _DELTA_KEYS) and isinstance(rest["start"], int) and isinstance(rest["text"], str):
            head |= _DELTA
            token_ids = rest.pop("token_ids")
            self._delta(rest.pop("start"), token_ids, rest.pop("text"))
            if rest.get("logprobs") is not None:
                head |= _LOGPROBS
                self.logprobs.add(rest.pop("logprobs"), token_ids)
        if kind == "finish":
            ending = _ending(rest)
            self.endings += ending or bytes([_IN_REST])
            if ending:
                rest = {}
        if rest:
            head |= _REST
            put_string(self.rests, json.dumps(rest, separators=(",", ":"), ensure_ascii=False))
        self.heads.append(head)

    def _delta(self, start: int, token_ids: list[int], text: str) -> None:
        assert start >= 0, f"a delta's start is a token index: {start}"
        put_varint(self.starts, _zigzag(start - self.previous_start))
        self.previous_start = start
        put_varint(self.counts, len(token_ids))
        for token_id in token_ids:
            put_varint(self.tokens, token_id)
        encoded = text.encode()
        put_varint(self.text_sizes, len(encoded))
        self.text += encoded

    def join(self) -> bytes:
        out = bytearray()
        put_varint(out, len(self.heads))
        out += self.heads + self.names + self.refs + self.prompts
        out += self.starts + self.counts + self.tokens + self.text_sizes + self.text
        out += self.logprobs.join()
        out += self.endings + self.rests
        return bytes(out)


def _decode_columns(raw: bytes, *, endings: bool) -> list[StepRecord]:
    """The records of a body's columns; ``endings``: they hold the endings column (version 3)."""
    reader = StepReader(raw)
    heads = reader.take(reader.varint())
    names = [reader.string() if head & _NAME else None for head in heads]
    refs: list[int | None] = []
    ref = 0
    for head in heads:
        if head & _REF:
            ref += _unzigzag(reader.varint())
        refs.append(ref if head & _REF else None)
    datas: list[dict[str, Any]] = [{} for _ in heads]
    for head, data in zip(heads, datas, strict=True):
        if head & _PROMPT:
            data["prompt_token_ids"] = reader.ids()
    _read_deltas(reader, [data for head, data in zip(heads, datas, strict=True) if head & _DELTA])
    if any(head & _LOGPROBS and not head & _DELTA for head in heads):
        raise ValueError("logprobs without a delta")
    with_logprobs = [data for head, data in zip(heads, datas, strict=True) if head & _LOGPROBS]
    if with_logprobs:
        read_logprobs(reader, with_logprobs)
    if endings:
        for head, data in zip(heads, datas, strict=True):
            if KIND_NAMES[head & _KIND_MASK] == "finish":
                _read_ending(reader, data)
    for head, data in zip(heads, datas, strict=True):
        if head & _REST:
            rest = json.loads(reader.string())
            if not isinstance(rest, dict):
                raise ValueError(f"a record's rest is {type(rest).__name__}, not an object")
            data.update(rest)
    reader.expect_end()
    for head, name, admit_seq in zip(heads, names, refs, strict=True):
        if name is None and admit_seq is None:
            raise ValueError(f"a record with neither its id nor its admission (head {head:#x})")
    return [
        StepRecord(KIND_NAMES[head & _KIND_MASK], name, data, ref)
        for head, name, data, ref in zip(heads, names, datas, refs, strict=True)
    ]


def _read_deltas(reader: StepReader, deltas: list[dict[str, Any]]) -> None:
    start = 0
    for data in deltas:
        start += _unzigzag(reader.varint())
        if start < 0:
            raise ValueError(f"a delta starts at token {start}")
        data["start"] = start
    counts = [reader.varint() for _ in deltas]
    for data, num_tokens in zip(deltas, counts, strict=True):
        data["token_ids"] = reader.varints(num_tokens)
    sizes = [reader.varint() for _ in deltas]
    for data, size in zip(deltas, sizes, strict=True):
        data["text"] = reader.take(size).decode()


def _ending(rest: dict[str, Any]) -> bytes | None:
    """A FINISH's ending (form 1 or 2) holding all of ``rest``; None when ``rest`` is not of that shape."""
    keys = tuple(rest)
    if keys not in (_REASON_KEYS, (*_REASON_KEYS, *_METRIC_KEYS)):
        return None
    out = bytearray([_REASONS if keys == _REASON_KEYS else _REASONS_AND_METRICS])
    for key in _REASON_KEYS:
        value = rest[key]
        if value is None:
            out.append(_NONE)
        elif type(value) is str:
            out.append(_STR)
            put_string(out, value)
        elif type(value) is int and value >= 0:
            out.append(_INT)
            put_varint(out, value)
        else:
            return None
    if keys == _REASON_KEYS:
        return bytes(out)
    for key in _TIMING_KEYS:
        value = rest[key]
        if value is None:
            out.append(_NONE)
        elif type(value) is float:
            out.append(1)
            out += struct.pack("<d", value)
        else:
            return None
    num_preemptions = rest["num_preemptions"]
    if type(num_preemptions) is not int or num_preemptions < 0:
        return None
    put_varint(out, num_preemptions)
    return bytes(out)


def _read_ending(reader: StepReader, data: dict[str, Any]) -> None:
    """Adds a FINISH's ending's fields (none for form 0) to its payload ``data``."""
    form = reader.byte()
    if form == _IN_REST:
        return
    if form not in (_REASONS, _REASONS_AND_METRICS):
        raise ValueError(f"a FINISH's ending has form {form}")
    for key in _REASON_KEYS:
        tag = reader.byte()
        if tag not in (_NONE, _STR, _INT):
            raise ValueError(f"a FINISH's {key} has tag {tag}")
        data[key] = None if tag == _NONE else reader.string() if tag == _STR else reader.varint()
    if form == _REASONS:
        return
    for key in _TIMING_KEYS:
        tag = reader.byte()
        if tag not in (_NONE, 1):
            raise ValueError(f"a FINISH's {key} has tag {tag}")
        data[key] = None if tag == _NONE else reader.float("<d", 8)
    data["num_preemptions"] = reader.varint()


def _put_ids(out: bytearray, ids: list[int]) -> None:
    put_varint(out, len(ids))
    for token_id in ids:
        put_varint(out, token_id)


def _zigzag(value: int) -> int:
    return value * 2 if value >= 0 else -value * 2 - 1


def _unzigzag(value: int) -> int:
    return value // 2 if value % 2 == 0 else -(value + 1) // 2
