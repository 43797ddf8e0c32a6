"""The step row's binary body: every payload the engine journals comes back equal, bit for bit, damage is refused."""

from __future__ import annotations

import math
import random
import struct
import zlib

import pytest

from nanoserve.engine.journal.step_codec import AdmissionNames, StepRecord, decode_step, encode_step

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
FINISH = {
    "start": 5,
    "token_ids": [],
    "text": "",
    "finish_reason": "abort",
    "stop_reason": None,
    "abort_cause": "x",
    "queue_s": 0.25,
    "ttft_s": 0.5,
    "total_s": 1.5,
    "num_preemptions": 2,
}
RECOVER = {"epoch": 1, "last_seq": 9, "holders": {"a": [1, 2]}, "recovered": ["a"], "ended": {}}
UUID = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"  # what a server names a request its client did not name

# A version 1 body (the layout before the columnar one), as the engine wrote it: an ADMIT, an OUTPUT
# with logprobs (one of them, -0.1, not a float32: the record's values are float64) and a FINISH.
V1_BODY = bytes.fromhex(
    "01789c6366604c6464625cc3645aad5450949f5b50a264a5947178a5928e5271626e414e665eba9255b552716a6a8a929579ad8e"
    "526e62457c497e766a5eb19295492d2363221b0313e787452c6ccfa62f7d36670d07132703183cd88f60b140185ff603d5cd9a09"
    "023bf7333030312632313130d8562ba565e6651667c417a52616e7e701ed2f2ec92f003900482104f580228949f94525f1c989a5"
    "c5a94a5679a53939b500e2933c42"
)
V1_RECORDS = [
    StepRecord("admit", "a", {"prompt_token_ids": [1, 300], "prompt": "hé", "sampling": {"seed": 7}, "max_tokens": 4}),
    StepRecord(
        "output",
        "a",
        {
            "start": 0,
            "token_ids": [9, 70000],
            "text": "日本",
            "logprobs": [[9, -0.5, [[9, -0.5], [4, -1.25]]], [70000, -0.1, []]],
        },
    ),
    StepRecord(
        "finish",
        "a",
        {"start": 2, "token_ids": [], "text": "", "finish_reason": "stop", "stop_reason": ".", "abort_cause": None},
    ),
]

# A version 2 body (zlib'd; a FINISH's reasons and timings in its JSON rest), as the engine wrote it: an
# OUTPUT by its admission, a FINISH with timings (0.1 is no float32; ttft_s None) and one without.
V2_BODY = bytes.fromhex(
    "0201789c658d4d0ac23010859b2a686f21b31342b18a9b1ec14b84b49d62a1cdc46422a2f43a2e3da3fd01415d3ddefbe07d8bedeb"
    "29b428e2681d274244c94a2ca3db064d757f40dd98c69f9543edc9400e9ec9829ce233660709ba20c7aad4c123e426b4ad844bc080"
    "ca43be4b3309cc358f65664cacdbb1eed3a304133a651d6267b92133ac597ffa574f8a5ff77cf76507433cf092aee8b082fe0d868d"
    "4a64"
)
FINISH_TIMED = {
    "start": 5,
    "token_ids": [7],
    "text": " end",
    "finish_reason": "stop",
    "stop_reason": 13,
    "abort_cause": None,
    "queue_s": 0.1,
    "ttft_s": None,
    "total_s": 2.5,
    "num_preemptions": 1,
}
FINISH_UNTIMED = {
    "start": 0,
    "token_ids": [],
    "text": "",
    "finish_reason": "abort",
    "stop_reason": None,
    "abort_cause": "not_recovered",
}
V2_RECORDS = [
    StepRecord("output", None, {"start": 4, "token_ids": [9], "text": "x"}, 1),
    StepRecord("finish", "a", FINISH_TIMED, 1),
    StepRecord("finish", "b", FINISH_UNTIMED),
]


def zlib_body(body: bytes) -> bytes:
    """A version 3 deflated body of records holding no FINISH as version 2 stored it: the same columns, zlib'd."""
    assert body[:2] == b"\x03\x02"
    inflate = zlib.decompressobj(-15)
    return b"\x02\x01" + zlib.compress(inflate.decompress(body[2:]) + inflate.flush())


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def float32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def test_every_kind_round_trips_equal_and_named() -> None:
    records = [
        ("admit", "a", ADMIT),
        ("output", "a", OUTPUT),
        ("output", "b", LOGPROBS32),
        ("finish", "a", FINISH),
        ("recover", "", RECOVER),
    ]
    assert decode_step(encode_step(records)) == [StepRecord(*record) for record in records]


