"""vLLM's engine contract (``vllm.grpc.engine``, from ``smg-grpc-proto``) <-> engine types.

The second contract a nanoserve server speaks, the one the Shepherd Model
Gateway (``smg``) drives a vLLM worker with. The gateway tokenizes, applies the
chat template and detokenizes itself: a request carries token ids (or a text),
a response carries token ids only. The engine never sees these messages.

How each ``SamplingParams`` field is taken (proto3 scalars cannot say "unset":
a 0 where 0 is outside the engine's range means the engine's neutral value):

==============================  =====================================================
field                           nanoserve
==============================  =====================================================
temperature (optional)          unset: 1.0; 0 (or < 1e-5): greedy
top_p, repetition_penalty       0: unset (1.0)
top_k, min_p, penalties         0: off
max_tokens (optional)           unset: up to max_model_len (vLLM's meaning; our own
                                API's default is 16)
min_tokens, stop,               as the engine takes them
stop_token_ids, ignore_eos,
seed (optional)
logprobs (optional)             0..20 (-1, "the whole vocabulary", is refused)
n                               0 or 1: one sample; up to --max-parallel-samples:
                                that many, each chunk and completion with its index
skip_special_tokens,            accepted: they shape the text, which this contract
spaces_between_special_tokens,  does not carry (the gateway detokenizes with them);
include_stop_str_in_output      the tokens of a matched stop string are always sent
logit_bias                      token id -> [-100, 100], at most 300, ids in the vocabulary
truncate_prompt_tokens          -1 or >= 1: keep the prompt's last tokens
prompt_logprobs (optional)      0..20: ``input_logprobs`` on the first chunk (stream) or
                                the complete (not streamed); not with n > 1
constraint (oneof)              the engine's Constraint (``convert.to_constraint``):
                                json_schema, regex, grammar (Lark or GBNF), choice,
                                json_object (true), structural_tag; not with n > 1
grammar_from_first_token        accepted: with no reasoning parser every constraint
                                starts at the first generated token already
==============================  =====================================================

A request's multimodal inputs, KV-transfer parameters and a data-parallel rank
other than 0 are refused the same way. ``cached_tokens`` is the prompt tokens
the prefix cache served at the request's first admission (0 with caching off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import zipfile
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.errors import EngineDeadError, InvalidRequestError
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import TokensPrompt
from nanoserve.service.grpc import convert

if TYPE_CHECKING:  # the engine proper imports torch; these are only types here
    from nanoserve.engine import ModelInfo, PoolStatus, RequestOutput
    from nanoserve.engine.core.outputs import TokenLogprob

# The gateway's own limit on one tokenizer chunk is far above this; 64 KiB keeps every message small.
TOKENIZER_CHUNK_BYTES = 64 * 1024
# GetModelInfo's tokenizer_path: neither a path nor a hub id, so that the gateway asks GetTokenizer
TOKENIZER_SOURCE_SCHEME = "nanoserve://"
# every file of an exported tokenizer gets this timestamp, so the same tokenizer is the same zip (and sha256)
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)

# SamplingParams fields whose 0 is the engine's neutral value, not a setting
_ZERO_IS_UNSET = ("top_p", "repetition_penalty")
_PASSED_THROUGH = ("top_k", "min_p", "frequency_penalty", "presence_penalty")
# optional SamplingParams fields the engine has no use for: set at all, they are refused
_UNSUPPORTED_SAMPLING: dict[str, str] = {}
_UNSUPPORTED_REQUEST = {
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported",
    "mm_inputs": "the model takes text only",
    "media_refs": "the model takes text only",
}

# engine input names -> their protobuf paths in a VllmEngine GenerateRequest
_INPUT_PATHS = {"prompt": "text", "prompt_token_ids": "tokenized.input_ids"}


def proto_field(engine_field: str) -> str:
    """The GenerateRequest path of a field the engine names in an ``InvalidRequestError``:
    ``max_tokens`` -> ``sampling_params.max_tokens``, ``stop[1]`` -> ``sampling_params.stop[1]``,
    ``prompt_token_ids[3]`` -> ``tokenized.input_ids[3]``, ``prompt`` -> ``text``; other names
    (``request_id``, ``input``, paths already) are kept."""
    name, bracket, rest = engine_field.partition("[")
    tail = bracket + rest
    name = convert.constraint_member(name)
    if name.partition(".")[0] in vpb.SamplingParams.DESCRIPTOR.fields_by_name:
        return f"sampling_params.{name}{tail}"
    if name in _INPUT_PATHS:
        return _INPUT_PATHS[name] + tail
    return engine_field


def to_prompt(request: vpb.GenerateRequest) -> str | TokensPrompt:
    """The engine prompt: the gateway's token ids, or a text the engine tokenizes.

    Raises InvalidRequestError naming the field: no input, or an input this
    server cannot take (media, KV transfer, a data-parallel rank other than 0).
    """
    for name, reason in _UNSUPPORTED_REQUEST.items():
        if request.HasField(name):
            raise InvalidRequestError(name, f"not supported: {reason}")
    if request.extra_mm_inputs:
        raise InvalidRequestError("extra_mm_inputs", "not supported: the model takes text only")
    if request.HasField("data_parallel_rank"):
        _check_dp_rank("data_parallel_rank", request.data_parallel_rank)
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        return TokensPrompt(prompt_token_ids=list(request.tokenized.input_ids))
    if kind == "text":
        return request.text
    raise InvalidRequestError("input", "give tokenized or text; none was set")


def _check_dp_rank(field: str, rank: int) -> None:
    if rank != 0:
        raise InvalidRequestError(
            field, f"must be 0 or unset (a nanoserve server is one data-parallel rank), got {rank}"
        )


def to_sampling_params(params: vpb.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams (see the module docstring for each field).

    Raises InvalidRequestError naming the ``sampling_params`` field that asks
    for something nanoserve does not do; the engine checks every value's range.
    """
    _refuse_unsupported(params)
    kwargs: dict[str, Any] = {name: getattr(params, name) for name in _PASSED_THROUGH if getattr(params, name)}
    kwargs.update({name: getattr(params, name) for name in _ZERO_IS_UNSET if getattr(params, name) != 0.0})
    if kwargs.get("top_k") is not None:
        kwargs["top_k"] = int(kwargs["top_k"])
    if params.n > 1:
        kwargs["n"] = params.n
    kwargs["max_tokens"] = params.max_tokens if params.HasField("max_tokens") else None
    if params.logit_bias:
        kwargs["logit_bias"] = dict(params.logit_bias)
    for name in ("temperature", "seed", "logprobs", "truncate_prompt_tokens", "prompt_logprobs"):
        if params.HasField(name):
            kwargs[name] = getattr(params, name)
    kwargs.update(convert.stop_and_length_fields(params))
    # grammar_from_first_token: this engine runs no reasoning parser, so every constraint starts at the
    # first generated token already, as the field asks
    kwargs["constraint"] = convert.to_constraint(params)
    return SamplingParams(**kwargs)


