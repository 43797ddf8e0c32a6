"""The engine's structured-output side: grammars compiled per request, one token mask per step.

``StructuredOutputs`` holds the ``GrammarCompiler`` (compiles a request's constraint into an
llguidance matcher, off the engine thread), builds each step's ``TokenMask`` for the rows
that carry a matcher (``TokenMasker``, made at the first constrained step), and keeps the
counts and timings the metrics read (``take_stats``, safe from any thread).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nanoserve.engine.config import StructuredOutputConfig
from nanoserve.engine.structured.constraint import Constraint
from nanoserve.engine.structured.grammar_compiler import GrammarCompiler
from nanoserve.engine.structured.token_mask import TokenMask, TokenMasker

if TYPE_CHECKING:
    import llguidance

    from nanoserve.engine.text.tokenizer import Tokenizer

MAX_PENDING_TIMINGS = 100_000  # mask timings kept for the metrics until they are taken


class ConstrainedRow(Protocol):
    """A row of a step's logits as the masks see it: its request's matcher, None when unconstrained."""

    @property
    def matcher(self) -> llguidance.LLMatcher | None: ...


@dataclass(frozen=True)
class StructuredOutputStats:
    """num_requests_by_kind: constraint kind -> constrained requests admitted (running totals);
    compile_times_s: seconds of each grammar compile, mask_times_s: seconds filling each constrained
    step's masks, both since the last ``take_stats``."""

    num_requests_by_kind: dict[str, int]
    compile_times_s: list[float]
    mask_times_s: list[float]


class StructuredOutputs:
    """Grammars, masks and their statistics for one engine; ``token_mask`` on the engine thread only."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: StructuredOutputConfig) -> None:
        self.vocab_size = vocab_size
        self.grammars = GrammarCompiler(
            tokenizer,
            vocab_size,
            compile_timeout_s=config.structured_output_compile_timeout_s,
            max_cached=config.max_cached_grammars,
        )
        self._masker: TokenMasker | None = None  # made at the first constrained step
        # seconds filling the grammar masks, one per constrained step (the metrics drain it from another thread)
        self._mask_times_s: collections.deque[float] = collections.deque(maxlen=MAX_PENDING_TIMINGS)
        self._num_admitted: dict[str, int] = {}  # constraint kind -> requests admitted with one, running total

    def admitted(self, constraint: Constraint | None) -> None:
        """Counts a request the engine queued, by its constraint's kind (none: not counted)."""
        if constraint is not None:
            self._num_admitted[constraint.kind.value] = self._num_admitted.get(constraint.kind.value, 0) + 1

    def token_mask(self, rows: Sequence[ConstrainedRow]) -> TokenMask | None:
        """The allowed tokens of the constrained ``rows`` of this step's logits (None: none is constrained)."""
        constrained = [index for index, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return None
        if self._masker is None:
            self._masker = TokenMasker(self.vocab_size)
        start = time.perf_counter()
        bitmask = self._masker.fill([rows[index].matcher for index in constrained])  # type: ignore[misc]
        mask = TokenMask(constrained, bitmask, self._masker.bias(bitmask))
        self._mask_times_s.append(time.perf_counter() - start)
        return mask

    def take_stats(self) -> StructuredOutputStats:
        """What structured outputs did since the last call (any thread: the timings are drained from
        thread-safe deques, the counts copied)."""
        return StructuredOutputStats(
            num_requests_by_kind=dict(self._num_admitted),
            compile_times_s=_drain(self.grammars.compile_times_s),
            mask_times_s=_drain(self._mask_times_s),
        )

    def close(self) -> None:
        """Stops the compile threads (``GrammarCompiler.close``)."""
        self.grammars.close()


def _drain(times: collections.deque[float]) -> list[float]:
    drained = []
    while True:
        try:
            drained.append(times.popleft())
        except IndexError:
            return drained
