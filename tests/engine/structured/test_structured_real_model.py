"""Structured outputs on the real SmolLM2-135M-Instruct, greedy: every kind of constraint holds,
the request ends when its grammar is complete, and preemption and crash recovery keep the grammar."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from nanoserve.engine import ChatPrompt, EngineConfig, LLMEngine, SamplingParams
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.core.outputs import RequestOutput
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.structured.constraint import Constraint

pytestmark = pytest.mark.real_model

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "address", "tags"],
    "additionalProperties": False,
}
PERSON_PROMPTS = ["Describe a person as JSON.", "Invent a customer record.", "Tell me about your best friend in JSON."]


@pytest.fixture(scope="module")
def engine(real_runner) -> LLMEngine:
    return LLMEngine(real_runner.config, runner=real_runner)


def _chat(text: str) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": text}])


def _params(constraint: Constraint, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)


def _run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list[RequestOutput]:
    for i, (text, params) in enumerate(requests):
        engine.add_request(f"s{i}", _chat(text), params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[f"s{i}"] for i in range(len(requests))]


def test_nested_json_schema_output_validates(engine: LLMEngine) -> None:
    constraint = Constraint("json_schema", json.dumps(PERSON_SCHEMA))
    outputs = _run(engine, [(prompt, _params(constraint, 160)) for prompt in PERSON_PROMPTS])
    for output in outputs:
        assert (output.finish_reason, output.stop_reason) == ("stop", None), output.text
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)
    assert engine.pool_status().num_free == engine.pool_status().num_blocks


def test_regex_choice_and_json_object(engine: LLMEngine) -> None:
    phone, answer, obj = _run(
        engine,
        [
            ("Give me a phone number.", _params(Constraint("regex", "[0-9]{3}-[0-9]{4}"))),
            ("Is the sky blue? Answer yes or no.", _params(Constraint("choice", choices=("yes", "no")))),
            ("Give a JSON object with a name and an age.", _params(Constraint("json_object"), 200)),
        ],
    )
    assert (phone.text, phone.token_ids, phone.finish_reason) == ("123-4567", [33, 34, 35, 29, 36, 37, 38, 39], "stop")
    assert (answer.text, answer.finish_reason) == ("no", "stop")
    assert obj.finish_reason == "stop", obj.text
    assert isinstance(json.loads(obj.text), dict)


def test_unconstrained_rows_in_the_same_batch_are_untouched(engine: LLMEngine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    (alone,) = _run(engine, [("What is the capital of France?", plain)])
    mixed, _ = _run(
        engine,
        [
            ("What is the capital of France?", plain),
            ("Give me a phone number.", _params(Constraint("regex", "[0-9]{3}"))),
        ],
    )
    assert mixed.token_ids == alone.token_ids
    assert mixed.text == "The capital of France is Paris."


def test_a_bad_constraint_is_refused_before_it_is_queued(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match=r'^constraint\.json_schema: Unimplemented keys: \["if"\]'):
        engine.add_request("bad", _chat("hi"), _params(Constraint("json_schema", '{"type": "object", "if": {}}')))
    assert not engine.has_unfinished_requests()


def test_preempted_constrained_request_gives_the_undisturbed_tokens(engine: LLMEngine) -> None:
    params = _params(Constraint("json_schema", json.dumps(PERSON_SCHEMA)), 160)
    (undisturbed,) = _run(engine, [(PERSON_PROMPTS[0], params)])
    engine.add_request("p", _chat(PERSON_PROMPTS[0]), params)
    finals: list[RequestOutput] = []
    for step in range(1, 1000):
        finals += [o for o in engine.step() if o.finished]
        if step in (5, 12):  # mid-JSON: the request recomputes prompt + output, its matcher kept
            engine.scheduler.preempt(engine._requests["p"])
            engine.allocator.take_events()  # the frees of a preemption outside a step (this engine keeps no log)
        if not engine.has_unfinished_requests():
            break
    (final,) = finals
    assert final.metrics is not None
    assert final.metrics.num_preemptions == 2
    assert (final.token_ids, final.text) == (undisturbed.token_ids, undisturbed.text)


def test_a_crashed_constrained_request_recovers_under_the_same_grammar(real_runner, tmp_path: Path) -> None:
    settings = {"device": "cpu", "num_kv_blocks": 512, "block_size": 16, "quantization": "none", "dtype": "float32"}
    config = EngineConfig.from_kwargs(**settings, event_log_url=f"sqlite:///{tmp_path / 'log.db'}")
    params = _params(Constraint("json_schema", json.dumps(PERSON_SCHEMA)), 160)
    engine = build_engine(config, runner=real_runner)
    (undisturbed,) = _run(engine, [(PERSON_PROMPTS[1], params)])
    engine.add_request("k", _chat(PERSON_PROMPTS[1]), params)
    for _ in range(10):
        engine.step()
    log = engine.event_log
    assert log is not None
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL: the epoch stays open, the request unfinished in the journal
    log._release()
    recovered = build_engine(config, runner=real_runner)
    (request,) = recovered.recovered_requests
    assert request.request_id == "k"
    assert request.matcher is not None
    assert request.sampling_params.constraint == params.constraint
    assert 0 < request.num_output_tokens < len(undisturbed.token_ids)
    finals = []
    while recovered.has_unfinished_requests():
        finals += [o for o in recovered.step() if o.finished]
    recovered.shutdown()
    (final,) = finals
    assert (final.token_ids, final.text, final.finish_reason) == (undisturbed.token_ids, undisturbed.text, "stop")
