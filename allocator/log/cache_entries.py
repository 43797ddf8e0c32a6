"""The prefix-cache entries of a block record's reason field, both ways (part of the record codec).

A key is written ``~`` + base64url of its 32 bytes (``key_text``), or as it is when it is no
sha256 hex key (a test's); records written before hold hex, which still reads (``key_of``).
REGISTER entries are ``~key:parent:tokens`` (``compact_register_entries``: the parent ``^``
for the entry before's key, the token ids LEB128 varints in base64url), or, in records
written before, ``key:parent:token_ids`` or ``key:parent`` (``decode_register_entry``).
``record_codec`` places them in the record; nothing else reads them.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re

from nanoserve.allocator.events import BlockEvent


@functools.lru_cache(maxsize=1 << 16)  # a pool's keys recur (shared prefixes): each is encoded once, not per record
def key_text(key: str) -> str:
    """A SHARE, RELEASE or EVICT entry's key: ``~`` and its 32 bytes in base64url (43 characters, not
    64), or as it is when it is no sha256 hex key (a test's)."""
    return f"~{b64(bytes.fromhex(key))}" if is_sha256_hex(key) else key


def key_of(text: str) -> str:
    """The key an entry's key text names (hex): ``~base64url`` or hex (records written before)."""
    if not text.startswith("~"):
        return text
    try:
        raw = unb64(text[1:])
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"key {text!r}: {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"key {text!r} holds {len(raw)} bytes, not 32")
    return raw.hex()


_SHA256_HEX = re.compile("[0-9a-f]{64}")  # one C-level match: this runs per key of every record, both ways


def is_sha256_hex(key: str | None) -> bool:
    """Whether ``key`` is 64 lowercase hex digits (a sha256 key as the allocator makes them)."""
    return key is not None and _SHA256_HEX.fullmatch(key) is not None


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@functools.lru_cache(maxsize=1 << 16)  # keys recur as parents and on re-registration; a bad text raises, uncached
def _hex_of(text: str) -> str:
    """The hex of the bytes a base64url key text holds."""
    return unb64(text).hex()


def compact_register_entries(event: BlockEvent) -> str:
    """REGISTER entries ``~key:parent:tokens``: the key in base64url (its 32 bytes), the parent
    the same, or ``^`` for the entry before's key, or empty for none; the token ids LEB128 varints
    in base64url. About 90 characters a block of 16 tokens, where the hex and decimal form took 225."""
    entries = []
    previous: str | None = None
    for key, parent, block_tokens in zip(event.keys, event.parent_keys, event.token_ids, strict=True):
        if parent is None:
            parent_text = ""
        elif parent == previous:
            parent_text = "^"
        elif is_sha256_hex(parent):
            parent_text = b64(bytes.fromhex(parent))
        else:
            parent_text = "'" + parent  # not a sha256 key (a test's): as it is, marked
        varints = bytearray()
        for token_id in block_tokens:
            while token_id >= 0x80:
                varints.append((token_id & 0x7F) | 0x80)
                token_id >>= 7
            varints.append(token_id)
        entries.append(f"~{b64(bytes.fromhex(key))}:{parent_text}:{b64(bytes(varints))}")
        previous = key
    return ",".join(entries)


def decode_compact_register_entry(entry: str, previous: str | None) -> tuple[str, str | None, tuple[int, ...] | None]:
    """(key, parent or None, token ids) of a ``~key:parent:tokens`` REGISTER entry (``previous``:
    the key of the entry before it, which ``^`` names)."""
    parts = entry[1:].split(":")
    if len(parts) != 3:
        raise ValueError(f"register entry {entry!r} is not ~key:parent:tokens")
    key_text, parent_text, token_text = parts
    try:
        key = _hex_of(key_text)
        if parent_text == "^":
            if previous is None:
                raise ValueError("^ names the entry before, and this is the first")
            parent: str | None = previous
        elif parent_text.startswith("'"):
            parent = parent_text[1:]
        else:
            parent = _hex_of(parent_text) if parent_text else None
        raw = unb64(token_text)
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"register entry {entry!r}: {exc}") from None
    tokens: list[int] = []
    value = shift = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            tokens.append(value)
            value = shift = 0
    if shift:
        raise ValueError(f"register entry {entry!r}: its token ids end inside a varint")
    return key, parent, tuple(tokens)


def decode_register_entry(entry: str) -> tuple[str, str | None, tuple[int, ...] | None]:
    """(key, parent or None, token ids or None when the entry predates them) of a REGISTER entry."""
    parts = entry.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"register entry {entry!r} is not key:parent:token_ids")
    if len(parts) == 2:
        return parts[0], parts[1] or None, None
    try:
        block_tokens = tuple(map(int, parts[2].split(".")))
    except ValueError:
        raise ValueError(f"register entry {entry!r}: token_ids {parts[2]!r} is not a list of token ids") from None
    return parts[0], parts[1] or None, block_tokens