def _refuse_unsupported(params: vpb.SamplingParams) -> None:
    for name, reason in _UNSUPPORTED_SAMPLING.items():
        if params.HasField(name):
            raise InvalidRequestError(name, f"not supported: {reason}")


def to_output_logprobs(logprobs: list[TokenLogprob]) -> vpb.OutputLogProbs:
    """Each token's logprob; the top alternatives per position (most likely first) where asked for."""
    message = vpb.OutputLogProbs(
        token_logprobs=[logprob.logprob for logprob in logprobs],
        token_ids=[logprob.token_id for logprob in logprobs],
    )
    if any(logprob.top_logprobs for logprob in logprobs):
        message.top_logprobs.extend(
            vpb.TopLogProbs(values=list(lp.top_logprobs.values()), token_ids=list(lp.top_logprobs)) for lp in logprobs
        )
    return message


def _cached_tokens(output: RequestOutput) -> int:
    return output.metrics.num_cached_tokens if output.metrics is not None else 0


def to_messages(output: RequestOutput, stream: bool) -> list[vpb.GenerateResponse]:
    """The messages of one output: a chunk of its delta (``stream`` only), then the completion of a
    request, or of one sample (n > 1), that ended. A parallel-sampling request's final output adds
    nothing when its samples ended in their own messages; else (best_of > n) each sample's chunk and
    completion come at the end."""
    completion = output.outputs[0]
    if output.finished and output.samples_streamed is not None:
        if output.samples_streamed:
            return []
        samples = [
            dataclasses.replace(
                output, outputs=[sample], delta_token_ids=sample.token_ids, delta_logprobs=sample.logprobs
            )
            for sample in output.outputs
        ]
        return [message for sample in samples for message in _sample_messages(sample, stream, ended=True)]
    return _sample_messages(output, stream, ended=output.finished or completion.finish_reason is not None)


