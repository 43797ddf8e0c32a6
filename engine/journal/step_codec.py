"""The binary body of one journal step row: every journal record of one scheduler step.

A step's records (admissions, released deltas, endings) are stored together in
one ``journal_steps`` row, not one row each: a decode step of 32 requests is one
row of about 32 * (id + 2) bytes, where it was 32 JSON rows with their indexes.

Layout (all integers unsigned LEB128 varints, strings varint length + UTF-8)::

    body    = version:u8 (1) | zlib( count | record * count )
    record  = kind:u8 | request_id:str | fields:u8 (bit flags) | parts... | rest:str
    parts   = [prompt_token_ids: ids]       (bit 0, ADMIT)
              [start | token_ids: ids | text:str]   (bit 1, OUTPUT and FINISH)
              [logprobs]                     (bit 2)
    ids     = count | id * count
    logprobs= width:u8 (4: float32, 8: float64) | count | entry * count
    entry   = token_id | logprob | k | (top_id | top_logprob) * k

``rest`` is the JSON of the payload's other keys ("" for none): the sampling
parameters of an ADMIT, the reasons and timings of a FINISH, a RECOVER's
payload. Logprobs are float32 (4 bytes) when every value of the record survives
float32 exactly, which the sampler's float32 values always do; otherwise float64,
so a decoded record equals the one encoded (``decode_step(encode_step(r)) == r``).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["KIND_CODES", "decode_step", "encode_step"]

VERSION = 1
KIND_CODES = {"admit": 0, "output": 1, "finish": 2, "recover": 3}
_KIND_NAMES = {code: name for name, code in KIND_CODES.items()}
_PROMPT, _DELTA, _LOGPROBS = 1, 2, 4
_DELTA_KEYS = ("start", "token_ids", "text")

# one record: (kind name, request_id, payload)
StepRecord = tuple[str, str, dict[str, Any]]


def encode_step(records: Sequence[StepRecord]) -> bytes:
    """The body of a step row holding ``records`` in order (see the module's layout)."""
    out = bytearray()
    _varint(out, len(records))
    for kind, request_id, data in records:
        _record(out, kind, request_id, data)
    return bytes([VERSION]) + zlib.compress(bytes(out), 6)


def decode_step(body: bytes) -> list[StepRecord]:
    """The records of a step row's ``body``; ValueError for an unknown version or a damaged body."""
    if not body or body[0] != VERSION:
        raise ValueError(f"journal step body version {body[:1]!r}: only version {VERSION} is known")
    try:
        reader = _Reader(zlib.decompress(body[1:]))
        records = [_read_record(reader) for _ in range(reader.varint())]
    except (zlib.error, IndexError, struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"damaged journal step body: {exc}") from exc
    if reader.pos != len(reader.data):
        raise ValueError(f"damaged journal step body: {len(reader.data) - reader.pos} bytes after the last record")
    return records


def _record(out: bytearray, kind: str, request_id: str, data: dict[str, Any]) -> None:
    rest = dict(data)
    flags = 0
    if isinstance(rest.get("prompt_token_ids"), list):
        flags |= _PROMPT
    if all(key in rest for key in _DELTA_KEYS) and isinstance(rest["start"], int) and isinstance(rest["text"], str):
        flags |= _DELTA
        if rest.get("logprobs") is not None:
            flags |= _LOGPROBS
    out.append(KIND_CODES[kind])
    _string(out, request_id)
    out.append(flags)
    if flags & _PROMPT:
        _ids(out, rest.pop("prompt_token_ids"))
    if flags & _DELTA:
        _varint(out, rest.pop("start"))
        _ids(out, rest.pop("token_ids"))
        _string(out, rest.pop("text"))
    if flags & _LOGPROBS:
        _logprobs(out, rest.pop("logprobs"))
    _string(out, json.dumps(rest, separators=(",", ":"), ensure_ascii=False) if rest else "")


def _read_record(reader: _Reader) -> StepRecord:
    kind = _KIND_NAMES[reader.byte()]
    request_id = reader.string()
    flags = reader.byte()
    data: dict[str, Any] = {}
    if flags & _PROMPT:
        data["prompt_token_ids"] = reader.ids()
    if flags & _DELTA:
        data["start"] = reader.varint()
        data["token_ids"] = reader.ids()
        data["text"] = reader.string()
    if flags & _LOGPROBS:
        data["logprobs"] = _read_logprobs(reader)
    rest = reader.string()
    if rest:
        data.update(json.loads(rest))
    return kind, request_id, data


def _logprobs(out: bytearray, entries: list[Any]) -> None:
    """``entries``: ``[[token_id, logprob, [[top_id, top_logprob], ...]], ...]``."""
    values = [entry[1] for entry in entries] + [top[1] for entry in entries for top in entry[2]]
    width = 4 if all(_fits_float32(value) for value in values) else 8
    fmt = "<f" if width == 4 else "<d"
    out.append(width)
    _varint(out, len(entries))
    for token_id, logprob, tops in entries:
        _varint(out, token_id)
        out += struct.pack(fmt, logprob)
        _varint(out, len(tops))
        for top_id, top_logprob in tops:
            _varint(out, top_id)
            out += struct.pack(fmt, top_logprob)


def _read_logprobs(reader: _Reader) -> list[Any]:
    width = reader.byte()
    fmt = {4: "<f", 8: "<d"}[width]
    entries = []
    for _ in range(reader.varint()):
        token_id = reader.varint()
        logprob = reader.float(fmt, width)
        tops = [[reader.varint(), reader.float(fmt, width)] for _ in range(reader.varint())]
        entries.append([token_id, logprob, tops])
    return entries


def _fits_float32(value: float) -> bool:
    if math.isnan(value):
        return False
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0] == value
    except OverflowError:
        return False


def _varint(out: bytearray, value: int) -> None:
    assert value >= 0, f"varints are unsigned: {value}"
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _ids(out: bytearray, ids: list[int]) -> None:
    _varint(out, len(ids))
    for token_id in ids:
        _varint(out, token_id)


def _string(out: bytearray, text: str) -> None:
    encoded = text.encode()
    _varint(out, len(encoded))
    out += encoded


class _Reader:
    """A cursor over a decompressed body."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    def ids(self) -> list[int]:
        return [self.varint() for _ in range(self.varint())]

    def string(self) -> str:
        size = self.varint()
        end = self.pos + size
        if end > len(self.data):
            raise IndexError("string runs past the body")
        text = self.data[self.pos : end].decode()
        self.pos = end
        return text

    def float(self, fmt: str, width: int) -> float:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += width
        return float(value)
