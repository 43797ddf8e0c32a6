"""The byte primitives of the journal step bodies: varints, strings, and a cursor that reads them.

Shared by the body's layouts (``step_codec`` writes version 2, ``step_codec_v1``
reads version 1). Integers are unsigned LEB128 varints (7 bits a byte, low
bits first); a string is its UTF-8 byte length as a varint, then the bytes.
The reader raises IndexError when a value runs past the data; the codec turns
that into its "damaged journal step body" ValueError.
"""

from __future__ import annotations

import struct

__all__ = ["KIND_CODES", "KIND_NAMES", "StepReader", "put_string", "put_varint"]

KIND_CODES = {"admit": 0, "output": 1, "finish": 2, "recover": 3}  # JournalKind value -> code
KIND_NAMES = {code: name for name, code in KIND_CODES.items()}


def put_varint(out: bytearray, value: int) -> None:
    """Append ``value`` (>= 0) as an unsigned LEB128 varint."""
    assert value >= 0, f"varints are unsigned: {value}"
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def put_string(out: bytearray, text: str) -> None:
    """Append ``text`` as its UTF-8 byte length (varint) and bytes."""
    encoded = text.encode()
    put_varint(out, len(encoded))
    out += encoded


class StepReader:
    """A cursor over a (decompressed) body: ``pos`` is the next byte to read."""

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

    def varints(self, count: int) -> list[int]:
        """The next ``count`` varints (one loop: the journal's token ids are read by the thousand)."""
        data, pos = self.data, self.pos
        values = []
        for _ in range(count):
            byte = data[pos]
            pos += 1
            value, shift = byte & 0x7F, 7
            while byte >= 0x80:
                byte = data[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                shift += 7
            values.append(value)
        self.pos = pos
        return values

    def ids(self) -> list[int]:
        """A count, then that many varints."""
        return self.varints(self.varint())

    def take(self, size: int) -> bytes:
        """The next ``size`` bytes; IndexError when fewer are left."""
        end = self.pos + size
        if end > len(self.data):
            raise IndexError(f"{size} bytes asked at {self.pos}, {len(self.data) - self.pos} left")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def string(self) -> str:
        return self.take(self.varint()).decode()

    def float(self, fmt: str, width: int) -> float:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += width
        return float(value)

    def expect_end(self) -> None:
        """ValueError when bytes are left after the last record."""
        if self.pos != len(self.data):
            raise ValueError(f"{len(self.data) - self.pos} bytes after the last record")
