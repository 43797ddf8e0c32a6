"""RequestStream: one request's side of the thread handover; StreamRegistry: the event loop's streams.

A stream is keyed by its request's serial (unique for the engine's life),
never by its id alone: a request id reused right after a cancel belongs to a
new stream, and nothing of the old request reaches it.

A stream queues deltas (``RequestOutput.as_delta``) and only the final output
whole, and holds at most ``StreamConfig``'s bound of unread outputs (messages
and estimated bytes): a reader further behind is cut off, its request aborted
with cause slow_consumer. So what a stalled reader costs is bounded, and what
any stream costs is O(its tokens), never O(tokens²).

A reader that wakes up behind takes everything queued at once, merged into one
output (``merge_outputs``): the steps' deltas joined, the newest step's state,
as vLLM's output collector merges for a consumer that lags. One message then
carries several steps' tokens, so a reader whose per-message cost is above a
step's time catches up instead of falling further behind; only a reader that
does not come back for ``max_stream_buffer_messages`` steps is cut off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from nanoserve.engine.config import StreamConfig
from nanoserve.engine.core.engine_inbox import AbortRequest
from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.core.request import Request
from nanoserve.engine.core.scope_buffers import ScopeBuffer, ScopeBuffers
from nanoserve.engine.core.status import scope_of
from nanoserve.engine.errors import StreamBufferFullError

if TYPE_CHECKING:
    from nanoserve.engine.core.async_llm_engine import AsyncLLMEngine


class RequestStream:
    """One request's side of the handover, on the event loop.

    Iterate it for the request's outputs; the last one is finished and whole,
    every other one a delta (``RequestOutput.as_delta``). A request
    the engine refuses (invalid, duplicate live id, full queue, engine down)
    raises its error from the iteration before any output. ``finished``
    resolves exactly once: with the final output of a request that was handed
    to the engine (or aborted before it could be), or with the refusal's
    error. ``abort(cause)`` is safe at any time and more than once; only the
    first cause counts.

    Invariant: ``num_queued`` / ``num_queued_bytes`` count the outputs queued
    and not yet taken by the reader; a delivery that takes either past
    ``limits`` empties the queue, aborts the request (cause slow_consumer) and
    leaves only ``StreamBufferFullError`` for the reader. The final output is
    never refused: after it the queue cannot grow.
    """

    def __init__(self, request_id: str, arrival_time: float, limits: StreamConfig | None = None) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.request: Request | None = None  # set once processed; the engine thread owns it after submission
        self.submitted = False
        self.abort_cause: AbortCause | None = None  # asked for by the caller; the engine decides what happened
        self._outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.limits = limits if limits is not None else StreamConfig()
        self.num_queued = 0  # outputs in _outputs
        self.num_queued_bytes = 0  # their estimated size (output_size_bytes)
        self.overflowed = False  # cut off for reading too slowly: nothing more is queued
        self.scope_buffer: ScopeBuffer | None = None  # its scope's (tenant's) account, shared with its streams
        self.reader_gone = False  # the iteration ended: nothing more is queued
        self._last_output: RequestOutput | None = None
        # sample index -> (tokens, characters of text) its delivered deltas reach (the text after what a
        # recovered request restored): a prefix of what the sample's TextStream holds, read from it
        # only if the stream must end the request itself
        self._num_seen: dict[int, tuple[int, int]] = {}
        self._engine: AsyncLLMEngine | None = None
        self.detached = False  # a request recovered after a crash: nobody iterates it (Resume follows it)
        self.deadline_s: float | None = None  # the call's deadline, time.monotonic(); journaled

    def abort(self, cause: AbortCause) -> None:
        """Ends the request with ``cause`` unless it has ended already."""
        if self.finished.done() or self.abort_cause is not None:
            return
        self.abort_cause = cause
        if self.submitted and self._engine is not None and self.request is not None:
            self._engine._submit(AbortRequest(self.request_id, cause, self.request.serial, None))

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self._taken():
                yield output
        finally:
            self._abandon()

    def _abandon(self) -> None:
        """The reader left (or read the end): nothing more is queued, and what waits is let go."""
        self.reader_gone = True
        if self.scope_buffer is not None:
            self.scope_buffer.release(self.num_queued_bytes)
        self.num_queued = 0
        self.num_queued_bytes = 0

    async def _taken(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                raise item
            taken = [item]  # and what else waits, up to an error (which follows what came before it)
            while not taken[-1].finished and not self._outputs.empty():
                more = self._outputs.get_nowait()
                if isinstance(more, BaseException):
                    self._outputs.put_nowait(more)  # the queue held nothing else: the error stays next
                    break
                taken.append(more)
            self.num_queued -= len(taken)
            num_bytes = sum(output_size_bytes(output) for output in taken)
            self.num_queued_bytes -= num_bytes
            if self.scope_buffer is not None:
                self.scope_buffer.release(num_bytes)
            for merged in merge_outputs(taken):
                yield merged
                if merged.finished:
                    return

    # ---- event-loop side, called by AsyncLLMEngine --------------------------

    def _deliver(self, output: RequestOutput) -> None:
        self._last_output = output
        completion = output.outputs[0]
        if output.is_delta:
            num_chars = self._num_seen.get(completion.index, (0, 0))[1] + len(output.delta_text)
            self._num_seen[completion.index] = (output.num_released_tokens, num_chars)
        if not self.detached:
            self._enqueue(output.as_delta())
        if self._engine is not None:
            self._engine._to_followers(output)
        if output.finished and not self.finished.done():
            self.finished.set_result(output)

    def _refuse(self, error: BaseException) -> None:
        """The request never ran: the caller gets ``error``, nothing is recorded as finished."""
        self._outputs.put_nowait(error)
        if not self.finished.done():
            self.finished.set_exception(error)
            self.finished.exception()  # retrieved: a refusal is reported through the iteration

    def _end_without_engine(self, cause: AbortCause, error: BaseException | None = None) -> None:
        """Ends a request the engine thread cannot end (aborted before submission, or the
        engine failed): its final output is made here from what the stream has seen."""
        now = time.monotonic()
        last = self._last_output
        request = self.request
        if last is None:
            completion = CompletionOutput(0, "", [], "abort")
        elif not last.is_delta:  # a whole output: it holds everything seen
            completion = CompletionOutput(
                0, last.text, list(last.token_ids), "abort", logprobs=last.outputs[0].logprobs
            )
        else:
            assert request is not None, "a request that streamed outputs was processed"
            completion = self._seen_completion(request, last.outputs[0].index)
        metrics = dataclasses.replace(last.metrics) if last is not None and last.metrics is not None else None
        if metrics is None:
            metrics = RequestMetrics(arrival_time=request.metrics.arrival_time if request else self.arrival_time)
        metrics.finished_time = now
        final = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=request.prompt_token_ids if request is not None else [],
            outputs=[completion],
            finished=True,
            metrics=metrics,
            prompt=request.prompt if request is not None else None,
            serial=request.serial if request is not None else 0,
            abort_cause=cause,
        )
        self._last_output = final
        if not self.finished.done():
            self.finished.set_result(final)
        if self._engine is not None:
            self._engine._to_followers(final)
        if not self.detached:
            if error is not None:
                self._outputs.put_nowait(error)
            else:
                self._enqueue(final)

    def _seen_completion(self, request: Request, index: int) -> CompletionOutput:
        """What the delivered outputs of sample ``index`` held, ended by abort: the prefix of its
        TextStream they covered (the engine thread only appends to it: the prefix is stable)."""
        group = request.group
        text_stream = (group.children[index] if group is not None else request).stream
        num_tokens, num_chars = self._num_seen[index]
        num_chars += text_stream.num_restored_chars
        logprobs = text_stream.logprobs[:num_tokens] if text_stream.logprobs is not None else None
        return CompletionOutput(
            0, text_stream.text[:num_chars], text_stream.token_ids[:num_tokens], "abort", logprobs=logprobs
        )

    def _enqueue(self, output: RequestOutput) -> None:
        """Queues ``output`` for the reader, or cuts the reader off past ``limits``."""
        if self.overflowed or self.reader_gone:
            return  # the reader gets the error (or is gone); the final output still resolves ``finished``
        num_bytes = output_size_bytes(output)
        self.num_queued += 1
        self.num_queued_bytes += num_bytes
        if self.scope_buffer is not None:
            self.scope_buffer.num_queued_bytes += num_bytes
        if not output.finished and (
            self.num_queued > self.limits.max_stream_buffer_messages
            or self.num_queued_bytes > self.limits.max_stream_buffer_bytes
        ):
            self._overflow(self._bound_passed())
            return
        self._outputs.put_nowait(output)
        self._bound_scope()

    def _bound_passed(self) -> str:
        limits = self.limits
        if self.num_queued > limits.max_stream_buffer_messages:
            return f"more than --max-stream-buffer-messages={limits.max_stream_buffer_messages} outputs"
        return f"more than --max-stream-buffer-bytes={limits.max_stream_buffer_bytes} bytes"

    def _bound_scope(self) -> None:
        """Cuts off the scope's laggards while its streams hold more than the tenant bound."""
        account, bound = self.scope_buffer, self.limits.max_tenant_stream_buffer_bytes
        while account is not None and account.num_queued_bytes > bound:
            laggard = account.laggard()
            if laggard is None:
                return  # what is held is finished streams' final outputs: never refused
            scope = f"tenant {account.scope!r}" if account.scope else "the server's one tenant"
            laggard._overflow(
                f"{laggard.num_queued_bytes} bytes (the most of any stream of {scope}, whose streams held more "
                f"than --max-tenant-stream-buffer-bytes={bound} bytes in all)"
            )

    def _overflow(self, bound: str) -> None:
        """The reader fell behind past a bound: drop what waits, abort the request, leave the error."""
        error = StreamBufferFullError(
            f"request {self.request_id!r}: the client read its stream too slowly: {bound} "
            "waited unread; the request was aborted"
        )
        self.overflowed = True
        while not self._outputs.empty():
            self._outputs.get_nowait()
        if self.scope_buffer is not None:
            self.scope_buffer.release(self.num_queued_bytes)
        self.num_queued = 0
        self.num_queued_bytes = 0
        self._outputs.put_nowait(error)
        self.abort(AbortCause.SLOW_CONSUMER)


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Consecutive outputs of a stream (oldest first), with each run that can be one output merged:
    a delta followed by outputs of the same sample (``outputs[0].index``) that are deltas too, or the
    final output. A merged output is the run's newest (its metrics, finish, and for a final output
    its whole completion), with the run's deltas (text, token ids, logprobs) joined in order."""
    runs: list[list[RequestOutput]] = []
    for output in outputs:
        if runs and _joins(runs[-1][-1], output):
            runs[-1].append(output)
        else:
            runs.append([output])
    return [run[0] if len(run) == 1 else _merged(run) for run in runs]


