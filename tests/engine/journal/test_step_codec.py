"""The step row's binary body: every payload the engine journals comes back equal, damage is refused."""

from __future__ import annotations

import zlib

import pytest

from nanoserve.engine.journal.step_codec import decode_step, encode_step

ADMIT = {
    "prompt_token_ids": [1, 300, 70000],
    "prompt": "héllo",
    "sampling": {"seed": 7, "temperature": 0.5, "logprobs": 2},
    "max_tokens": 8,
    "arrival_wall_ns": 1_796_000_000_000_000_000,
    "deadline_wall_ns": None,
    "recovered_from": None,
    "num_prior_tokens": 0,
}
OUTPUT = {"start": 3, "token_ids": [9, 128], "text": "a b"}
# float32-exact values (the sampler's): stored in 4 bytes each
LOGPROBS32 = {**OUTPUT, "logprobs": [[9, -0.5, [[9, -0.5], [4, -1.25]]], [128, -2.0, [[7, -0.75]]]]}
FINISH = {"start": 5, "token_ids": [], "text": "", "finish_reason": "abort", "stop_reason": None, "abort_cause": "x"}
RECOVER = {"epoch": 1, "last_seq": 9, "holders": {"a": [1, 2]}, "recovered": ["a"], "ended": {}}


def test_every_kind_round_trips_equal() -> None:
    records = [
        ("admit", "a", ADMIT),
        ("output", "a", OUTPUT),
        ("output", "b", LOGPROBS32),
        ("finish", "a", FINISH),
        ("recover", "", RECOVER),
    ]
    assert decode_step(encode_step(records)) == records


def test_logprobs_that_float32_cannot_hold_keep_float64() -> None:
    data = {**OUTPUT, "logprobs": [[9, -0.1, [[9, -0.1]]]]}  # 0.1 is not a float32
    assert decode_step(encode_step([("output", "a", data)])) == [("output", "a", data)]


def test_float32_logprobs_take_four_bytes_each() -> None:
    tops = [[i, -float(i) / 4] for i in range(20)]
    many = {"start": 0, "token_ids": [5] * 64, "text": "", "logprobs": [[5 + i, -0.25, tops] for i in range(64)]}
    raw = zlib.decompress(encode_step([("output", "a", many)])[1:])
    # per token: id (1 byte) + value (4) + count (1) + 20 * (id 1 byte + value 4)
    assert len(raw) < 64 * (1 + 4 + 1 + 20 * 5) + 200


def test_a_decode_step_of_32_requests_is_a_few_bytes_per_token() -> None:
    records = [("output", f"req-{i}", {"start": 100, "token_ids": [1000 + i], "text": " word"}) for i in range(32)]
    assert len(encode_step(records)) < 32 * 8


@pytest.mark.parametrize("body", [b"", b"\x02abc", b"\x01not zlib", b"\x01" + zlib.compress(b"\x05")])
def test_a_damaged_or_unknown_body_is_a_value_error(body: bytes) -> None:
    with pytest.raises(ValueError, match="journal step body"):
        decode_step(body)
