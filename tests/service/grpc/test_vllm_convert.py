"""vLLM's engine contract <-> engine types: every sampling field mapped or refused by name, responses exact."""

from __future__ import annotations

import hashlib
import io
import zipfile
from typing import Any

import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestOutput, TokenLogprob
from nanoserve.engine.core.status import ModelInfo, PoolStatus
from nanoserve.engine.errors import EngineDeadError, InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.constraint import Constraint, ConstraintKind
from nanoserve.engine.text.prompts import TokensPrompt
from nanoserve.service.grpc import vllm_convert
from nanoserve.service.grpc.interceptors import message_for

GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def _refusal(request: vpb.GenerateRequest) -> str:
    """The status message a Generate request is refused with."""
    with pytest.raises(InvalidRequestError) as info:
        vllm_convert.to_prompt(request)
        vllm_convert.to_sampling_params(request.sampling_params)
    return message_for(info.value, GENERATE)


def _tokenized(**sampling: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r1",
        tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vpb.SamplingParams(**sampling),
    )


# ---- input -------------------------------------------------------------------


def test_token_ids_are_the_prompt() -> None:
    assert vllm_convert.to_prompt(_tokenized()) == TokensPrompt(prompt_token_ids=[1, 2, 3])


def test_text_is_the_prompt() -> None:
    assert vllm_convert.to_prompt(vpb.GenerateRequest(text="Hello")) == "Hello"


def test_data_parallel_rank_zero_is_accepted() -> None:
    request = _tokenized()
    request.data_parallel_rank = 0
    assert vllm_convert.to_prompt(request) == TokensPrompt(prompt_token_ids=[1, 2, 3])


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({}, "input: give tokenized or text; none was set"),
        (
            {"text": "x", "mm_inputs": vpb.MultimodalInputs(mm_hashes=["h"])},
            "mm_inputs: not supported: the model takes text only",
        ),
        (
            {"text": "x", "extra_mm_inputs": [vpb.MultimodalInputs()]},
            "extra_mm_inputs: not supported: the model takes text only",
        ),
        (
            {"text": "x", "media_refs": vpb.MediaRefs(items=[vpb.MediaRef(url="http://x/y.png")])},
            "media_refs: not supported: the model takes text only",
        ),
        (
            {"text": "x", "kv_transfer_params": vpb.KvTransferParams(remote_host="h")},
            "kv_transfer_params: not supported: KV transfer (prefill/decode disaggregation) is not supported",
        ),
        (
            {"text": "x", "kv_transfer_params_json": "{}"},
            "kv_transfer_params_json: not supported: KV transfer (prefill/decode disaggregation) is not supported",
        ),
        (
            {"text": "x", "data_parallel_rank": 1},
            "data_parallel_rank: must be 0 or unset (a nanoserve server is one data-parallel rank), got 1",
        ),
    ],
)
def test_inputs_nanoserve_cannot_take_are_refused_by_name(request_fields: dict[str, Any], message: str) -> None:
    assert _refusal(vpb.GenerateRequest(**request_fields)) == message


# ---- sampling parameters -----------------------------------------------------


def test_unset_fields_take_the_engine_defaults_except_max_tokens() -> None:
    """proto3 zeros mean "unset"; an unset max_tokens is vLLM's "up to max_model_len", not our API's 16."""
    assert vllm_convert.to_sampling_params(vpb.SamplingParams()) == SamplingParams(max_tokens=None)


def test_what_the_gateway_sends_for_a_chat_maps_field_by_field() -> None:
    """smg's chat request: top_p and repetition_penalty 1, skip_special_tokens and
    spaces_between_special_tokens on (text options: the gateway detokenizes), n 1."""
    # the proto's floats are float32: values exact in float32 compare equal
    params = vpb.SamplingParams(
        temperature=0.75,
        top_p=0.875,
        top_k=40,
        min_p=0.0625,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.25,
        max_tokens=64,
        min_tokens=2,
        stop=["\n\n", "END"],
        stop_token_ids=[7],
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        include_stop_str_in_output=True,
        ignore_eos=True,
        n=1,
        logprobs=3,
        seed=-42,
    )
    assert vllm_convert.to_sampling_params(params) == SamplingParams(
        temperature=0.75,
        top_p=0.875,
        top_k=40,
        min_p=0.0625,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.25,
        max_tokens=64,
        min_tokens=2,
        stop=["\n\n", "END"],
        stop_token_ids=[7],
        ignore_eos=True,
        logprobs=3,
        seed=-42,
    )


def test_temperature_zero_is_greedy_not_unset() -> None:
    params = vllm_convert.to_sampling_params(vpb.SamplingParams(temperature=0.0))
    assert params.temperature == 0.0
    assert params.greedy


