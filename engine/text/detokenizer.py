"""Incremental detokenization: token ids in, text deltas out, never half a character.

Decoding each new token alone is wrong twice over: byte-level BPE splits one
UTF-8 character (an emoji, a CJK ideograph) across tokens, and SentencePiece
tokenizers drop or add a leading space depending on what precedes a token.
Decoding everything again each step is right but quadratic. The window
approach (as in TGI and vLLM) decodes only the tokens since the last emitted
boundary plus a few before it for context:

    ids:  ... | prefix_offset ........ read_offset | new tokens
                <- already emitted ->               <- pending ->
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

A delta is emitted only when the decoded window grew and does not end in
U+FFFD (the replacement character a partial UTF-8 sequence decodes to); then
both offsets move forward. Otherwise the new tokens stay pending.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """A tokenizer's decode; special tokens (chat markers, EOS) are skipped in output text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's growing token ids into text deltas.

    Invariant: the concatenation of every delta (``push`` then ``flush``)
    equals ``decoder.decode(all ids, skip_special_tokens=True)`` for byte-level BPE tokenizers; no delta
    ends in the middle of a UTF-8 character.
    """

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this have had their text emitted

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=True) if ids else ""

    @property
    def num_pending(self) -> int:
        """Token ids whose text is not emitted yet (a partial character)."""
        return len(self._ids) - self._read_offset

    def push(self, token_id: int) -> tuple[str, int]:
        """Adds one token id.

        Returns (text delta, number of token ids whose text that delta completes);
        ("", 0) while the window ends in a partial character.
        """
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return "", 0
        num_completed = len(self._ids) - self._read_offset
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :], num_completed

    def flush(self) -> tuple[str, int]:
        """Emits whatever is pending, partial characters included (end of stream)."""
        if self.num_pending == 0:
            return "", 0
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        num_completed = self.num_pending
        self._prefix_offset = self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :], num_completed
