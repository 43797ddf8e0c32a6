"""The logprobs column of a journal step body (``step_codec``, version 2): bit for bit, in few bytes.

A record's logprobs (``[[token_id, logprob, [[top_id, top_logprob], ...]], ...]``,
one entry per released token) are the values the client was sent, so they are
stored exactly: float32 (the sampler's, which the gRPC stream sends as
``float``) when every value of the row survives float32, else float64 for the
whole row. Layout (integers unsigned LEB128 varints)::

    logprobs = width:u8 (4: float32, 8: float64) | (n | entry * n) per LOGPROBS record | values
    entry    = k | sampled | [token_id] | top_id * k
    sampled  = 0: token_id follows, its value is in values; 1: the delta's token at this index,
               its value in values; j + 2: the same (id, value) as the entry's top j (nothing follows)
    values   = each value given (sampled's, then the k tops', entry after entry): its bits as a
               little-endian u32 (float32) or u64 (float64) less the previous value's (modulo 2 ** 32
               or 2 ** 64; the first's less 0), byte-transposed: every difference's byte 0, then byte 1, ...

Why: under greedy decoding the sampled token is the first top (``sampled`` = 2
stores it once); a top list runs from the likeliest down, and a negative
float's bits grow with its magnitude, so neighbouring values' bits differ by
small numbers whose high bytes are zeros, which the transposition lays side by
side for zlib (about 2.9 bytes a float32 value, against 4 raw).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from nanoserve.engine.journal.step_bytes import StepReader, put_varint

__all__ = ["LogprobsColumn", "read_logprobs"]

_SAMPLED_GIVEN, _SAMPLED_DELTA_TOKEN, _SAMPLED_TOP = 0, 1, 2


class LogprobsColumn:
    """The logprobs of a step's records, in record order, as the layout's column.

    entries: the bytes before ``values``; values: every value given, in order."""

    def __init__(self) -> None:
        self.entries = bytearray()
        self.values: list[float] = []

    def add(self, entries: list[Any], token_ids: list[int]) -> None:
        """One record's logprobs: ``entries`` ``[[token_id, logprob, [[top_id, top_logprob], ...]], ...]``,
        ``token_ids`` its delta's tokens."""
        put_varint(self.entries, len(entries))
        for index, (token_id, logprob, tops) in enumerate(entries):
            put_varint(self.entries, len(tops))
            same = next(
                (j for j, (top_id, value) in enumerate(tops) if top_id == token_id and _same(value, logprob)), None
            )
            if same is not None:
                put_varint(self.entries, _SAMPLED_TOP + same)
            elif index < len(token_ids) and token_ids[index] == token_id:
                put_varint(self.entries, _SAMPLED_DELTA_TOKEN)
                self.values.append(logprob)
            else:
                put_varint(self.entries, _SAMPLED_GIVEN)
                put_varint(self.entries, token_id)
                self.values.append(logprob)
            for top_id, top_logprob in tops:
                put_varint(self.entries, top_id)
                self.values.append(top_logprob)

    def join(self) -> bytes:
        """The column (b"" when no record had logprobs)."""
        if not self.entries:
            return b""
        width = 4 if all(_fits_float32(value) for value in self.values) else 8
        return bytes([width]) + self.entries + _pack_values(self.values, width)


def read_logprobs(reader: StepReader, datas: list[dict[str, Any]]) -> None:
    """Reads the column into ``datas`` (the LOGPROBS records' payloads, their deltas read) as
    ``data["logprobs"]``. ValueError, IndexError or struct.error for a damaged one."""
    width = reader.byte()
    if width not in (4, 8):
        raise ValueError(f"logprob width {width}")
    # per record, per entry: (the sampled token id when its value is given, else the top it repeats; top ids)
    shapes: list[list[tuple[int | None, int, list[int]]]] = []
    num_values = 0
    for data in datas:
        entries = []
        for index in range(reader.varint()):
            num_tops = reader.varint()
            sampled = reader.varint()
            token_id: int | None = None
            if sampled == _SAMPLED_GIVEN:
                token_id = reader.varint()
            elif sampled == _SAMPLED_DELTA_TOKEN:
                token_id = data["token_ids"][index]
            elif sampled - _SAMPLED_TOP >= num_tops:
                raise ValueError(f"the sampled token is top {sampled - _SAMPLED_TOP} of {num_tops}")
            entries.append((token_id, sampled - _SAMPLED_TOP, reader.varints(num_tops)))
            num_values += num_tops + (token_id is not None)
        shapes.append(entries)
    values = _unpack_values(reader.take(num_values * width), width)
    position = 0  # of the next value
    for data, entries in zip(datas, shapes, strict=True):
        decoded = []
        for token_id, top_index, top_ids in entries:
            if token_id is not None:
                logprob, position = values[position], position + 1
            tops = list(map(list, zip(top_ids, values[position : position + len(top_ids)], strict=True)))
            position += len(top_ids)
            if token_id is None:
                token_id, logprob = top_ids[top_index], values[position - len(top_ids) + top_index]
            decoded.append([token_id, logprob, tops])
        data["logprobs"] = decoded


def _pack_values(values: list[float], width: int) -> bytes:
    """``values`` as the layout's ``values``: each float's bits less the previous float's (modulo
    2 ** (8 * width): unsigned numpy arithmetic wraps), little-endian, byte-transposed."""
    float_type, int_type = _types(width)
    bits = np.array(values, dtype=float_type).view(int_type)
    differences = np.diff(bits, prepend=np.zeros(1, dtype=int_type))
    return differences.view(np.uint8).reshape(len(values), width).T.tobytes()


def _unpack_values(planes: bytes, width: int) -> list[float]:
    """The floats ``_pack_values`` made ``planes`` of (ValueError when its length is no multiple of ``width``)."""
    float_type, int_type = _types(width)
    if len(planes) % width:
        raise ValueError(f"{len(planes)} bytes of values of {width} bytes")
    num_values = len(planes) // width
    differences = np.frombuffer(planes, dtype=np.uint8).reshape(width, num_values).T.copy().view(int_type)
    bits = np.cumsum(differences.reshape(num_values), dtype=int_type)
    return list(bits.view(float_type).astype(np.float64).tolist())


def _types(width: int) -> tuple[str, str]:
    """The little-endian numpy types of a value of ``width`` bytes and of its bits."""
    return ("<f4", "<u4") if width == 4 else ("<f8", "<u8")


def _same(a: float, b: float) -> bool:
    """Whether two logprobs are the same value, bit for bit (-0.0 is not 0.0; NaN is never the same)."""
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _fits_float32(value: float) -> bool:
    if math.isnan(value):
        return False
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0] == value
    except OverflowError:
        return False