def test_logit_bias_and_truncate_prompt_tokens_pass_through() -> None:
    params = vllm_convert.to_sampling_params(
        vpb.SamplingParams(logit_bias={5: -100.0, 9: 2.5}, truncate_prompt_tokens=4)
    )
    assert (params.logit_bias, params.truncate_prompt_tokens) == ({5: -100.0, 9: 2.5}, 4)


def test_prompt_logprobs_go_out_as_input_logprobs_the_first_without_a_value() -> None:
    message = vllm_convert.to_input_logprobs(
        [7, 8, 9], [TokenLogprob(8, -1.5, {8: -1.5}), TokenLogprob(9, -0.5, {3: -0.25})]
    )
    assert list(message.token_ids) == [7, 8, 9]
    assert [e.HasField("value") for e in message.token_logprobs] == [False, True, True]
    assert [e.value for e in message.token_logprobs[1:]] == [-1.5, -0.5]
    assert [(list(t.token_ids), list(t.values)) for t in message.top_logprobs] == [
        ([], []),
        ([8], [-1.5]),
        ([3], [-0.25]),
    ]


def test_n_above_1_asks_for_that_many_samples() -> None:
    assert vllm_convert.to_sampling_params(vpb.SamplingParams(n=3)).n == 3
    assert vllm_convert.to_sampling_params(vpb.SamplingParams(n=0)).n == 1


def test_logprobs_zero_asks_for_the_chosen_token_only() -> None:
    assert vllm_convert.to_sampling_params(vpb.SamplingParams(logprobs=0)).logprobs == 0


# field set on SamplingParams -> the whole status message
SAMPLING_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs: must be in [0, 20], got 21"),
    (
        {"truncate_prompt_tokens": -2},
        "sampling_params.truncate_prompt_tokens: must be -1 (the model's limit) or an integer >= 1, got -2",
    ),
    ({"logit_bias": {5: 101.0}}, "sampling_params.logit_bias[5]: must be in [-100, 100], got 101.0"),
    # the constraint's shape (whether it compiles is the engine's question)
    (
        {"json_schema": "{not json"},
        "sampling_params.json_schema: is not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    ),
    ({"regex": ""}, "sampling_params.regex: is empty"),  # proto3: an empty string member is still set
    ({"json_object": False}, "sampling_params.json_object: must be true when set (unset it for no constraint)"),
    ({"choice": vpb.ChoiceConstraint()}, "sampling_params.choice.choices: is an empty list (give at least one choice)"),
    (
        {"choice": vpb.ChoiceConstraint(choices=["a", ""])},
        "sampling_params.choice.choices[1]: must be a non-empty string, got ''",
    ),
    # the engine's own range checks, named by this contract's paths
    ({"logprobs": -1}, "sampling_params.logprobs: must be in [0, 20], got -1"),
    ({"max_tokens": 0}, "sampling_params.max_tokens: must be >= 1, got 0"),
    ({"top_p": 1.5}, "sampling_params.top_p: must be in (0, 1], got 1.5"),
    (
        {"temperature": -1.0},
        "sampling_params.temperature: must be finite and >= 0 (0, or below 1e-05: greedy), got -1.0",
    ),
    ({"presence_penalty": 3.0}, "sampling_params.presence_penalty: must be in [-2, 2], got 3.0"),
    ({"stop": [""]}, "sampling_params.stop[0]: must be a non-empty string, got ''"),
]


@pytest.mark.parametrize(("sampling", "message"), SAMPLING_REFUSALS, ids=[next(iter(f)) for f, _ in SAMPLING_REFUSALS])
def test_sampling_fields_nanoserve_does_not_do_are_refused_by_name(sampling: dict[str, Any], message: str) -> None:
    assert _refusal(_tokenized(**sampling)) == message


CONSTRAINTS: list[tuple[dict[str, Any], Constraint]] = [
    ({"json_schema": '{"type": "object"}'}, Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}')),
    ({"regex": "[0-9]+"}, Constraint(ConstraintKind.REGEX, "[0-9]+")),
    ({"grammar": 'root ::= "x"'}, Constraint(ConstraintKind.GRAMMAR, 'root ::= "x"')),
    ({"structural_tag": '{"structures": []}'}, Constraint(ConstraintKind.STRUCTURAL_TAG, '{"structures": []}')),
    ({"json_object": True}, Constraint(ConstraintKind.JSON_OBJECT)),
    ({"choice": vpb.ChoiceConstraint(choices=["a", "b"])}, Constraint(ConstraintKind.CHOICE, "", ("a", "b"))),
]