def _joins(before: RequestOutput, output: RequestOutput) -> bool:
    """Whether ``output`` may be merged into the run ending with ``before``: a delta of the same
    sample, or a one-sample request's final output (a parallel-sampling final gathers every sample,
    and a sample's ending stays whole: neither absorbs a delta)."""
    return (
        before.is_delta
        and not before.finished
        and (output.is_delta or (output.finished and output.samples_streamed is None))
        and output.outputs[0].index == before.outputs[0].index
    )


def _merged(run: list[RequestOutput]) -> RequestOutput:
    newest = run[-1]
    text = "".join(output.delta_text for output in run)
    token_ids = [token_id for output in run for token_id in output.delta_token_ids]
    logprobs: list[TokenLogprob] | None = None
    if any(output.delta_logprobs is not None for output in run):
        logprobs = [logprob for output in run for logprob in output.delta_logprobs or ()]
    completion = newest.outputs[0]
    if newest.is_delta:  # outputs[0] is the delta: it becomes the joined one
        completion = dataclasses.replace(completion, text=text, token_ids=token_ids, logprobs=logprobs)
    return dataclasses.replace(
        newest,
        outputs=[completion],
        delta_text=text,
        delta_token_ids=token_ids,
        delta_logprobs=logprobs,
        prompt_logprobs=newest.prompt_logprobs if newest.prompt_logprobs is not None else run[0].prompt_logprobs,
        delta_start=run[0].delta_start if newest.is_delta else 0,
    )


