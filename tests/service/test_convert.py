"""Protobuf <-> engine types: every field crosses, unset optionals keep the engine defaults."""

from __future__ import annotations

from nanoserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.prompts import ChatPrompt, TokensPrompt
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.service import convert
from nanoserve.v1 import generation_pb2 as pb


def _output(
    finished: bool,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(
                index=0, text="Hello world", token_ids=[10, 11], finish_reason=finish_reason, stop_reason=stop_reason
            )
        ],
        finished=finished,
        delta_text=" world",
        delta_token_ids=[11],
        delta_logprobs=logprobs,
        metrics=RequestMetrics(
            arrival_time=100.0,
            first_scheduled_time=100.25,
            first_token_time=100.5,
            finished_time=102.0,
            num_preemptions=1,
        ),
    )


def test_text_prompt() -> None:
    assert convert.to_prompt(pb.GenerateRequest(prompt="Hi")) == "Hi"


def test_token_prompt() -> None:
    assert convert.to_prompt(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]))) == TokensPrompt(
        prompt_token_ids=[5, 6]
    )


def test_chat_prompt() -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi")]
        )
    )
    assert convert.to_prompt(request) == ChatPrompt(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )


def test_unset_sampling_fields_keep_engine_defaults() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters()) == SamplingParams()


def test_every_sampling_field_crosses() -> None:
    params = pb.SamplingParameters(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        seed=3,
        stop=["\n"],
        stop_token_ids=[9],
        ignore_eos=True,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
    )
    assert convert.to_sampling_params(params) == SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        seed=3,
        stop=["\n"],
        stop_token_ids=[9],
        ignore_eos=True,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
    )


def test_greedy_temperature_zero_is_kept() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters(temperature=0.0)).temperature == 0.0


def test_top_k_zero_means_off() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters(top_k=0)).top_k is None


def test_running_output_is_a_delta_without_finish() -> None:
    response = convert.to_response(_output(finished=False))
    assert (response.request_id, response.text, list(response.token_ids)) == ("r1", " world", [11])
    assert not response.HasField("finish")


def test_last_output_carries_finish_usage_and_timings() -> None:
    finish = convert.to_response(_output(finished=True, finish_reason="stop", stop_reason="\n\n")).finish
    assert finish.reason == pb.FINISH_REASON_STOP
    assert finish.stop_string == "\n\n"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (3, 2)
    assert (finish.timings.queue_s, finish.timings.ttft_s, finish.timings.total_s) == (0.25, 0.5, 2.0)
    assert finish.num_preemptions == 1


def test_stop_token_id_is_reported() -> None:
    finish = convert.to_response(_output(finished=True, finish_reason="stop", stop_reason=2)).finish
    assert finish.WhichOneof("stop_reason") == "stop_token_id"
    assert finish.stop_token_id == 2


def test_logprobs_with_top_alternatives() -> None:
    logprobs = [TokenLogprob(token_id=11, logprob=-0.25, top_logprobs={11: -0.25, 12: -1.5})]
    response = convert.to_response(_output(finished=False, logprobs=logprobs))
    assert [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in response.logprobs] == [
        (11, -0.25, [(11, -0.25), (12, -1.5)])
    ]


def test_finished_request_tpot() -> None:
    summary = convert.finished_request(_output(finished=True, finish_reason="length"))
    assert summary.tpot_s == 1.5  # (2.0 - 0.5) s over the 1 token after the first