def test_an_output_stored_by_its_admission_is_named_from_the_epochs_admits() -> None:
    row_1 = encode_step([("admit", "a", ADMIT), ("admit", UUID, ADMIT), ("output", "a", OUTPUT)], [None, None, 1])
    row_4 = encode_step([("output", UUID, LOGPROBS32), ("finish", "a", FINISH)], [2, 1])

    decoded = decode_step(row_4)
    assert decoded == [StepRecord("output", None, LOGPROBS32, 2), StepRecord("finish", "a", FINISH, 1)]
    names = AdmissionNames()
    assert names.name(1, decode_step(row_1)) == [
        StepRecord("admit", "a", ADMIT),
        StepRecord("admit", UUID, ADMIT),
        StepRecord("output", "a", OUTPUT, 1),  # its ADMIT is in the same row, before it
    ]
    assert names.name(4, decoded) == [StepRecord("output", UUID, LOGPROBS32, 2), StepRecord("finish", "a", FINISH, 1)]
    assert names.by_seq == {1: "a", 2: UUID}


def test_a_reader_that_starts_after_the_admission_learns_the_name_from_the_finish() -> None:
    names = AdmissionNames()
    [output] = names.name(7, decode_step(encode_step([("output", "a", OUTPUT)], [3])))
    assert output == StepRecord("output", None, OUTPUT, 3)  # its ADMIT (seq 3) was not read
    names.name(8, decode_step(encode_step([("finish", "a", FINISH)], [3])))
    assert names.by_seq == {3: "a"}


def test_an_output_by_its_admission_leaves_the_id_out_of_the_body() -> None:
    rng = random.Random(0)
    step = [
        ("output", f"{rng.getrandbits(128):032x}", {"start": 40, "token_ids": [1000 + i], "text": " word"})
        for i in range(32)
    ]
    by_id, by_ref = encode_step(step), encode_step(step, list(range(100, 132)))
    assert len(by_id) - len(by_ref) > 32 * 14  # a uuid's 32 hex digits take about 16 bytes even zlib'd
    assert len(by_ref) < 32 * 4


def test_text_split_inside_a_character_across_steps_round_trips() -> None:
    # a token that ends inside a UTF-8 character releases no text; the next releases the whole character
    steps = [
        [("output", "a", {"start": 0, "token_ids": [227], "text": ""})],
        [("output", "a", {"start": 1, "token_ids": [129], "text": "日"}), ("output", "b", {**OUTPUT, "text": "é🙂\n"})],
        [("output", "a", {"start": 2, "token_ids": [5, 6], "text": "本 \ufffd"})],
    ]
    decoded = [decode_step(encode_step(step, [1, 2][: len(step)])) for step in steps]
    assert [[record.data for record in records] for records in decoded] == [
        [data for _, _, data in step] for step in steps
    ]
    assert "".join(records[0].data["text"] for records in decoded) == "日本 \ufffd"


def test_float32_logprobs_come_back_bit_for_bit() -> None:
    specials = [-0.0, -math.inf, -1e-45, -3.4028234663852886e38, -1.1754943508222875e-38, -87.33654022216797]
    values = [float32(-i / 7 - 1 / 3) for i in range(40)] + specials
    tops = [[1000 * i + 7, value] for i, value in enumerate(values[:20])]
    entries = [[7, values[0], tops], [70_000, values[25], tops[:3]], [9, values[30], []], [5, specials[0], tops]]
    data = {"start": 0, "token_ids": [7, 70_000, 8, 5], "text": "abcd", "logprobs": entries}
    [record] = decode_step(encode_step([("output", "a", data)]))
    got = record.data["logprobs"]
    assert [entry[0] for entry in got] == [7, 70_000, 9, 5]
    assert [bits(entry[1]) for entry in got] == [bits(entry[1]) for entry in entries]
    assert [[(top_id, bits(value)) for top_id, value in entry[2]] for entry in got] == [
        [(top_id, bits(value)) for top_id, value in entry[2]] for entry in entries
    ]


def test_logprobs_that_float32_cannot_hold_keep_float64_bit_for_bit() -> None:
    data = {
        **OUTPUT,
        "logprobs": [[9, -0.1, [[9, -0.1], [3, -1e-300]]], [128, -0.5, [[4, -0.25]]]],
    }  # 0.1 is no float32
    [record] = decode_step(encode_step([("output", "a", data)]))
    assert record.data == data
    assert [bits(value) for value in (record.data["logprobs"][0][1], record.data["logprobs"][0][2][1][1])] == [
        bits(-0.1),
        bits(-1e-300),
    ]


def test_float32_logprobs_take_under_four_bytes_a_value() -> None:
    tops = [[i * 2311 % 49152, float32(-i / 3 - 0.01)] for i in range(20)]
    many = {
        "start": 0,
        "token_ids": [5] * 64,
        "text": "",
        "logprobs": [[tops[0][0], tops[0][1], tops] for _ in range(64)],
    }
    body = encode_step([("output", "a", many)])
    assert len(body) < 64 * 20 * 4
    assert decode_step(body)[0].data == many


def test_a_body_of_the_first_layout_still_decodes() -> None:
    assert decode_step(V1_BODY) == V1_RECORDS
    assert bits(decode_step(V1_BODY)[1].data["logprobs"][1][1]) == bits(-0.1)


def test_a_body_of_the_second_layout_still_decodes() -> None:
    assert decode_step(V2_BODY) == V2_RECORDS
    assert [list(record.data) for record in decode_step(V2_BODY)] == [list(record.data) for record in V2_RECORDS]


