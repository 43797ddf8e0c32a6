"""Protobuf <-> engine types for the nanoserve.v1 Generation contract.

The engine never sees protobuf: requests become ``str`` / ``TokensPrompt`` /
``ChatPrompt`` and ``SamplingParams`` here, and ``RequestOutput`` and model info
become messages here. The Allocation contract (pool status, events, audits) converts in
``allocation_convert``, the vLLM contract in ``vllm_convert``: these three are the only
modules that know both protobuf and engine or allocator types.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from google.protobuf.duration_pb2 import Duration

from nanoserve.engine.core.outputs import AbortCause, RequestMetrics
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.constraint import Constraint, ConstraintKind
from nanoserve.engine.text.prompts import ChatPrompt, TokensPrompt
from nanoserve.service.grpc.metrics import FinishedRequest
from nanoserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:  # the engine proper imports torch; these are only types here
    from nanoserve.engine import ModelInfo, RequestOutput
    from nanoserve.engine.core.outputs import TokenLogprob

# One table per enum of the contract: the engine's names <-> proto values. An UNSPECIFIED (0)
# value is never in a table: on the way out it stands for a name this table lacks.
FINISH_REASONS: dict[str, pb.FinishReason] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
ABORT_CAUSES: dict[AbortCause, pb.AbortCause] = {
    AbortCause.ABORT_RPC: pb.ABORT_CAUSE_ABORT_RPC,
    AbortCause.CANCELLED: pb.ABORT_CAUSE_CANCELLED,
    AbortCause.DEADLINE: pb.ABORT_CAUSE_DEADLINE,
    AbortCause.SHUTDOWN: pb.ABORT_CAUSE_SHUTDOWN,
    AbortCause.ENGINE_ERROR: pb.ABORT_CAUSE_ENGINE_ERROR,
    AbortCause.NOT_RECOVERED: pb.ABORT_CAUSE_NOT_RECOVERED,
    AbortCause.CALLER: pb.ABORT_CAUSE_CALLER,
    AbortCause.SLOW_CONSUMER: pb.ABORT_CAUSE_SLOW_CONSUMER,
    AbortCause.GRAMMAR: pb.ABORT_CAUSE_GRAMMAR,
}
# proto role -> the engine's chat template role
CHAT_ROLES: dict[pb.ChatRole, str] = {
    pb.CHAT_ROLE_SYSTEM: "system",
    pb.CHAT_ROLE_USER: "user",
    pb.CHAT_ROLE_ASSISTANT: "assistant",
}
# SamplingParameters fields with presence (`optional`): unset leaves the engine's default
# the optional scalars, taken as the engine's keywords of the same name (the constraint oneof's members are not)
OPTIONAL_SAMPLING_FIELDS = tuple(
    f.name
    for f in pb.SamplingParameters.DESCRIPTOR.fields
    if f.has_presence and (f.containing_oneof is None or f.containing_oneof.name != "constraint")
)


# engine input names -> their protobuf paths in GenerateRequest / TokenizeRequest
_INPUT_PATHS = {"messages": "chat.messages", "prompt_token_ids": "prompt_token_ids.ids"}


def proto_field(engine_field: str) -> str:
    """The request's protobuf field path of a field the engine names in an
    ``InvalidRequestError``: ``max_tokens`` -> ``sampling.max_tokens``,
    ``stop[1]`` -> ``sampling.stop[1]``, ``messages[0].role`` ->
    ``chat.messages[0].role``, ``prompt_token_ids[3]`` -> ``prompt_token_ids.ids[3]``;
    ``constraint.json_schema`` -> ``sampling.json_schema`` (the oneof's member),
    ``constraint.choice[2]`` -> ``sampling.choice.choices[2]``;
    other names (``prompt``, ``request_id``, ``input``) are already paths."""
    name, bracket, rest = engine_field.partition("[")
    tail = bracket + rest
    name = constraint_member(name)
    if name.partition(".")[0] in pb.SamplingParameters.DESCRIPTOR.fields_by_name:
        return f"sampling.{name}{tail}"
    if name in _INPUT_PATHS:
        return _INPUT_PATHS[name] + tail
    return engine_field


def input_kind(request: pb.GenerateRequest | pb.TokenizeRequest) -> str:
    """The member of the ``input`` oneof that is set; InvalidRequestError("input") when none is.

    With ``to_messages``' role check, the one check the service makes itself:
    the shape of the message. Everything about its content is the engine's.
    """
    kind: str | None = request.WhichOneof("input")
    if kind is None:
        *others, last = (field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise InvalidRequestError("input", f"give exactly one of {', '.join(others)} or {last}; none was set")
    return kind


def to_messages(chat: pb.ChatMessages) -> list[dict[str, str]]:
    """The engine's chat messages; InvalidRequestError naming the message whose role is UNSPECIFIED or a
    value this server does not know (the engine checks the rest: at least one message, the lengths)."""
    return [{"role": _chat_role(index, m.role), "content": m.content} for index, m in enumerate(chat.messages)]


def _chat_role(index: int, role: pb.ChatRole) -> str:
    name = CHAT_ROLES.get(role)
    if name is not None:
        return name
    known = ", ".join(pb.ChatRole.Name(known_role) for known_role in CHAT_ROLES)
    if role == pb.CHAT_ROLE_UNSPECIFIED:
        given = "CHAT_ROLE_UNSPECIFIED (unset)"
    else:  # a value from a newer contract, or a number sent as is
        given = f"{role} (not a role this server knows)"
    raise InvalidRequestError(f"chat.messages[{index}].role", f"must be one of {known}, got {given}")


def to_duration(seconds: float) -> Duration:
    """A ``google.protobuf.Duration`` of ``seconds``, to the nearest nanosecond."""
    duration = Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def to_timings(request: FinishedRequest) -> pb.Timings:
    """The request's durations; one it never reached (None) stays unset."""
    timings = pb.Timings()
    for field, seconds in (("queue_time", request.queue_s), ("ttft", request.ttft_s), ("total_time", request.total_s)):
        if seconds is not None:
            getattr(timings, field).CopyFrom(to_duration(seconds))
    return timings


def to_prompt(request: pb.GenerateRequest) -> str | TokensPrompt | ChatPrompt:
    """The engine prompt of a request; InvalidRequestError("input") when no input is set."""
    kind = input_kind(request)
    if kind == "prompt":
        return request.prompt
    if kind == "prompt_token_ids":
        return TokensPrompt(prompt_token_ids=list(request.prompt_token_ids.ids))
    assert kind == "chat", f"unknown input {kind!r}"
    return ChatPrompt(messages=to_messages(request.chat))


def to_tokenize_input(request: pb.TokenizeRequest) -> str | ChatPrompt:
    """What a TokenizeRequest asks to tokenize; InvalidRequestError("input") when nothing is set."""
    if input_kind(request) == "text":
        return request.text
    return ChatPrompt(messages=to_messages(request.chat))


def to_sampling_params(params: pb.SamplingParameters, cache_salt: str = "") -> SamplingParams:
    """The engine's SamplingParams, with the request's ``cache_salt`` ("" is none).

    Raises InvalidRequestError("top_k") for a negative top_k; the engine checks the rest.
    """
    kwargs: dict[str, Any] = {name: getattr(params, name) for name in OPTIONAL_SAMPLING_FIELDS if params.HasField(name)}
    if cache_salt:
        kwargs["cache_salt"] = cache_salt
    if "top_k" in kwargs:
        # this contract's 0 is the engine's None (off); the message says what this contract accepts
        if kwargs["top_k"] < 0:
            raise InvalidRequestError("top_k", f"must be 0 (off) or an integer >= 1, got {kwargs['top_k']}")
        if kwargs["top_k"] == 0:
            del kwargs["top_k"]
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    kwargs.update(stop_and_length_fields(params))
    kwargs["constraint"] = to_constraint(params)
    return SamplingParams(**kwargs)


def constraint_member(name: str) -> str:
    """An engine field inside the constraint (``constraint.<kind>...``) as the member of a sampling
    message's ``constraint`` oneof: the kind is the member's name (both contracts), a choice's index
    is into its ``choices``. Other names come back unchanged."""
    if not name.startswith("constraint."):
        return name
    member = name.removeprefix("constraint.")
    return "choice.choices" if member == "choice" else member


def to_constraint(params: Any) -> Constraint | None:
    """The ``constraint`` oneof of a sampling message as the engine's Constraint (None: unset).

    nanoserve.v1's ``SamplingParameters`` and vLLM's ``SamplingParams`` spell it alike:
    json_schema, regex, grammar and structural_tag are strings, json_object a bool
    (which must be true when set), choice a message of ``choices``. A oneof holds one
    member at most, so two constraints cannot arrive together. Raises
    InvalidRequestError naming ``constraint.<kind>`` (Constraint checks the shape).
    """
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not params.json_object:
            raise InvalidRequestError("constraint.json_object", "must be true when set (unset it for no constraint)")
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(params.choice.choices))
    return Constraint(ConstraintKind(kind), getattr(params, kind))