def _sample_messages(output: RequestOutput, stream: bool, ended: bool) -> list[vpb.GenerateResponse]:
    messages = [to_chunk(output)] if stream and output.delta_token_ids else []
    if ended:
        messages.append(to_complete(output, with_logprobs=not stream))
    return messages


def to_chunk(output: RequestOutput) -> vpb.GenerateResponse:
    """One streamed message: this step's token ids (a delta, as vLLM's contract has it) and their logprobs."""
    chunk = vpb.GenerateStreamChunk(
        token_ids=output.delta_token_ids,
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(output.delta_token_ids),
        cached_tokens=_cached_tokens(output),
        index=output.outputs[0].index,
    )
    if output.delta_logprobs:
        chunk.output_logprobs.CopyFrom(to_output_logprobs(output.delta_logprobs))
    if output.prompt_logprobs is not None:  # the first output's and the final's: the servicer sends them once
        chunk.input_logprobs.CopyFrom(to_input_logprobs(output.prompt_token_ids, output.prompt_logprobs))
    return vpb.GenerateResponse(chunk=chunk)


def to_input_logprobs(prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprob]) -> vpb.InputLogProbs:
    """The prompt's logprobs as vLLM sends them: one entry per prompt token, the first without a value."""
    message = vpb.InputLogProbs(token_ids=prompt_token_ids)
    message.token_logprobs.append(vpb.InputTokenLogProb())
    message.token_logprobs.extend(vpb.InputTokenLogProb(value=lp.logprob) for lp in prompt_logprobs)
    message.top_logprobs.append(vpb.TopLogProbs())
    message.top_logprobs.extend(
        vpb.TopLogProbs(values=list(lp.top_logprobs.values()), token_ids=list(lp.top_logprobs))
        for lp in prompt_logprobs
    )
    return message


def to_complete(output: RequestOutput, with_logprobs: bool) -> vpb.GenerateResponse:
    """The last message: every output token id, the finish reason and the matched stop.

    with_logprobs: also every token's logprobs (a call without ``stream``; a
    streamed call had them in its chunks).

    Raises EngineDeadError (UNAVAILABLE) for a request the server's shutdown
    aborted after its grace: the gateway then reports an error to its client
    instead of a completion quietly cut short (finish_reason "abort" is kept for
    the aborts the gateway itself asked for).
    """
    if output.abort_cause is AbortCause.SHUTDOWN:
        raise EngineDeadError(
            f"the server shut down before request {output.request_id!r} finished (its shutdown grace ran out) "
            f"after {len(output.outputs[0].token_ids)} generated tokens; retry on another replica"
        )
    completion = output.outputs[0]
    complete = vpb.GenerateComplete(
        output_ids=completion.token_ids,
        finish_reason=completion.finish_reason or "abort",
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(completion.token_ids),
        cached_tokens=_cached_tokens(output),
        index=completion.index,
    )
    if with_logprobs and completion.logprobs:
        complete.output_logprobs.CopyFrom(to_output_logprobs(completion.logprobs))
    if with_logprobs and output.prompt_logprobs is not None:
        complete.input_logprobs.CopyFrom(to_input_logprobs(output.prompt_token_ids, output.prompt_logprobs))
    if isinstance(completion.stop_reason, str):
        complete.matched_stop_str = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        complete.matched_token_id = completion.stop_reason
    return vpb.GenerateResponse(complete=complete)


