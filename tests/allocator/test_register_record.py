"""REGISTER's stored entries: compact (base64url keys, varint token ids), and the older forms still decode."""

from __future__ import annotations

import hashlib

import pytest

from nanoserve.allocator.events import BlockEvent, EventKind
from nanoserve.allocator.log.record_codec import decode_detail, encode_detail

KEYS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
TOKENS = [tuple(range(16)), tuple(range(49000, 49016)), (0, 127, 128, 16383, 16384, 2**31 - 1, 5, 6)]


def register(parents: list[str | None], token_ids: list[tuple[int, ...]] | None = None) -> BlockEvent:
    return BlockEvent(
        EventKind.REGISTER,
        (1, 2, 3),
        "req",
        None,
        tuple(KEYS),
        tuple(parents),
        (),
        tuple(TOKENS if token_ids is None else token_ids),
    )


def test_a_chain_of_blocks_round_trips_and_names_its_parents_by_caret() -> None:
    outside = hashlib.sha256(b"x").hexdigest()
    event = register([outside, KEYS[0], KEYS[1]])
    detail = encode_detail(event)
    assert detail.count("^") == 2
    assert all(entry.startswith("~") for entry in detail.removeprefix(";").split(","))
    decoded = decode_detail("register", detail)
    assert decoded.keys == tuple(KEYS)
    assert decoded.parent_keys == (outside, KEYS[0], KEYS[1])
    assert decoded.token_ids == tuple(TOKENS)


def test_the_compact_form_is_under_three_fifths_of_the_hex_form() -> None:
    event = register([None, KEYS[0], KEYS[1]], [tuple(range(49000, 49016))] * 3)
    hex_form = ",".join(
        f"{key}:{parent or ''}:{'.'.join(map(str, tokens))}"
        for key, parent, tokens in zip(event.keys, event.parent_keys, event.token_ids, strict=True)
    )
    assert len(encode_detail(event)) * 5 < len(hex_form) * 3  # 335 against 613 characters


def test_hex_entries_written_before_still_decode() -> None:
    old = f";{KEYS[0]}::1.2.3,{KEYS[1]}:{KEYS[0]}:4.5.6"
    decoded = decode_detail("register", old)
    assert (decoded.keys, decoded.parent_keys, decoded.token_ids) == (
        (KEYS[0], KEYS[1]),
        (None, KEYS[0]),
        ((1, 2, 3), (4, 5, 6)),
    )


def test_keys_that_are_not_sha256_keep_the_hex_form() -> None:
    event = BlockEvent(EventKind.REGISTER, (1,), "req", None, ("k1",), (None,), (), ((1, 2),))
    assert encode_detail(event) == ";k1::1.2"


@pytest.mark.parametrize("entry", ["~AAAA:^:AQ", "~AAAA::gA", "~AAAA:"])
def test_a_malformed_compact_entry_is_a_value_error(entry: str) -> None:
    with pytest.raises(ValueError, match="register entry"):
        decode_detail("register", ";" + entry)


def test_share_release_and_evict_keys_are_base64_and_round_trip() -> None:
    share = BlockEvent(EventKind.SHARE, (1, 2), "req", None, tuple(KEYS[:2]), (), (2, 3))
    evict = BlockEvent(EventKind.EVICT, (1,), "req", None, (KEYS[0],))
    share_text, evict_text = encode_detail(share), encode_detail(evict)
    assert share_text.startswith(";~")
    assert share_text.endswith("=3")
    assert len(evict_text) == 1 + 1 + 43
    assert decode_detail("share", share_text).keys == tuple(KEYS[:2])
    assert decode_detail("share", share_text).ref_counts == (2, 3)
    assert decode_detail("evict", evict_text).keys == (KEYS[0],)


def test_hex_share_entries_written_before_still_decode() -> None:
    decoded = decode_detail("release", f"preempted;{KEYS[0]}=1,{KEYS[1]}=0")
    assert (decoded.reason, decoded.keys, decoded.ref_counts) == ("preempted", tuple(KEYS[:2]), (1, 0))