@pytest.mark.parametrize(("sampling", "constraint"), CONSTRAINTS, ids=[next(iter(f)) for f, _ in CONSTRAINTS])
def test_each_constraint_member_becomes_the_engines_constraint(
    sampling: dict[str, Any], constraint: Constraint
) -> None:
    assert vllm_convert.to_sampling_params(vpb.SamplingParams(**sampling)).constraint == constraint


def test_grammar_from_first_token_is_honoured_as_the_engine_starts_there() -> None:
    params = vllm_convert.to_sampling_params(vpb.SamplingParams(regex="a+", grammar_from_first_token=True))
    assert params.constraint == Constraint(ConstraintKind.REGEX, "a+")


def test_engine_input_fields_become_this_contracts_paths() -> None:
    assert vllm_convert.proto_field("prompt_token_ids[3]") == "tokenized.input_ids[3]"
    assert vllm_convert.proto_field("prompt") == "text"
    assert vllm_convert.proto_field("stop_token_ids[1]") == "sampling_params.stop_token_ids[1]"
    assert vllm_convert.proto_field("request_id") == "request_id"
    assert vllm_convert.proto_field("constraint.json_schema") == "sampling_params.json_schema"
    assert vllm_convert.proto_field("constraint.choice[2]") == "sampling_params.choice.choices[2]"


# ---- responses -----------------------------------------------------------------


def _output(
    finished: bool,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: list[TokenLogprob] | None = None,
    abort_cause: AbortCause | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(
                index=0,
                text="Hello world",
                token_ids=[10, 11, 12],
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                logprobs=logprobs,
            )
        ],
        finished=finished,
        delta_text=" world",
        delta_token_ids=[11, 12],
        delta_logprobs=logprobs[1:] if logprobs else None,
        abort_cause=abort_cause,
    )


LOGPROBS = [
    TokenLogprob(10, -0.5, {10: -0.5, 4: -1.5}),
    TokenLogprob(11, -0.25, {11: -0.25, 5: -2.0}),
    TokenLogprob(12, -1.0, {8: -0.75, 12: -1.0}),
]


def test_a_chunk_carries_this_steps_token_ids_as_a_delta() -> None:
    response = vllm_convert.to_chunk(_output(finished=False))
    assert response == vpb.GenerateResponse(
        chunk=vpb.GenerateStreamChunk(token_ids=[11, 12], prompt_tokens=3, completion_tokens=2, cached_tokens=0)
    )


def test_a_chunk_carries_the_deltas_logprobs_with_their_alternatives() -> None:
    chunk = vllm_convert.to_chunk(_output(finished=False, logprobs=LOGPROBS)).chunk
    assert chunk.output_logprobs == vpb.OutputLogProbs(
        token_logprobs=[-0.25, -1.0],
        token_ids=[11, 12],
        top_logprobs=[
            vpb.TopLogProbs(values=[-0.25, -2.0], token_ids=[11, 5]),
            vpb.TopLogProbs(values=[-0.75, -1.0], token_ids=[8, 12]),
        ],
    )


def test_logprobs_zero_sends_no_alternatives() -> None:
    chosen_only = [TokenLogprob(11, -0.25, {}), TokenLogprob(12, -1.0, {})]
    assert vllm_convert.to_output_logprobs(chosen_only) == vpb.OutputLogProbs(
        token_logprobs=[-0.25, -1.0], token_ids=[11, 12]
    )


def test_complete_carries_every_token_id_and_the_matched_stop_string() -> None:
    response = vllm_convert.to_complete(_output(True, "stop", stop_reason="\n\n"), with_logprobs=False)
    assert response == vpb.GenerateResponse(
        complete=vpb.GenerateComplete(
            output_ids=[10, 11, 12],
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=3,
            cached_tokens=0,
            matched_stop_str="\n\n",
        )
    )


def test_complete_names_a_matched_stop_token_and_none_for_eos() -> None:
    by_token = vllm_convert.to_complete(_output(True, "stop", stop_reason=7), with_logprobs=False).complete
    assert by_token.WhichOneof("matched_stop") == "matched_token_id"
    assert by_token.matched_token_id == 7
    by_eos = vllm_convert.to_complete(_output(True, "stop"), with_logprobs=False).complete
    assert by_eos.WhichOneof("matched_stop") is None


def test_complete_of_an_unstreamed_call_carries_every_logprob() -> None:
    complete = vllm_convert.to_complete(_output(True, "length", logprobs=LOGPROBS), with_logprobs=True).complete
    assert list(complete.output_logprobs.token_ids) == [10, 11, 12]
    streamed = vllm_convert.to_complete(_output(True, "length", logprobs=LOGPROBS), with_logprobs=False).complete
    assert not streamed.HasField("output_logprobs")