def test_a_finish_ending_comes_back_equal_its_keys_in_order_its_floats_bit_for_bit() -> None:
    odd = {**FINISH_TIMED, "queue_s": -0.0, "ttft_s": 1e-300, "total_s": math.inf, "stop_reason": "</s>"}
    records = [
        ("finish", "a", FINISH_TIMED),
        ("finish", "b", FINISH_UNTIMED),
        ("finish", "c", odd),
        ("finish", "d", FINISH),
    ]
    decoded = decode_step(encode_step(records, [1, None, 2, 3]))
    assert [record.data for record in decoded] == [data for _, _, data in records]
    assert [list(record.data) for record in decoded] == [list(data) for _, _, data in records]
    assert [bits(decoded[2].data[key]) for key in ("queue_s", "ttft_s", "total_s")] == [
        bits(-0.0),
        bits(1e-300),
        bits(math.inf),
    ]


@pytest.mark.parametrize(
    "change",
    [
        {"queue_s": 1},  # an int stays an int
        {"num_preemptions": True},  # a bool stays a bool
        {"stop_reason": -1},
        {"stop_reason": ["a"]},
        {"extra": "kept"},  # a key the ending does not know
    ],
)
def test_a_finish_of_another_shape_comes_back_as_it_was(change: dict[str, object]) -> None:
    data = {**FINISH_TIMED, **change}
    [record] = decode_step(encode_step([("finish", "a", data)], [1]))
    assert record.data == data
    assert [type(value) for value in record.data.values()] == [type(value) for value in data.values()]


def test_a_finish_in_a_step_of_its_own_takes_under_sixty_bytes() -> None:
    # a step ends a request or two: the key names and the digits of its timings are not shared with others
    data = {**FINISH_TIMED, "queue_s": 0.0123456789, "ttft_s": 0.5234234, "total_s": 12.3456789}
    body = encode_step([("finish", "a", data)], [1])
    assert len(body) < 60  # 137 with them as JSON
    assert decode_step(body) == [StepRecord("finish", "a", data, 1)]


def test_a_small_step_is_stored_without_deflate_and_a_large_one_raw_deflated() -> None:
    small = encode_step([("output", "a", {"start": 1, "token_ids": [5], "text": "x"})], [1])
    large = encode_step([("admit", f"r{i}", ADMIT) for i in range(8)])
    assert small[:2] == b"\x03\x00"
    assert large[:2] == b"\x03\x02"
    assert len(zlib_body(large)) == len(large) + 6  # zlib's header and Adler-32
    assert decode_step(zlib_body(large)) == decode_step(large)
    assert decode_step(small) == [StepRecord("output", None, {"start": 1, "token_ids": [5], "text": "x"}, 1)]
    assert decode_step(memoryview(small)) == decode_step(small)  # how a driver may hand a bytea


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "journal step body version b''"),
        (b"\x04abc", r"journal step body version b'\\x04'"),
        (b"\x01not zlib", "damaged journal step body: Error -3"),
        (b"\x01" + zlib.compress(b"\x05"), "damaged journal step body"),
        (b"\x02\x01not zlib", "damaged journal step body: Error -3"),
        (b"\x02\x07\x01\x01", "damaged journal step body: unknown packing 7"),
        (b"\x02\x00\x02\x01", "damaged journal step body"),  # two records, one head
        (b"\x03\x02\xff\xff", "damaged journal step body: Error -3"),
        (b"\x03\x00\x01\x02\x05", "damaged journal step body: a FINISH's ending has form 5"),
        (b"\x03\x00\x01\x02\x01\x07", "damaged journal step body: a FINISH's finish_reason has tag 7"),
    ],
)
def test_a_damaged_or_unknown_body_is_a_value_error(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_step(body)


def test_a_cut_or_altered_zlib_body_is_named_damaged() -> None:
    body = zlib_body(
        encode_step([("admit", f"r{i}", ADMIT) for i in range(8)] + [("output", "r1", LOGPROBS32)], [None] * 8 + [1])
    )
    assert body[1] == 1  # zlib'd
    for damaged in (body[:-5], body[:2] + bytes([body[2] ^ 0xFF]) + body[3:], body[:-1] + bytes([body[-1] ^ 1])):
        with pytest.raises(ValueError, match="damaged journal step body"):
            decode_step(damaged)


def test_a_cut_or_extended_deflated_body_is_named_damaged() -> None:
    # an altered one may still inflate: the journal's hash chain over the stored body names it (test_journal_chain)
    body = encode_step([("admit", f"r{i}", ADMIT) for i in range(8)] + [("output", "r1", LOGPROBS32)], [None] * 8 + [1])
    assert body[1] == 2  # raw deflate
    for damaged in (body[:-5], body + b"\x00"):
        with pytest.raises(ValueError, match="damaged journal step body"):
            decode_step(damaged)


def test_a_cut_stored_body_is_named_damaged() -> None:
    stored = encode_step([("output", "a", OUTPUT)], [1])
    assert stored[1] == 0
    with pytest.raises(ValueError, match="damaged journal step body"):
        decode_step(stored[:-3])
