"""The grammar compiler on the real tokenizer: llguidance's refusals become InvalidRequestError naming
the field, a slow compile is refused at the time limit, compiled grammars are cached by hash."""

from __future__ import annotations

import json

import pytest

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.structured.constraint import Constraint
from nanoserve.engine.structured.grammar_compiler import GrammarCompiler, grammar_key


def nested_one_of(depth: int, width: int) -> dict:
    """A pathological schema: ``depth`` levels of ``width``-way oneOf, each branch with a pattern."""
    schema: dict = {"type": "string"}
    for level in range(depth):
        schema = {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {
                        f"k{level}_{i}": schema,
                        f"x{i}": {"type": "string", "pattern": f"[a-z]{{{i},{i + 5}}}"},
                    },
                    "required": [f"k{level}_{i}"],
                }
                for i in range(width)
            ]
        }
    return schema


def test_token_bytes_spell_the_byte_level_vocabulary(real_tokenizer) -> None:
    token_ids = real_tokenizer.encode('Hello world {"a": 1}')
    assert [real_tokenizer.token_bytes[i] for i in token_ids] == [
        b"Hello",
        b" world",
        b' {"',
        b"a",
        b'":',
        b" ",
        b"1",
        b"}",
    ]
    assert real_tokenizer.token_bytes[2] == b"<|im_end|>"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "[0-9"), 'constraint.regex: invalid regex "[0-9": unclosed character class at offset 0'),
        (
            Constraint("json_schema", '{"type": "object", "if": {"type": "object"}}'),
            'constraint.json_schema: Unimplemented keys: ["if"]',
        ),
        (Constraint("grammar", "start: foo"), 'constraint.grammar: at 1(8): unknown name: "foo"'),
    ],
)
def test_a_grammar_llguidance_refuses_is_invalid_naming_the_field(compiler, constraint, message) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        compiler.matcher(constraint)
    assert str(caught.value).startswith(message)
    assert caught.value.field == constraint.field


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("regex", "[0-9"), 'constraint.regex: invalid regex "[0-9": unclosed character class at offset 0'),
        (Constraint("regex", "ab(c"), 'constraint.regex: invalid regex "ab(c": unclosed group at offset 2'),
        (
            Constraint("regex", "a{3,1}"),
            'constraint.regex: invalid regex "a{3,1}": invalid repetition count range, '
            "the start must be <= the end at offset 1",
        ),
        (Constraint("grammar", "start: foo"), 'constraint.grammar: at 1(8): unknown name: "foo"'),
        (
            Constraint("json_schema", '{"type": "string", "pattern": "x[0-9"}'),
            'constraint.json_schema: invalid regex "x[0-9": unclosed character class at offset 1',
        ),
    ],
)
def test_a_refusal_is_one_readable_line_without_llguidances_source_quote(compiler, constraint, message) -> None:
    # llguidance's report is several lines (the pattern, a caret under the fault, a quote of its own
    # wrapper grammar with another caret); flattened, the carets pointed at nothing
    with pytest.raises(InvalidRequestError) as caught:
        compiler.matcher(constraint)
    assert str(caught.value) == message


def test_a_compile_past_the_time_limit_is_refused_then_served_from_the_cache(real_tokenizer) -> None:
    constraint = Constraint("json_schema", json.dumps(nested_one_of(3, 12)))  # ~0.4 s to compile alone
    compiler = GrammarCompiler(real_tokenizer, real_tokenizer.vocab_size, compile_timeout_s=0.02, max_cached=4)
    try:
        with pytest.raises(InvalidRequestError) as caught:
            compiler.matcher(constraint)
        assert str(caught.value) == (
            "constraint.json_schema: did not compile within 0.02 s "
            "(--structured-output-compile-timeout-s); simplify the grammar"
        )
        compiler.compile_timeout_s = 30.0  # the refused compile finishes on its thread and is kept
        assert not compiler.matcher(constraint).is_error()
        assert compiler.num_cached == 1
    finally:
        compiler.close()


def test_cache_is_keyed_by_hash_and_bounded(compiler) -> None:
    regexes = [Constraint("regex", f"[0-9]{{{n}}}") for n in range(1, 7)]
    for constraint in regexes:
        compiler.matcher(constraint)
    assert compiler.num_cached == 4  # max_cached: the two oldest were dropped
    key = grammar_key(regexes[-1], "t")
    assert key == grammar_key(Constraint("regex", "[0-9]{6}"), "t") != grammar_key(regexes[-1], "other tokenizer")


def test_each_request_gets_its_own_matcher(compiler, real_tokenizer) -> None:
    constraint = Constraint("choice", choices=("yes", "no"))
    first, second = compiler.matcher(constraint), compiler.matcher(constraint)
    assert first.consume_tokens(real_tokenizer.encode("yes"))
    assert first.is_stopped()
    assert not second.is_stopped()
    assert compiler.num_cached == 1