# Estimated sizes, bytes, of the CPython objects a queued output holds (64-bit builds): the
# output, its completion, metrics and lists (a fixed part); a token id in a list (the int and
# its slot); a TokenLogprob with its float, besides its top_logprobs dict and the dict's entries.
OUTPUT_BASE_BYTES = 600
TOKEN_ID_BYTES = 36
LOGPROB_BASE_BYTES = 110
TOP_LOGPROB_ENTRY_BYTES = 52


def output_size_bytes(output: RequestOutput) -> int:
    """An estimate of the bytes ``output`` holds beyond what the engine keeps anyway, in
    O(its logprobs): for a delta the step's text, token ids and logprobs; for a whole
    (final) output its whole completion. It is what a stream's byte bound counts."""
    completion = output.outputs[0]
    size = OUTPUT_BASE_BYTES + sys.getsizeof(completion.text) + TOKEN_ID_BYTES * len(completion.token_ids)
    return size + _logprobs_size_bytes(completion.logprobs)


def _logprobs_size_bytes(logprobs: list[TokenLogprob] | None) -> int:
    if not logprobs:
        return 0
    return sum(
        LOGPROB_BASE_BYTES + sys.getsizeof(lp.top_logprobs) + TOP_LOGPROB_ENTRY_BYTES * len(lp.top_logprobs)
        for lp in logprobs
    )


