"""Incremental detokenization and stop strings: what is released, and when.

A byte-level BPE tokenizer trained here (so emoji and CJK characters split
into several byte tokens, as in SmolLM2's tokenizer) checks UTF-8 handling; a
piece-per-id decoder makes stop-string boundaries exact.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanoserve.engine.text.detokenizer import IncrementalDetokenizer
from nanoserve.engine.text.text_stream import TextStream


class PieceDecoder:
    """Token id i decodes to pieces[i]; a sequence decodes to their concatenation."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog."] * 20, trainer)
    return tokenizer


def _stream(
    decoder, token_ids: list[int], stop: list[str] | None = None
) -> tuple[list[tuple[str, list[int]]], TextStream, str | None]:
    stream = TextStream(decoder, stop or [], want_logprobs=False)
    deltas = []
    matched = None
    for token_id in token_ids:
        matched = stream.append(token_id, None, decode=True, check_stop=True)
        if matched is not None:
            break
        delta = stream.release(final=False)
        deltas.append((delta.text, delta.token_ids))
    final = stream.release(final=True)
    deltas.append((final.text, final.token_ids))
    return deltas, stream, matched


def test_emoji_and_cjk_split_across_byte_tokens(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("😀世").ids
    assert len(ids) == 7  # 4 bytes + 3 bytes, one token each
    detokenizer = IncrementalDetokenizer(byte_bpe)
    deltas = [detokenizer.push(i) for i in ids]
    assert deltas == [("", 0), ("", 0), ("", 0), ("😀", 4), ("", 0), ("", 0), ("世", 3)]


def test_streamed_deltas_concatenate_to_full_decode(byte_bpe: Tokenizer) -> None:
    text = "hello 😀 world, 世界! café the fox 🦊🦊 done"
    ids = byte_bpe.encode(text).ids
    deltas, stream, _ = _stream(byte_bpe, ids)
    assert "".join(t for t, _ in deltas) == text == byte_bpe.decode(ids)
    assert all("\ufffd" not in t for t, _ in deltas)
    assert [i for _, chunk in deltas for i in chunk] == ids
    assert stream.released_text == text


def test_token_of_half_a_character_waits_for_its_text(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("a😀").ids
    deltas, _, _ = _stream(byte_bpe, ids)
    assert deltas[:5] == [("a", ids[:1]), ("", []), ("", []), ("", []), ("😀", ids[1:])]


def test_flush_at_end_emits_trailing_partial_character(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("a😀").ids[:3]  # "a" and half the emoji
    deltas, stream, _ = _stream(byte_bpe, ids)
    assert stream.released_text == byte_bpe.decode(ids)
    assert deltas[-1] == (byte_bpe.decode(ids)[1:], ids[1:])


def test_stop_string_across_token_boundaries_is_not_emitted() -> None:
    decoder = PieceDecoder(["xa", "b", "cd", "z"])
    deltas, stream, matched = _stream(decoder, decoder.ids("xa", "b", "cd", "z"), stop=["abc"])
    assert matched == "abc"
    # "a" and "ab" are held: they may be the start of "abc"; token "xa" waits with its "a"
    assert deltas == [("x", []), ("", []), ("", decoder.ids("xa", "b", "cd"))]
    assert stream.released_text == "x"


def test_stop_string_at_the_very_start_gives_empty_text() -> None:
    decoder = PieceDecoder(["ab", "c", "d"])
    deltas, stream, matched = _stream(decoder, decoder.ids("ab", "c", "d"), stop=["abc"])
    assert matched == "abc"
    assert deltas == [("", []), ("", decoder.ids("ab", "c"))]
    assert stream.released_text == ""


def test_held_prefix_is_released_once_it_cannot_be_a_stop() -> None:
    decoder = PieceDecoder(["xa", "bz", "q"])
    deltas, _, matched = _stream(decoder, decoder.ids("xa", "bz", "q"), stop=["abc"])
    assert matched is None
    assert deltas == [("x", []), ("abz", decoder.ids("xa", "bz")), ("q", decoder.ids("q")), ("", [])]


def test_earliest_of_several_stop_strings_wins() -> None:
    decoder = PieceDecoder(["one two three"])
    _, stream, matched = _stream(decoder, [0], stop=["three", "two"])
    assert matched == "two"
    assert stream.released_text == "one "


def test_overlapping_stop_prefix_keeps_only_what_may_match() -> None:
    decoder = PieceDecoder(["a", "b"])
    deltas, stream, matched = _stream(decoder, decoder.ids("a", "a", "a", "b"), stop=["aab"])
    assert matched == "aab"
    assert stream.released_text == "a"
    assert [t for t, _ in deltas] == ["", "", "a", ""]


def test_stop_checks_off_release_a_complete_stop_string() -> None:
    decoder = PieceDecoder(["ab", "c"])
    stream = TextStream(decoder, ["ab"], want_logprobs=False)
    assert stream.append(0, None, decode=True, check_stop=False) is None
    assert stream.append(1, None, decode=True, check_stop=True) is None  # "ab" lies before the new text
    assert stream.release(final=False).text == "abc"
