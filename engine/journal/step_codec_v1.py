"""The first layout of a journal step row's body (version 1), read only.

Rows written before the columnar layout (``step_codec``, version 2) keep this
form: the hash chain covers the stored bytes, so they are never rewritten.
``step_codec.decode_step`` hands a body whose first byte is 1 to
``decode_step_v1``.

Layout (all integers unsigned LEB128 varints, strings varint length + UTF-8)::

    body    = version:u8 (1) | zlib( count | record * count )
    record  = kind:u8 | request_id:str | fields:u8 (bit flags) | parts... | rest:str
    parts   = [prompt_token_ids: ids]       (bit 0, ADMIT)
              [start | token_ids: ids | text:str]   (bit 1, OUTPUT and FINISH)
              [logprobs]                     (bit 2)
    ids     = count | id * count
    logprobs= width:u8 (4: float32, 8: float64) | count | entry * count
    entry   = token_id | logprob | k | (top_id | top_logprob) * k

``rest`` is the JSON of the payload's other keys ("" for none).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from nanoserve.engine.journal.step_bytes import KIND_NAMES, StepReader

__all__ = ["VERSION_1", "decode_step_v1"]

VERSION_1 = 1
_PROMPT, _DELTA, _LOGPROBS = 1, 2, 4

# one record: (kind name, request_id, payload)
StepRecord = tuple[str, str, dict[str, Any]]


def decode_step_v1(body: bytes) -> list[StepRecord]:
    """The records of a version 1 ``body``. zlib.error, IndexError, struct.error, UnicodeDecodeError,
    ValueError (bad JSON) or KeyError for a damaged one (``step_codec.decode_step`` names them)."""
    assert body[:1] == bytes([VERSION_1]), f"not a version 1 body: {body[:1]!r}"
    reader = StepReader(zlib.decompress(body[1:]))
    records = [_read_record(reader) for _ in range(reader.varint())]
    reader.expect_end()
    return records


def _read_record(reader: StepReader) -> StepRecord:
    kind = KIND_NAMES[reader.byte()]
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


def _read_logprobs(reader: StepReader) -> list[Any]:
    width = reader.byte()
    fmt = {4: "<f", 8: "<d"}[width]
    entries = []
    for _ in range(reader.varint()):
        token_id = reader.varint()
        logprob = reader.float(fmt, width)
        tops = [[reader.varint(), reader.float(fmt, width)] for _ in range(reader.varint())]
        entries.append([token_id, logprob, tops])
    return entries