class StreamRegistry:
    """The streams of the event loop (event loop only).

    Invariant: ``handed`` holds exactly the streams handed to the engine thread
    whose final output has not arrived, keyed by serial; ``open`` every stream
    not yet finished; ``all_done`` is set exactly while ``open`` is empty (a
    graceful shutdown waits on it).
    """

    def __init__(self) -> None:
        self.handed: dict[int, RequestStream] = {}  # serial -> stream handed to the engine thread
        self.open: set[RequestStream] = set()  # every stream not yet finished
        self.all_done = asyncio.Event()
        self.all_done.set()
        self.scope_buffers = ScopeBuffers()  # the unread bytes of each scope's (tenant's) streams

    def add(self, stream: RequestStream) -> None:
        """Counts ``stream`` open until its ``finished`` resolves, and in its scope's account."""
        stream.scope_buffer = self.scope_buffers.join(scope_of(stream.request_id), stream)
        self.open.add(stream)
        self.all_done.clear()
        stream.finished.add_done_callback(lambda _: self.close(stream))

    def hand_over(self, stream: RequestStream) -> None:
        """``stream``'s request goes to the engine thread: its outputs are routed by serial."""
        assert stream.request is not None, "a stream is handed over once its request is processed"
        self.handed[stream.request.serial] = stream
        stream.submitted = True

    def close(self, stream: RequestStream) -> None:
        self.open.discard(stream)
        if stream.scope_buffer is not None:
            stream.scope_buffer.leave(stream)
        if stream.request is not None:
            self.handed.pop(stream.request.serial, None)
        if not self.open:
            self.all_done.set()

    def is_live(self, request_id: str) -> bool:
        """A stream of this request id has not finished."""
        return any(s.request_id == request_id and not s.finished.done() for s in self.open)

    def __iter__(self) -> Iterator[RequestStream]:
        """The open streams (a copy: ending one while iterating is safe)."""
        return iter(list(self.open))

    def dispatch(self, outputs: list[RequestOutput], failures: list[tuple[int, BaseException]]) -> None:
        """Routes a step's outputs, and its refusals ((serial, error)), to their streams by serial."""
        for output in outputs:
            stream = self.handed.get(output.serial)
            assert stream is not None, f"output of request {output.request_id!r} #{output.serial} has no stream"
            stream._deliver(output)
        for serial, error in failures:
            stream = self.handed.get(serial)
            assert stream is not None, f"refusal of request #{serial} has no stream"
            if stream.abort_cause is not None:
                stream._end_without_engine(stream.abort_cause)
            else:
                stream._refuse(error)

    def fail_all(self, error: BaseException) -> None:
        """The engine thread died: every stream handed to it ends here, cause engine_error, raising ``error``."""
        for stream in list(self.handed.values()):
            stream._end_without_engine(AbortCause.ENGINE_ERROR, error)