def to_model_info(info: ModelInfo) -> vpb.GetModelInfoResponse:
    """The model as the gateway registers it: its name is the OpenAI ``model``.

    ``tokenizer_path`` names the tokenizer as ``nanoserve://MODEL``, which is no
    file and no hub id, so the gateway fetches it from the worker (``GetTokenizer``)
    instead of reading a path that may happen to exist on its machine.
    """
    return vpb.GetModelInfoResponse(
        model_path=info.model_name,
        tokenizer_path=f"{TOKENIZER_SOURCE_SCHEME}{info.model_name}",
        is_generation=True,
        max_context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        supports_vision=False,
        served_model_name=info.model_name,
        eos_token_ids=info.eos_token_ids,
        bos_token_id=info.bos_token_id or 0,
        max_req_input_len=info.max_prompt_tokens,
    )


def to_server_info(
    info: ModelInfo, status: PoolStatus, uptime_s: float, max_num_seqs: int
) -> vpb.GetServerInfoResponse:
    return vpb.GetServerInfoResponse(
        active_requests=status.num_running + status.num_waiting,
        uptime_seconds=uptime_s,
        server_type="nanoserve",
        data_parallel_size=1,
        kv_cache_dtype=info.kv_cache_dtype,
        block_size=info.block_size,
        model_dtype=info.dtype,
        max_num_seqs=max_num_seqs,
    )


def to_loads(
    request: vpb.GetLoadsRequest, status: PoolStatus, max_num_seqs: int, server_version: str
) -> vpb.GetLoadsResponse:
    """The one rank's load; InvalidRequestError naming ``dp_rank`` when another rank is asked for."""
    if request.HasField("dp_rank"):
        _check_dp_rank("dp_rank", request.dp_rank)
    return vpb.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=server_version,
        dp_rank_count=1,
        loads=[to_scheduler_load(status, max_num_seqs)],
    )


def to_scheduler_load(status: PoolStatus, max_num_seqs: int) -> vpb.SchedulerLoad:
    """The engine's load as of its last step: its queues, and KV usage as the share of blocks allocated."""
    return vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=status.num_running,
        num_waiting_reqs=status.num_waiting,
        num_total_reqs=status.num_running + status.num_waiting,
        num_used_tokens=status.num_allocated * status.block_size,
        max_total_num_tokens=status.num_blocks * status.block_size,
        token_usage=status.num_allocated / status.num_blocks if status.num_blocks else 0.0,
        max_running_requests=max_num_seqs,
    )


def tokenizer_zip(files: dict[str, bytes]) -> bytes:
    """A zip of the tokenizer's files (``Tokenizer.export_files``), the same bytes for the same files."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(files):
            archive.writestr(zipfile.ZipInfo(name, date_time=ZIP_DATE_TIME), files[name], zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def to_tokenizer_chunks(bundle: bytes) -> Iterator[cpb.GetTokenizerChunk]:
    """The zip in chunks of TOKENIZER_CHUNK_BYTES; the last one carries the SHA-256 (hex) of the whole zip."""
    sha256 = hashlib.sha256(bundle).hexdigest()
    for start in range(0, len(bundle), TOKENIZER_CHUNK_BYTES):
        end = start + TOKENIZER_CHUNK_BYTES
        yield cpb.GetTokenizerChunk(data=bundle[start:end], sha256=sha256 if end >= len(bundle) else "")
