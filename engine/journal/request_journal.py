"""The engine's side of the request journal: records from requests, outputs from records.

``admit_record`` / ``output_record`` turn a request and each output it
releases into journal records (``nanoserve.engine.journal.records`` describes
the payloads); ``restore_request`` (``rebuild_requests`` for all of them) re-creates a request from its
history after a crash; ``history_outputs`` turns a history back into the ``RequestOutput``s
that ``Resume`` streams. Token index ``i`` is the i-th released output token of
the request (its ``outputs[0].token_ids[i]``), across every admission.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.core.request import Request
from nanoserve.engine.journal.records import JournalKind, OutputChunk, RequestHistory
from nanoserve.engine.journal.store import JournalRecord
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import Prompt, TokensPrompt

_log = structlog.get_logger(__name__)


def admit_record(request: Request) -> JournalRecord:
    """The ADMIT record of a request admitted now (its effective seed included)."""
    sampling = dataclasses.asdict(request.sampling_params)
    sampling["seed"] = request.seed
    constraint = request.sampling_params.constraint
    sampling["constraint"] = constraint.to_dict() if constraint is not None else None  # recovery recompiles it
    data = {
        "prompt_token_ids": request.prompt_token_ids,
        "prompt": request.prompt,
        "sampling": sampling,
        "max_tokens": request.max_tokens,
        "arrival_wall_ns": time.time_ns(),
        "deadline_wall_ns": request.deadline_wall_ns,
        "recovered_from": None,
        "num_prior_tokens": 0,
    }
    return JournalRecord(JournalKind.ADMIT, request.request_id, data)


def group_finish_record(output: RequestOutput) -> JournalRecord:
    """The FINISH record of a parallel-sampling request's final output: its ending, no tokens.

    The samples' tokens are not journaled (docs/parallel-sampling.md): the
    FINISH record closes the request for recovery and says how it ended, with
    ``sample_finish_reasons``: each returned sample's finish reason, by index
    (samples of one request may end differently: one on a stop, one at its length).
    """
    first = dataclasses.replace(output.outputs[0], text="", token_ids=[], logprobs=None)
    ending = dataclasses.replace(output, outputs=[first], delta_text="", delta_token_ids=[], delta_logprobs=None)
    record = output_record(ending)
    record.data["sample_finish_reasons"] = [sample.finish_reason for sample in output.outputs]
    return record


def output_record(output: RequestOutput) -> JournalRecord:
    """The OUTPUT record of one released delta, or the FINISH record of a final output."""
    data: dict[str, Any] = {
        "start": output.delta_start_index,
        "token_ids": output.delta_token_ids,
        "text": output.delta_text,
    }
    if output.delta_logprobs is not None:
        data["logprobs"] = [
            [entry.token_id, entry.logprob, [[k, v] for k, v in entry.top_logprobs.items()]]
            for entry in output.delta_logprobs
        ]
    if not output.finished:
        return JournalRecord(JournalKind.OUTPUT, output.request_id, data)
    metrics = output.metrics
    data.update(
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
        abort_cause=output.abort_cause.value if output.abort_cause is not None else None,
    )
    if metrics is not None:
        data.update(
            queue_s=_since(metrics.arrival_time, metrics.first_scheduled_time),
            ttft_s=metrics.ttft_s,
            total_s=_since(metrics.arrival_time, metrics.finished_time),
            num_preemptions=metrics.num_preemptions,
        )
    return JournalRecord(JournalKind.FINISH, output.request_id, data)


def restore_request(history: RequestHistory, request: Request, recovered_from: int) -> Request:
    """``request`` (made from the history's prompt and sampling) with its journaled outputs
    restored, marked recovered: a preempted request that recomputes prompt + outputs."""
    request.restore_outputs(history.token_ids, history.text, _logprobs(history.logprobs))
    request.deadline_wall_ns = history.admit.get("deadline_wall_ns")
    request.recovered_from = recovered_from
    request.metrics.num_preemptions += 1
    return request


def rebuild_requests(
    histories: list[RequestHistory],
    recovered_from: int,
    process: Callable[[str, Prompt, SamplingParams], Request],
) -> tuple[list[Request], list[JournalRecord]]:
    """The requests of ``histories`` (recovered from epoch ``recovered_from``), each made by ``process``
    (tokenize and validate, as for a new request) and restored (``restore_request``), in order; and the
    FINISH records (``not_recovered_record``) of those this engine cannot take back: the journal was
    written under another model or other limits (a smaller pool), so ``process`` refused them (logged one
    line each; the FINISH carries the refusal as its ``abort_detail``)."""
    requests: list[Request] = []
    unfit: list[JournalRecord] = []
    for history in histories:
        prompt = TokensPrompt(list(history.admit["prompt_token_ids"]))
        try:
            request = process(history.request_id, prompt, sampling_params(history))
            request.prompt = history.admit.get("prompt")
            restore_request(history, request, recovered_from)
        except Exception as exc:
            _log.warning("request_not_recovered", request_id=history.request_id, error=str(exc))
            unfit.append(not_recovered_record(history, f"this server cannot run it again: {exc}"))
            continue
        requests.append(request)
    return requests, unfit


def not_recovered_record(history: RequestHistory, detail: str) -> JournalRecord:
    """The FINISH of a recovered request this engine cannot run again (abort cause not_recovered);
    ``detail``, why in words, is its ``abort_detail``."""
    data = {
        "start": history.num_tokens,
        "token_ids": [],
        "text": "",
        "finish_reason": "abort",
        "stop_reason": None,
        "abort_cause": AbortCause.NOT_RECOVERED.value,
        "abort_detail": detail,
    }
    return JournalRecord(JournalKind.FINISH, history.request_id, data)


def sampling_params(history: RequestHistory) -> SamplingParams:
    """The request's sampling parameters as journaled (its effective seed included)."""
    sampling = dict(history.admit["sampling"])
    if sampling.get("logit_bias"):  # JSON's keys are strings
        sampling["logit_bias"] = {int(token_id): bias for token_id, bias in sampling["logit_bias"].items()}
    return SamplingParams(**sampling)


def history_outputs(
    history: RequestHistory, after_token_index: int, min_tokens_per_output: int = 1
) -> Iterator[RequestOutput]:
    """One output per run of journaled chunks holding at least ``min_tokens_per_output`` tokens at
    ``after_token_index`` or later (the first chunk cut to start there, with its text only when none
    of its tokens is cut), then the final output when the request has ended. Every output but the
    final one is a delta (``is_delta``); the final one carries the whole completion."""
    token_ids: list[int] = []
    text = ""
    logprobs: list[TokenLogprob] | None = [] if history.logprobs is not None else None
    run: list[tuple[OutputChunk, list[TokenLogprob] | None]] = []  # cut chunks not yet in an output
    num_run_tokens = 0
    for chunk in history.chunks:
        chunk_logprobs = _logprobs(chunk.logprobs)
        token_ids += chunk.token_ids
        text += chunk.text
        if logprobs is not None and chunk_logprobs is not None:
            logprobs += chunk_logprobs
        if chunk.end <= after_token_index:
            continue
        run.append(_cut(chunk, chunk_logprobs, after_token_index))
        num_run_tokens += len(run[-1][0].token_ids)
        if num_run_tokens >= min_tokens_per_output:
            yield _output(history, token_ids, text, logprobs, _join(run), None)
            run, num_run_tokens = [], 0
    if run:
        yield _output(history, token_ids, text, logprobs, _join(run), None)
    if history.finish is not None:
        empty = OutputChunk(max(history.num_tokens, after_token_index), [], "")
        yield _output(history, token_ids, text, logprobs, (empty, None), history.finish)


def ended_output(history: RequestHistory | None, request_id: str) -> RequestOutput:
    """The final output of a request that is journaled as unfinished but runs nowhere (its epoch
    was not recovered): finish_reason abort, cause not_recovered."""
    finish = {"finish_reason": "abort", "abort_cause": AbortCause.NOT_RECOVERED.value}
    if history is None:
        metrics = RequestMetrics(arrival_time=0.0)
        return RequestOutput(request_id, [], [CompletionOutput(0, "", [], "abort")], True, metrics=metrics)
    return _output(
        history, history.token_ids, history.text, None, (OutputChunk(history.num_tokens, [], ""), None), finish
    )


def slice_output(output: RequestOutput, after_token_index: int, text: str = "") -> RequestOutput:
    """``output`` with the part of its delta before ``after_token_index`` removed, its text then
    ``text`` (the text of none of the cut tokens); ``output`` itself when nothing is cut."""
    start = output.delta_start_index
    if after_token_index <= start:
        return output
    cut = after_token_index - start
    token_ids = output.delta_token_ids[cut:]
    logprobs = output.delta_logprobs[cut:] if output.delta_logprobs is not None else None
    outputs = output.outputs
    if output.is_delta:  # outputs[0] is the delta: it is cut too
        outputs = [dataclasses.replace(outputs[0], text=text, token_ids=token_ids, logprobs=logprobs)]
    return dataclasses.replace(
        output,
        outputs=outputs,
        delta_token_ids=token_ids,
        delta_text=text,
        delta_logprobs=logprobs,
        delta_start=after_token_index if output.is_delta else 0,
    )


def _cut(
    chunk: OutputChunk, logprobs: list[TokenLogprob] | None, after_token_index: int
) -> tuple[OutputChunk, list[TokenLogprob] | None]:
    if after_token_index <= chunk.start:
        return chunk, logprobs
    cut = after_token_index - chunk.start
    return (
        OutputChunk(after_token_index, chunk.token_ids[cut:], ""),
        logprobs[cut:] if logprobs is not None else None,
    )


def _join(run: list[tuple[OutputChunk, list[TokenLogprob] | None]]) -> tuple[OutputChunk, list[TokenLogprob] | None]:
    """Consecutive cut chunks as one (logprobs only when every chunk has them)."""
    if len(run) == 1:
        return run[0]
    first = run[0][0]
    token_ids = [token_id for chunk, _ in run for token_id in chunk.token_ids]
    logprobs = None if any(lp is None for _, lp in run) else [entry for _, lp in run for entry in lp or []]
    return OutputChunk(first.start, token_ids, "".join(chunk.text for chunk, _ in run)), logprobs


def _output(
    history: RequestHistory,
    token_ids: list[int],
    text: str,
    logprobs: list[TokenLogprob] | None,
    delta: tuple[OutputChunk, list[TokenLogprob] | None],
    finish: dict[str, Any] | None,
) -> RequestOutput:
    chunk, delta_logprobs = delta
    if finish is None:  # a delta: the chunk alone
        completion = CompletionOutput(0, chunk.text, chunk.token_ids, logprobs=delta_logprobs)
    else:
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            finish_reason=finish.get("finish_reason"),
            stop_reason=finish.get("stop_reason"),
            logprobs=list(logprobs) if logprobs is not None else None,
        )
    cause = finish.get("abort_cause") if finish else None
    return RequestOutput(
        request_id=history.request_id,
        prompt_token_ids=history.admit["prompt_token_ids"],
        outputs=[completion],
        finished=finish is not None,
        delta_text=chunk.text,
        delta_token_ids=chunk.token_ids,
        delta_logprobs=delta_logprobs,
        metrics=_metrics(finish),
        prompt=history.admit.get("prompt"),
        abort_cause=AbortCause(cause) if cause is not None else None,
        abort_detail=finish.get("abort_detail") if finish else None,
        is_delta=finish is None,
        delta_start=chunk.start if finish is None else 0,
    )


def _metrics(finish: dict[str, Any] | None) -> RequestMetrics:
    """Timings as journaled, on a clock that starts at the request's arrival (0.0)."""
    if finish is None:
        return RequestMetrics(arrival_time=0.0)
    return RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=finish.get("queue_s"),
        first_token_time=finish.get("ttft_s"),
        finished_time=finish.get("total_s"),
        num_preemptions=finish.get("num_preemptions", 0),
    )


def _logprobs(entries: list[Any] | None) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    return [TokenLogprob(token_id, logprob, dict(top)) for token_id, logprob, top in entries]


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start