def test_an_abort_the_gateway_asked_for_completes_with_finish_reason_abort() -> None:
    output = _output(True, "abort", abort_cause=AbortCause.ABORT_RPC)
    assert vllm_convert.to_complete(output, with_logprobs=False).complete.finish_reason == "abort"


def test_a_request_cut_by_shutdown_ends_with_unavailable_not_a_completion() -> None:
    with pytest.raises(
        EngineDeadError, match=r"the server shut down before request 'r1' finished .* after 3 generated"
    ):
        vllm_convert.to_complete(_output(True, "abort", abort_cause=AbortCause.SHUTDOWN), with_logprobs=False)


# ---- model, server, loads ----------------------------------------------------------

INFO = ModelInfo(
    model_name="SmolLM2",
    dtype="bfloat16",
    device="cpu",
    max_model_len=2048,
    block_size=16,
    num_blocks=100,
    vocab_size=49152,
    has_chat_template=True,
    eos_token_ids=(0, 2),
    max_prompt_bytes=1000,
    bos_token_id=1,
    kv_cache_dtype="float16",
)
STATUS = PoolStatus(
    pool_id="replica-0",
    epoch=3,
    num_blocks=100,
    block_size=16,
    num_free=75,
    num_allocated=25,
    num_running=2,
    num_waiting=1,
    last_seq=10,
    durable_seq=9,
)


def test_model_info_names_the_model_and_sends_the_gateway_to_get_tokenizer() -> None:
    assert vllm_convert.to_model_info(INFO) == vpb.GetModelInfoResponse(
        model_path="SmolLM2",
        tokenizer_path="nanoserve://SmolLM2",
        is_generation=True,
        max_context_length=2048,
        vocab_size=49152,
        served_model_name="SmolLM2",
        eos_token_ids=[0, 2],
        bos_token_id=1,
        # the pool (1,600 tokens) is shorter than max_model_len; one token is left to generate
        max_req_input_len=1599,
    )


def test_loads_come_from_the_pool_status() -> None:
    response = vllm_convert.to_loads(vpb.GetLoadsRequest(), STATUS, max_num_seqs=8, server_version="0.1.0")
    assert response.version == "0.1.0"
    assert response.dp_rank_count == 1
    assert list(response.loads) == [
        vpb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=2,
            num_waiting_reqs=1,
            num_total_reqs=3,
            num_used_tokens=400,
            max_total_num_tokens=1600,
            token_usage=0.25,
            max_running_requests=8,
        )
    ]


def test_loads_of_another_rank_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        vllm_convert.to_loads(vpb.GetLoadsRequest(dp_rank=1), STATUS, 8, "0.1.0")
    assert str(info.value) == "dp_rank: must be 0 or unset (a nanoserve server is one data-parallel rank), got 1"


def test_server_info_reports_the_engine() -> None:
    info = vllm_convert.to_server_info(INFO, STATUS, uptime_s=12.5, max_num_seqs=8)
    assert info == vpb.GetServerInfoResponse(
        active_requests=3,
        uptime_seconds=12.5,
        server_type="nanoserve",
        data_parallel_size=1,
        kv_cache_dtype="float16",  # the cache's, not the model's
        block_size=16,
        model_dtype="bfloat16",
        max_num_seqs=8,
    )


# ---- tokenizer bundle ----------------------------------------------------------------


def test_tokenizer_zip_is_the_same_bytes_for_the_same_files() -> None:
    files = {"tokenizer.json": b'{"a": 1}', "chat_template.jinja": b"{{ x }}"}
    bundle = vllm_convert.tokenizer_zip(files)
    assert bundle == vllm_convert.tokenizer_zip(dict(reversed(files.items())))
    with zipfile.ZipFile(io.BytesIO(bundle)) as archive:
        assert archive.namelist() == ["chat_template.jinja", "tokenizer.json"]
        assert archive.read("tokenizer.json") == b'{"a": 1}'


def test_tokenizer_chunks_split_the_zip_and_end_with_its_sha256() -> None:
    bundle = bytes(range(256)) * 600  # 153,600 bytes: two full chunks and a partial one
    chunks = list(vllm_convert.to_tokenizer_chunks(bundle))
    assert [len(chunk.data) for chunk in chunks] == [65536, 65536, 22528]
    assert b"".join(chunk.data for chunk in chunks) == bundle
    assert [chunk.sha256 for chunk in chunks] == ["", "", hashlib.sha256(bundle).hexdigest()]
    assert isinstance(chunks[0], cpb.GetTokenizerChunk)