def stop_and_length_fields(params: Any) -> dict[str, Any]:
    """``min_tokens``, ``stop``, ``stop_token_ids`` and ``ignore_eos`` of a sampling message, the set ones
    only, as SamplingParams keywords (nanoserve.v1's and vLLM's messages spell them alike)."""
    fields: dict[str, Any] = {}
    if params.min_tokens:
        fields["min_tokens"] = params.min_tokens
    if params.stop:
        fields["stop"] = list(params.stop)
    if params.stop_token_ids:
        fields["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        fields["ignore_eos"] = True
    return fields


def to_token_logprob(logprob: TokenLogprob) -> pb.TokenLogprob:
    """One generated token's logprob and its top alternatives (most likely first)."""
    message = pb.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob)
    message.top.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top_logprobs.items())
    return message


def finished_request(output: RequestOutput) -> FinishedRequest:
    """Counts, timings (seconds) and abort cause of a request's final output, for the metrics and the log."""
    completion = output.outputs[0]
    m = output.metrics or RequestMetrics(arrival_time=0.0)
    return FinishedRequest(
        request_id=output.request_id,
        finish_reason=completion.finish_reason or "abort",
        abort_cause=output.abort_cause.value if output.abort_cause is not None else None,
        num_prompt_tokens=len(output.prompt_token_ids),
        num_completion_tokens=sum(len(sample.token_ids) for sample in output.outputs),  # every sample's
        queue_s=_elapsed(m.arrival_time, m.first_scheduled_time),
        ttft_s=_elapsed(m.arrival_time, m.first_token_time),
        total_s=_elapsed(m.arrival_time, m.finished_time),
        num_preemptions=m.num_preemptions,
        num_cached_tokens=m.num_cached_tokens,
    )


