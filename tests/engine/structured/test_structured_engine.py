"""Structured outputs in the engine on the tiny random model: a grammar that allows no next token
aborts its request (cause grammar) with its token discarded; a resumed prompt's prior output advances
the matcher; GBNF grammars and structural tags compile and hold."""

from __future__ import annotations

import json
import re

import pytest

from nanoserve.engine import LLMEngine, SamplingParams, TokensPrompt
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.structured.constraint import Constraint

PROMPT = TokensPrompt([101, 202, 303, 404, 505])


@pytest.fixture(scope="module")
def engine(tiny_runner_factory) -> LLMEngine:
    runner = tiny_runner_factory()
    return LLMEngine(runner.config, runner=runner)


def _finish(engine: LLMEngine) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def _text(engine: LLMEngine, output: RequestOutput) -> str:
    return engine.tokenizer.decode(output.outputs[0].token_ids)


def test_a_grammar_that_allows_no_token_aborts_with_cause_grammar(engine: LLMEngine) -> None:
    engine.add_request(
        "dead", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, constraint=Constraint("regex", "[0-9]+"))
    )
    engine.step()  # prefill: the first digit
    request = engine._requests["dead"]
    assert request.matcher is not None
    # refused: the matcher is in error from now on (llguidance's mask then allows EOS only)
    assert not request.matcher.consume_token(engine.tokenizer.encode("x")[0])
    final = _finish(engine)["dead"]
    assert (final.finish_reason, final.abort_cause) == ("abort", AbortCause.GRAMMAR)
    assert len(final.outputs[0].token_ids) == 1  # the token drawn from the empty mask was discarded
    assert re.fullmatch("[0-9]+", final.outputs[0].text)
    assert engine.pool_status().num_free == engine.pool_status().num_blocks


def test_a_resumed_prompt_advances_the_matcher_over_its_prior_output(engine: LLMEngine) -> None:
    constraint = Constraint("regex", "ab[0-9]{3}")
    prior = engine.tokenizer.encode("ab")
    engine.add_request(
        "resumed",
        TokensPrompt(PROMPT.prompt_token_ids + prior, num_prior_output_tokens=len(prior)),
        SamplingParams(temperature=0.0, max_tokens=8, constraint=constraint),
    )
    final = _finish(engine)["resumed"]
    assert re.fullmatch("[0-9]{3}", final.outputs[0].text), final.outputs[0].text
    with pytest.raises(InvalidRequestError, match=r"^num_prior_output_tokens: the prior output does not match"):
        engine.add_request(
            "bad-prior",
            TokensPrompt(PROMPT.prompt_token_ids + engine.tokenizer.encode("zz"), num_prior_output_tokens=1),
            SamplingParams(temperature=0.0, max_tokens=8, constraint=constraint),
        )


def test_gbnf_grammar_and_sampled_choice_hold(engine: LLMEngine) -> None:
    engine.add_request(
        "gbnf",
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=16, constraint=Constraint("grammar", 'root ::= "up" | "down"')),
    )
    for seed in range(4):
        params = SamplingParams(
            temperature=1.5,
            top_p=0.9,
            seed=seed,
            max_tokens=16,
            constraint=Constraint("choice", choices=("red", "green", "blue")),
        )
        engine.add_request(f"c{seed}", PROMPT, params)
    finals = _finish(engine)
    assert (finals["gbnf"].outputs[0].text in {"up", "down"}, finals["gbnf"].finish_reason) == (True, "stop")
    assert {finals[f"c{seed}"].outputs[0].text for seed in range(4)} <= {"red", "green", "blue"}


def test_a_structural_tag_constrains_the_tagged_part(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    tag = {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}
    prompt = TokensPrompt(PROMPT.prompt_token_ids + engine.tokenizer.encode("<f>"))
    params = SamplingParams(temperature=0.0, max_tokens=24, constraint=Constraint("structural_tag", json.dumps(tag)))
    engine.add_request("tag", prompt, params)
    text = _finish(engine)["tag"].outputs[0].text
    if "<f>" in text:  # free text until the trigger; from there the structure is forced
        body = text.split("<f>", 1)[1]
        if "</f>" in body:
            assert json.loads(body.split("</f>", 1)[0])["n"] <= 99
    with pytest.raises(InvalidRequestError, match=r"^constraint\.structural_tag\.triggers: must be a non-empty list"):
        engine.add_request(
            "bad-tag", PROMPT, SamplingParams(constraint=Constraint("structural_tag", '{"structures": [{}]}'))
        )
