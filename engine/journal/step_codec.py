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

    body     = version:u8 (2) | packing:u8 (0: stored, 1: zlib) | columns (zlib'd when packing is 1)
    columns  = count | head:u8 * count | names | refs | prompts | deltas | logprobs | rests
    head     = kind (bits 0-1: KIND_CODES) | NAME 4 | REF 8 | PROMPT 16 | DELTA 32 | LOGPROBS 64 | REST 128
    names    = request_id:str per NAME record
    refs     = zigzag(admit_seq - the previous REF's admit_seq) per REF record (the first's from 0)
    prompts  = (n | token_id * n) per PROMPT record
    deltas   = zigzag(start - the previous DELTA's start) per DELTA record (the first's from 0)
               | n per DELTA record | every token id | text byte length per DELTA record | every text byte
    logprobs = the LOGPROBS records' logprobs (``step_logprobs``; nothing when none has them)
    rests    = JSON str per REST record

Who is named how (``encode_step``'s ``admit_seqs``): an ADMIT, a RECOVER and
any record whose ADMIT the writer does not know carry their id (NAME); an
OUTPUT whose ADMIT it knows carries only REF (it decodes with ``request_id``
None, which ``AdmissionNames`` fills from the epoch's ADMITs); a FINISH carries
both, so a reader of an epoch whose older rows are archived still names the
outputs after the cut of a request admitted before it (its FINISH lies after
them). ``rest`` is the JSON of the payload's other keys: an ADMIT's sampling
parameters, a FINISH's reasons and timings, a RECOVER's payload. A FINISH
carries an OUTPUT's fields (its last delta) as well.

Logprobs are the values the client was sent, bit for bit (float32 where the
whole row's are exactly float32, else float64), in about 2.9 bytes a float32
value (``step_logprobs``). So a decoded record's payload equals the one
encoded, its floats identical.

The body is zlib'd only when that makes it smaller (a step of one short delta
is not). Bodies of version 1 (``step_codec_v1``), written before, decode as they
are: the hash chain covers their bytes, so they are never rewritten.
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

VERSION = 2
_STORED, _ZLIB = 0, 1
_KIND_MASK, _NAME, _REF, _PROMPT, _DELTA, _LOGPROBS, _REST = 3, 4, 8, 16, 32, 64, 128
_DELTA_KEYS = ("start", "token_ids", "text")
_ZLIB_LEVEL = 6


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
    packed = zlib.compress(raw, _ZLIB_LEVEL)
    if len(packed) < len(raw):
        return bytes([VERSION, _ZLIB]) + packed
    return bytes([VERSION, _STORED]) + raw


def decode_step(body: bytes | memoryview) -> list[StepRecord]:
    """The records of a step row's ``body`` (version 2, or 1 written before: every record named).

    ValueError("journal step body version ...") for an unknown version,
    ValueError("damaged journal step body: ...") for one that does not decode
    (cut, altered, or not zlib where it says so)."""
    body = bytes(body)  # a driver may hand a bytea as a memoryview, which has no decode()
    if not body or body[0] not in (VERSION, VERSION_1):
        raise ValueError(f"journal step body version {body[:1]!r}: only versions {VERSION_1} and {VERSION} are known")
    try:
        if body[0] == VERSION_1:
            return [StepRecord(kind, request_id, data) for kind, request_id, data in decode_step_v1(body)]
        return _decode_columns(_unpack(body))
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
        out += self.rests
        return bytes(out)


def _decode_columns(raw: bytes) -> list[StepRecord]:
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


def _put_ids(out: bytearray, ids: list[int]) -> None:
    put_varint(out, len(ids))
    for token_id in ids:
        put_varint(out, token_id)


def _zigzag(value: int) -> int:
    return value * 2 if value >= 0 else -value * 2 - 1


def _unzigzag(value: int) -> int:
    return value // 2 if value % 2 == 0 else -(value + 1) // 2