def _elapsed(start_s: float | None, end_s: float | None) -> float | None:
    return None if start_s is None or end_s is None else end_s - start_s


def to_finish(output: RequestOutput) -> pb.Finish:
    completion = output.outputs[0]
    summary = finished_request(output)
    finish = pb.Finish(
        reason=FINISH_REASONS[summary.finish_reason],
        usage=pb.Usage(
            prompt_tokens=summary.num_prompt_tokens,
            completion_tokens=summary.num_completion_tokens,
            cached_tokens=summary.num_cached_tokens,
        ),
        timings=to_timings(summary),
        num_preemptions=summary.num_preemptions,
    )
    if output.abort_cause is not None:
        finish.abort_cause = ABORT_CAUSES[output.abort_cause]
    if isinstance(completion.stop_reason, str):
        finish.stop_string = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        finish.stop_token_id = completion.stop_reason
    return finish


def to_response(output: RequestOutput) -> pb.GenerateResponse:
    """One streamed message: the delta since the previous output, and ``finish`` on the last (of a sample)."""
    completion = output.outputs[0]
    response = pb.GenerateResponse(
        request_id=output.request_id, text=output.delta_text, token_ids=output.delta_token_ids, index=completion.index
    )
    if output.delta_logprobs:
        response.logprobs.extend(to_token_logprob(logprob) for logprob in output.delta_logprobs)
    if output.prompt_logprobs:
        response.prompt_logprobs.extend(to_token_logprob(logprob) for logprob in output.prompt_logprobs)
    if output.finished or completion.finish_reason is not None:
        response.finish.CopyFrom(to_finish(output))
    return response


def to_responses(output: RequestOutput) -> list[pb.GenerateResponse]:
    """The messages of one output: ``to_response``'s, except for a parallel-sampling request's final
    output: nothing when its samples streamed their endings already, else (best_of > n) one whole
    message per returned sample."""
    if not output.finished or output.samples_streamed is None:
        return [to_response(output)]
    if output.samples_streamed:
        return []
    return [
        to_response(
            dataclasses.replace(
                output,
                outputs=[completion],
                delta_text=completion.text,
                delta_token_ids=completion.token_ids,
                delta_logprobs=completion.logprobs,
            )
        )
        for completion in output.outputs
    ]


def to_resume_response(output: RequestOutput) -> pb.ResumeResponse:
    """One message of a resumed stream: the same fields as ``to_response``."""
    response = pb.ResumeResponse()
    response.ParseFromString(to_response(output).SerializeToString())  # the same field numbers and types
    return response


def to_model_info(info: ModelInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model_name=info.model_name,
        dtype=info.dtype,
        device=info.device,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        vocab_size=info.vocab_size,
        has_chat_template=info.has_chat_template,
        eos_token_ids=info.eos_token_ids,
        kv_cache_dtype=info.kv_cache_dtype,
    )
