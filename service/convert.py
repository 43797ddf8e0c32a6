"""Protobuf <-> engine and allocator types. The only module that knows both sides.

The engine never sees protobuf: requests become ``str`` / ``TokensPrompt`` /
``ChatPrompt`` and ``SamplingParams`` here, and ``RequestOutput``, pool status,
allocation events and audit reports become messages here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanoserve.engine.outputs import RequestMetrics
from nanoserve.engine.prompts import ChatPrompt, TokensPrompt
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.service.metrics import FinishedRequest
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:  # the engine proper imports torch; these are only types here
    from nanoserve.allocator.audit import AuditReport
    from nanoserve.allocator.events import Event
    from nanoserve.engine import AsyncLLMEngine, PoolStatus, RequestOutput
    from nanoserve.engine.outputs import TokenLogprob

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}

# SamplingParameters fields with presence (optional): unset leaves the engine's default
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
)


def proto_field(engine_field: str) -> str:
    """The GenerateRequest field path of a field the engine names in an
    ``InvalidRequestError`` (``max_tokens`` -> ``sampling.max_tokens``);
    paths the service already gave, and unknown names, are returned as they are."""
    if engine_field in pb.SamplingParameters.DESCRIPTOR.fields_by_name:
        return f"sampling.{engine_field}"
    if engine_field == "messages":
        return "chat.messages"
    return engine_field


def to_messages(chat: pb.ChatMessages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def to_prompt(request: pb.GenerateRequest) -> str | TokensPrompt | ChatPrompt:
    """The engine prompt of a validated request (exactly one input set)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "prompt_token_ids":
        return TokensPrompt(prompt_token_ids=list(request.prompt_token_ids.ids))
    assert kind == "chat", f"validate_input lets only known inputs through, got {kind!r}"
    return ChatPrompt(messages=to_messages(request.chat))


def to_sampling_params(params: pb.SamplingParameters) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(params, name) for name in OPTIONAL_SAMPLING_FIELDS if params.HasField(name)}
    if kwargs.get("top_k") == 0:
        del kwargs["top_k"]  # 0 = off, the engine's None
    if params.min_tokens:
        kwargs["min_tokens"] = params.min_tokens
    if params.stop:
        kwargs["stop"] = list(params.stop)
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        kwargs["ignore_eos"] = True
    return SamplingParams(**kwargs)


def to_token_logprob(logprob: TokenLogprob) -> pb.TokenLogprob:
    """One generated token's logprob and its top alternatives (most likely first)."""
    message = pb.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob)
    message.top.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top_logprobs.items())
    return message


def finished_request(output: RequestOutput) -> FinishedRequest:
    """Counts and timings (seconds) of a finished request, for the metrics and the log."""
    completion = output.outputs[0]
    m = output.metrics or RequestMetrics(arrival_time=0.0)
    return FinishedRequest(
        request_id=output.request_id,
        finish_reason=completion.finish_reason or "abort",
        num_prompt_tokens=len(output.prompt_token_ids),
        num_completion_tokens=len(completion.token_ids),
        queue_s=_elapsed(m.arrival_time, m.first_scheduled_time),
        ttft_s=_elapsed(m.arrival_time, m.first_token_time),
        total_s=_elapsed(m.arrival_time, m.finished_time),
        num_preemptions=m.num_preemptions,
    )


def _elapsed(start_s: float | None, end_s: float | None) -> float | None:
    return None if start_s is None or end_s is None else end_s - start_s


def to_finish(output: RequestOutput) -> pb.Finish:
    completion = output.outputs[0]
    summary = finished_request(output)
    finish = pb.Finish(
        reason=FINISH_REASONS[summary.finish_reason],
        usage=pb.Usage(prompt_tokens=summary.num_prompt_tokens, completion_tokens=summary.num_completion_tokens),
        timings=pb.Timings(
            queue_s=summary.queue_s or 0.0, ttft_s=summary.ttft_s or 0.0, total_s=summary.total_s or 0.0
        ),
        num_preemptions=summary.num_preemptions,
    )
    if isinstance(completion.stop_reason, str):
        finish.stop_string = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        finish.stop_token_id = completion.stop_reason
    return finish


def to_response(output: RequestOutput) -> pb.GenerateResponse:
    """One streamed message: the delta since the previous output, and ``finish`` on the last."""
    response = pb.GenerateResponse(
        request_id=output.request_id, text=output.delta_text, token_ids=output.delta_token_ids
    )
    if output.delta_logprobs:
        response.logprobs.extend(to_token_logprob(logprob) for logprob in output.delta_logprobs)
    if output.finished:
        response.finish.CopyFrom(to_finish(output))
    return response


def to_model_info(engine: AsyncLLMEngine) -> pb.ModelInfo:
    core = engine.engine
    return pb.ModelInfo(
        model_name=core.model_name,
        dtype=str(core.runner.dtype).removeprefix("torch."),
        device=str(core.runner.device),
        max_model_len=core.max_model_len,
        block_size=core.block_size,
        num_blocks=core.num_blocks,
        vocab_size=core.vocab_size,
        has_chat_template=core.tokenizer.has_chat_template,
    )


def to_pool_status(status: PoolStatus) -> apb.PoolStatus:
    return apb.PoolStatus(
        pool_id=status.pool_id,
        epoch=status.epoch or 0,
        num_blocks=status.num_blocks,
        block_size=status.block_size,
        num_free=status.num_free,
        num_allocated=status.num_allocated,
        num_running=status.num_running,
        num_waiting=status.num_waiting,
        last_seq=status.last_seq or 0,
        durable_seq=status.durable_seq or 0,
    )


def to_event(event: Event) -> apb.AllocationEvent:
    message = apb.AllocationEvent(
        seq=event.seq,
        pool_id=event.pool_id,
        epoch=event.epoch,
        kind=event.kind,
        block_ids=event.block_ids,
        owner=event.owner or "",
        reason=event.reason or "",
        wall_time_s=event.wall_time_ns / 1e9,
        mono_time_s=event.monotonic_ns / 1e9,
        hash=event.hash.hex(),
    )
    if event.step is not None:
        message.step = event.step
    return message


def to_audit_report(report: AuditReport, live: bool = False) -> apb.AuditReport:
    """``live``: the epoch is the serving process's own, so open means running."""
    open_status = "open (live: this server's epoch)" if live else "open (running, or crashed)"
    message = apb.AuditReport(
        pool_id=report.pool_id,
        epoch=report.epoch,
        clean=report.clean,
        closed=report.closed,
        num_events=report.num_events,
        last_seq=report.last_seq,
        summary=report.render(open_status=open_status),
    )
    for violation in report.violations:
        entry = apb.Violation(
            seq=violation.seq, rule=violation.rule, owner=violation.owner or "", message=violation.message
        )
        if violation.block_id is not None:
            entry.block_id = violation.block_id
        if violation.plot_range is not None:
            entry.plot_from_seq, entry.plot_to_seq = violation.plot_range
        message.violations.append(entry)
    held = report.leaked if report.closed else report.state.owners
    message.held_blocks.extend(apb.BlockOwner(block_id=b, owner=o or "") for b, o in sorted(held.items()))
    return message
