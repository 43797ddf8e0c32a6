"""Compiling a ``Constraint`` into an llguidance matcher: off the engine thread, in time, cached.

llguidance (Moskal et al., "Low-level Guidance", github.com/guidance-ai/llguidance)
turns a grammar and the model's vocabulary into a matcher that, at each step,
says which tokens may come next (a bitmask, one bit per token id). Its
tokenizer is built here from our own ``Tokenizer`` (the bytes of every token
id), with no hub access.

Compiling (building the lexer and parser tables) can take long for a large
schema, so it runs on a small pool of compile threads (llguidance drops the
GIL meanwhile) and the caller waits at most ``compile_timeout_s``: a grammar
slower than that is refused as invalid input. A refused compile still runs to
its end on its thread (a native call cannot be stopped), bounded by
llguidance's own grammar-size and lexer-fuel limits, and its result is
cached for the next request with the same grammar. Compiled grammars are
kept by the sha256 of (kind, text, choices, tokenizer) in an LRU of
``max_cached_grammars`` entries, errors included, so a repeated schema costs
a lookup and a matcher copy.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.structured.constraint import Constraint, ConstraintKind
from nanoserve.engine.structured.grammar_error import readable_error

if TYPE_CHECKING:
    from nanoserve.engine.text.tokenizer import Tokenizer

NUM_COMPILE_THREADS = 2
MAX_PENDING_TIMINGS = 100_000  # compile times kept for the metrics until they are taken
# JSON output in one canonical spacing: flexible whitespace lets a small model pad forever
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,  # oneOf read as anyOf (as vLLM does): the output matches at least one branch
}


class _VocabularyView:
    """What llguidance's ``LLTokenizer`` reads from a tokenizer: every token's bytes, EOS, BOS,
    special ids, and a call that encodes text (bytes or str) to token ids."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        token_bytes = tokenizer.token_bytes
        self.tokens: list[bytes] = token_bytes + [b""] * (vocab_size - len(token_bytes))
        self.eos_token_id: int = min(tokenizer.eos_token_ids)
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.special_token_ids: list[int] = tokenizer.special_token_ids
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of ``tokenizer`` over ``vocab_size`` ids (the logits' width: ids past
    the tokenizer's own vocabulary are never allowed), every EOS id ending the grammar."""
    view = _VocabularyView(tokenizer, vocab_size)
    return llguidance.LLTokenizer(
        view,  # type: ignore[arg-type]  # duck-typed as TokenizerWrapper, as llguidance reads it
        n_vocab=vocab_size,
        eos_token=sorted(tokenizer.eos_token_ids),
    )


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked). Raises InvalidRequestError for a
    grammar llguidance cannot even read (a GBNF grammar it cannot convert, a bad structural tag)."""
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.text)
    if kind is ConstraintKind.CHOICE:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
    if kind is ConstraintKind.GRAMMAR:
        if "::=" in constraint.text:  # GBNF (llama.cpp's notation): llguidance converts it to Lark
            try:
                return llguidance.grammar_from("gbnf", constraint.text)
            except ValueError as exc:
                raise InvalidRequestError(constraint.field, str(exc)) from None
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    assert kind is ConstraintKind.STRUCTURAL_TAG, kind
    return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(constraint))


def structural_tag_lark(constraint: Constraint) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) as a
    Lark grammar: free text in which each structure, once its trigger appears, is its begin
    string, JSON matching its schema, then its end string (llguidance's ``StructTag``)."""
    field = constraint.field
    tag = constraint.schema()
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise InvalidRequestError(f"{field}.structures", "must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidRequestError(f"{field}.triggers", "must be a non-empty list of non-empty strings")
    tags = []
    for index, structure in enumerate(structures):
        begin, end = (structure.get(key) if isinstance(structure, dict) else None for key in ("begin", "end"))
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidRequestError(f"{field}.structures[{index}]", 'needs string "begin" and "end"')
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidRequestError(f"{field}.structures[{index}].begin", "starts with none of the triggers")
        schema = structure.get("schema", {})
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    # triggers are matched as text: a trigger spelled by a special token (<|python_tag|>) is not supported yet
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def grammar_key(constraint: Constraint, tokenizer_id: str) -> str:
    """sha256 of (kind, text, choices, tokenizer): the cache key of a compiled grammar."""
    payload = json.dumps([constraint.kind.value, constraint.text, list(constraint.choices), tokenizer_id])
    return hashlib.sha256(payload.encode()).hexdigest()


class GrammarCompiler:
    """Compiles constraints to template matchers on its own threads; hands each request a copy.

    Invariant: the cache holds at most ``max_cached`` entries, each the result of
    one finished compile (a template ``LLMatcher`` in its start state, never
    advanced, or the InvalidRequestError it gave). Thread-safe: the tokenizer
    threads of AsyncLLMEngine call ``matcher`` concurrently.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, compile_timeout_s: float, max_cached: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.max_cached = max_cached
        self._tokenizer_id = f"{tokenizer.name}|{vocab_size}|{sorted(tokenizer.eos_token_ids)}"
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built at the first constraint
        # grammar_key -> template LLMatcher, or the error its compile gave; LRU order
        self._cache: OrderedDict[str, llguidance.LLMatcher | InvalidRequestError] = OrderedDict()
        # grammar_key -> its compile still running (a second request for it waits on the same one)
        self._running: dict[str, concurrent.futures.Future[llguidance.LLMatcher | InvalidRequestError]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="grammar-compile")
        # seconds of each finished compile, for the metrics (which drain it from another thread)
        self.compile_times_s: collections.deque[float] = collections.deque(maxlen=MAX_PENDING_TIMINGS)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = grammar_tokenizer(self._tokenizer, self.vocab_size)
            return self._ll_tokenizer

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher of ``constraint`` in its start state (a copy of the cached template).

        Waits at most ``compile_timeout_s`` for a compile. Raises
        InvalidRequestError naming ``constraint.<kind>``: the grammar does not
        compile (llguidance's message says which keyword or rule, and where), or
        did not compile in time.
        """
        ll_tokenizer = self.ll_tokenizer
        key = grammar_key(constraint, self._tokenizer_id)
        future = None
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
            else:
                future = self._running.get(key)
                if future is None:
                    future = self._pool.submit(self._compile, key, constraint, ll_tokenizer)
                    self._running[key] = future
        if future is not None:
            try:
                cached = future.result(timeout=self.compile_timeout_s)
            except concurrent.futures.TimeoutError:
                raise InvalidRequestError(
                    constraint.field,
                    f"did not compile within {self.compile_timeout_s:g} s "
                    "(--structured-output-compile-timeout-s); simplify the grammar",
                ) from None
        assert cached is not None, "a finished compile leaves a matcher or an error"
        if isinstance(cached, InvalidRequestError):
            raise InvalidRequestError(cached.field, str(cached).removeprefix(f"{cached.field}: "))
        return cached.deep_copy()

    def _compile(
        self, key: str, constraint: Constraint, ll_tokenizer: llguidance.LLTokenizer
    ) -> llguidance.LLMatcher | InvalidRequestError:
        start = time.perf_counter()
        result: llguidance.LLMatcher | InvalidRequestError
        try:
            result = compile_matcher(constraint, ll_tokenizer)
        except InvalidRequestError as exc:
            result = exc
        elapsed_s = time.perf_counter() - start
        with self._lock:
            self._running.pop(key, None)
            self._cache[key] = result
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            if not isinstance(result, InvalidRequestError):
                self.compile_times_s.append(elapsed_s)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compile_matcher(constraint: Constraint, ll_tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """Compiles now, on the calling thread. Raises InvalidRequestError with llguidance's message."""
    try:
        source = grammar_source(constraint)
    except InvalidRequestError:
        raise
    except ValueError as exc:  # llguidance's own: a schema it cannot read
        raise InvalidRequestError(constraint.field, str(exc)) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, ll_tokenizer)
    if is_error:
        raise InvalidRequestError(constraint.field, readable_error(messages[0] if messages else "", constraint.kind))
    matcher = llguidance.LLMatcher(ll_tokenizer, source, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(constraint.field, readable_error(matcher.get_error(), constraint.kind))
    return matcher
