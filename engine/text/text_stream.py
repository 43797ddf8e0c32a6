"""One request's generated tokens, their text, and what has been released to the caller.

Ties the incremental detokenizer to the stop checker and keeps the released
text and released token ids in step: a token is released together with the
text it completes, so a token that holds half a character, or text that may
still turn into a stop string, waits with its text.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.core.outputs import TokenLogprob
from nanoserve.engine.text.detokenizer import Decoder, IncrementalDetokenizer
from nanoserve.engine.text.stop_checker import StopChecker


@dataclass(frozen=True)
class Delta:
    """What one release hands out: text, the token ids it completes, their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class TextStream:
    """Generated tokens -> released text, honouring stop strings and UTF-8 boundaries.

    Invariants: ``released_text`` is a prefix of the final text and never
    contains a stop string; ``released_token_ids`` is a prefix of the token ids;
    after ``finish`` both are complete.
    """

    def __init__(self, decoder: Decoder, stop: list[str], want_logprobs: bool) -> None:
        self._detokenizer = IncrementalDetokenizer(decoder)
        self._stop = StopChecker(stop)
        self.token_ids: list[int] = []  # every generated token id
        self.logprobs: list[TokenLogprob] | None = [] if want_logprobs else None
        self.text = ""  # decoded text of the tokens whose characters are complete
        self._text_ends: list[int] = []  # token index -> end of its text in self.text, once known
        self._stop_at: int | None = None  # start of the matched stop string in self.text
        # what was released: self.text[:_released_end] and token_ids[:num_released_tokens] (kept as two
        # counts, so a release costs O(its delta), not a copy of everything released before)
        self._released_end = 0
        self.num_released_tokens = 0
        self.num_restored_chars = 0  # of the released text, what ``restore_released`` restored

    def append(self, token_id: int, logprob: TokenLogprob | None, *, decode: bool, check_stop: bool) -> str | None:
        """Adds one generated token.

        decode: False for a token whose text is never shown (EOS, stop token).
        check_stop: False while min_tokens forbids stopping.
        Returns the stop string this token completed, or None.
        """
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            assert logprob is not None, "a request that wants logprobs got a token without one"
            self.logprobs.append(logprob)
        if not decode:
            return None
        text_before = len(self.text)
        delta, _ = self._detokenizer.push(token_id)
        self._extend(delta)
        if not check_stop or not delta:
            return None
        match = self._stop.find(self.text, text_before, self._released_end)
        if match is None:
            return None
        self._stop_at = match[0]
        return match[1]

    def release(self, *, final: bool) -> Delta:
        """Hands out what may be shown now; with final=True, everything left.

        Not final: text up to the first position that may still start a stop
        string, and the tokens whose text lies wholly inside it. Final: the text
        up to a matched stop string (or all of it, a trailing partial
        character flushed as U+FFFD) and every remaining token.
        """
        if final:
            delta, _ = self._detokenizer.flush()
            if self._stop_at is None:
                self._extend(delta)
            end = len(self.text) if self._stop_at is None else self._stop_at
            num_tokens = len(self.token_ids)
        else:
            end = self._stop.safe_end(self.text, self._released_end)
            num_tokens = self.num_released_tokens
            while num_tokens < len(self._text_ends) and self._text_ends[num_tokens] <= end:
                num_tokens += 1
        text = self.text[self._released_end : end]
        self._released_end = max(end, self._released_end)
        token_ids = self.token_ids[self.num_released_tokens : num_tokens]
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.num_released_tokens : num_tokens]
        self.num_released_tokens = num_tokens
        return Delta(text, token_ids, logprobs)

    @property
    def released_text(self) -> str:
        """Everything released so far (a copy: O(the text))."""
        return self.text[: self._released_end]

    @property
    def released_token_ids(self) -> list[int]:
        """Every released token id (a copy: O(the tokens))."""
        return self.token_ids[: self.num_released_tokens]

    @property
    def released_logprobs(self) -> list[TokenLogprob] | None:
        """The released tokens' logprobs (a copy), None when the request wants none."""
        if self.logprobs is None:
            return None
        return self.logprobs[: self.num_released_tokens]

    def restore_released(self, text: str) -> None:
        """Marks every token appended so far as released, with ``text`` as their released text
        (a request re-admitted after a crash: its client has these from the journal).
        ``text`` must be what the tokens decode to, a prefix of ``self.text``."""
        assert self.text.startswith(text), "journaled text is not what the journaled tokens decode to"
        self._released_end = self.num_restored_chars = len(text)
        self.num_released_tokens = len(self.token_ids)

    def _extend(self, delta: str) -> None:
        self.text += delta
        # Every token not pending in the detokenizer has its text in self.text now.
        while len(self._text_ends) < len(self.token_ids) - self._detokenizer.num_pending:
            self._text_ends.append(len(self.text))
