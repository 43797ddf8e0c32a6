"""AsyncLLMEngine: LLMEngine on its own thread, streams for asyncio callers.

The engine thread owns the LLMEngine (scheduler, allocator, model runner, the
registry of live requests); nothing else touches them. Work crosses threads
in three places only:

    asyncio loop ──tokenizer thread──▶ processed Request (tokenized, validated)
    asyncio loop ──inbox (SimpleQueue) + wake-up Event──▶ engine thread
    asyncio loop ◀──loop.call_soon_threadsafe(outputs)─── engine thread

Ownership: the engine thread alone decides whether a request is admitted (a
duplicate live id, a full queue) and how every request ends. The event loop
holds one ``RequestStream`` per call, keyed by the request's serial (unique for
the engine's life), never by its id alone: a request id reused right after a
cancel belongs to a new stream, and nothing of the old request reaches it.

Every request that was handed over ends with exactly one final output,
carrying its cause when it was aborted (``AbortCause``): finished, stopped,
aborted by an Abort call, cancelled, past its deadline, shut down, or the
engine failed. ``RequestStream.finished`` resolves with it whether or not
anyone still reads the stream, so a server records each request once.

The engine thread sleeps on the Event while idle (no polling) and, while
requests run, drains the inbox before every step, so an abort frees its
blocks before the next forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EventLogNotDurableError,
    InvalidRequestError,
    JournalDisabledError,
    PrefixCacheResetRefusedError,
    QueueFullError,
    RequestNotFoundError,
)
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.engine.prompts import ChatPrompt, Prompt
from nanoserve.engine.request import Request
from nanoserve.engine.request_journal import ended_output, history_outputs, slice_output
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.status import ModelInfo, PoolStatus

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog, EventLogIncompleteError
    from nanoserve.allocator.log.journal import RequestHistory
    from nanoserve.engine.tokenizer import Tokenizer

_log = structlog.get_logger(__name__)


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"  # shutdown begun: no new requests
    STOPPED = "stopped"


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_id: str
    cause: AbortCause
    serial: int | None  # None: whichever live request has the id (the Abort RPC)
    reply: asyncio.Future[None] | None  # resolved with the verdict (the Abort RPC waits for it)


@dataclass(frozen=True)
class _ResetPrefixCache:
    reply: asyncio.Future[int]  # resolved with the blocks reset, or PrefixCacheResetRefusedError


class _Stop:
    pass


class RequestStream:
    """One request's side of the handover, on the event loop.

    Iterate it for the request's outputs; the last one is finished. A request
    the engine refuses (invalid, duplicate live id, full queue, engine down)
    raises its error from the iteration before any output. ``finished``
    resolves exactly once: with the final output of a request that was handed
    to the engine (or aborted before it could be), or with the refusal's
    error. ``abort(cause)`` is safe at any time and more than once; only the
    first cause counts.
    """

    def __init__(self, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.finished: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.request: Request | None = None  # set once processed; the engine thread owns it after submission
        self.submitted = False
        self.abort_cause: AbortCause | None = None  # asked for by the caller; the engine decides what happened
        self._outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._last_output: RequestOutput | None = None
        self._engine: AsyncLLMEngine | None = None
        self.detached = False  # a request recovered after a crash: nobody iterates it (Resume follows it)
        self.deadline_s: float | None = None  # the call's deadline, time.monotonic(); journaled

    def abort(self, cause: AbortCause) -> None:
        """Ends the request with ``cause`` unless it has ended already."""
        if self.finished.done() or self.abort_cause is not None:
            return
        self.abort_cause = cause
        if self.submitted and self._engine is not None and self.request is not None:
            self._engine._submit(_Abort(self.request_id, cause, self.request.serial, None))

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._outputs.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    # ---- event-loop side, called by AsyncLLMEngine --------------------------

    def _deliver(self, output: RequestOutput) -> None:
        self._last_output = output
        if not self.detached:
            self._outputs.put_nowait(output)
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
        completion = CompletionOutput(
            index=0,
            text=last.text if last is not None else "",
            token_ids=list(last.token_ids) if last is not None else [],
            finish_reason="abort",
            logprobs=last.outputs[0].logprobs if last is not None else None,
        )
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
            self._outputs.put_nowait(error if error is not None else final)


class AsyncLLMEngine:
    """Streams per-request outputs to asyncio code while the engine steps on a thread.

    The narrow face the service uses: ``add_request`` / ``generate`` /
    ``abort`` / ``tokenize`` / ``tokenizer_files``, ``model_info``, ``pool_status()``,
    ``event_log`` and ``health``. Invariant (event loop only): ``_streams``
    holds exactly the streams handed to the engine thread whose final output
    has not arrived, keyed by serial; ``_open`` every stream not yet finished.
    """

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self._engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _ResetPrefixCache | _Stop] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[int, RequestStream] = {}  # serial -> stream handed to the engine thread
        self._open: set[RequestStream] = set()  # every stream not yet finished
        self._all_done: asyncio.Event | None = None  # set while no stream is open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # tokenization and chat templating run here, one at a time, never on the event loop
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenize")
        self._state = _State.NEW
        self._error: BaseException | None = None
        self._log_close_error: EventLogIncompleteError | None = None  # set by the engine thread at shutdown
        self._pool_status: PoolStatus | None = None  # published by the engine thread after each step
        # durability gate (event loop): (journal seq that must be durable, outputs, refusals, time.monotonic()
        # at the step's end), in step order
        self._held: deque[tuple[int, list[RequestOutput], list[tuple[int, BaseException]], float]] = deque()
        # called with the seconds each step's outputs waited for durability (the server's histogram)
        self.observe_durability_wait: Callable[[float], None] | None = None
        # request_id -> queues of Resume calls following the request's live outputs
        self._followers: dict[str, set[asyncio.Queue[RequestOutput]]] = {}

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Loads the model (off the event loop) and starts the engine thread."""
        if self._state is not _State.NEW:
            raise EngineDeadError(f"engine already {self._state.value}")
        self._loop = asyncio.get_running_loop()
        self._all_done = asyncio.Event()
        self._all_done.set()
        if self._engine is None:
            self._engine = await asyncio.to_thread(LLMEngine, self.config)
        self._pool_status = self._engine.pool_status()
        self._adopt_recovered(self._engine.recovered_requests)
        log = self._engine.event_log
        if log is not None and self._gated:
            log.add_durable_listener(self._on_durable)
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._state = _State.RUNNING
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def _core(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("engine not started")
        return self._engine

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model and its limits (fixed after start)."""
        return self._core.model_info

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, for in-process callers (the service tokenizes through ``tokenize``)."""
        return self._core.tokenizer

    @property
    def event_log(self) -> EventLog | None:
        """The allocator's event log, or None when the engine keeps none."""
        return self._core.event_log

    @property
    def event_log_healthy(self) -> bool:
        """The log can record (True when there is no log)."""
        log = self._core.event_log
        return log is None or bool(log.healthy)

    def event_log_not_durable_reason(self) -> str | None:
        """Why events made now might not become durable (the store away, read-only, full; the log
        failed); None while they would, or when the engine keeps no log. While it is not None new
        requests are refused (EventLogNotDurableError)."""
        log = self._engine.event_log if self._engine is not None else None
        if log is None or self._state is _State.STOPPED:
            return None
        return log.not_durable_reason()

    @property
    def log_close_error(self) -> EventLogIncompleteError | None:
        """Set after ``shutdown`` when the log did not take every event (which seqs, and why)."""
        return self._log_close_error

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops accepting requests, lets running ones finish for up to ``grace_s``
        seconds, aborts the rest (cause shutdown), stops the thread and closes the
        event log, which gets ``event_log_close_timeout_s`` more to take what waits:
        the whole shutdown is bounded even while the store is away. Events the log
        could not write are reported in ``log_close_error``."""
        if self._state in (_State.NEW, _State.STOPPED):
            self._state = _State.STOPPED
            self._tokenizer_pool.shutdown(wait=False)
            return
        self._state = _State.DRAINING
        assert self._all_done is not None
        log = self._core.event_log
        if log is not None:
            log.unbound()  # a step waiting for room in a stalled log goes on: streams can end, the loop stop
        try:
            await asyncio.wait_for(self._all_done.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            for stream in list(self._open):
                stream.abort(AbortCause.SHUTDOWN)
        self._submit(_Stop())
        assert self._thread is not None
        await asyncio.to_thread(self._thread.join)
        self._tokenizer_pool.shutdown(wait=False)
        self._state = _State.STOPPED

    @property
    def _gated(self) -> bool:
        """Outputs wait for their journal batch to be durable (the journal is kept, and
        stream_before_durable is off)."""
        engine = self._engine
        return engine is not None and engine.journaling and not self.config.event_log.stream_before_durable

    def _adopt_recovered(self, requests: list[Request]) -> None:
        """Streams for the requests recovery re-admitted: nobody iterates them (a client follows one
        with ``resume``); each ends at its journaled deadline like the call it came from."""
        assert self._loop is not None
        assert self._all_done is not None
        for request in requests:
            stream = RequestStream(request.request_id, request.metrics.arrival_time)
            stream._engine = self
            stream.request = request
            stream.submitted = True
            stream.detached = True
            self._streams[request.serial] = stream
            self._open.add(stream)
            self._all_done.clear()
            stream.finished.add_done_callback(functools.partial(self._close_finished, stream))
            if request.deadline_wall_ns is not None:
                delay_s = max(0.0, (request.deadline_wall_ns - time.time_ns()) / 1e9)
                self._loop.call_later(delay_s, stream.abort, AbortCause.DEADLINE)

    # ---- requests ----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        deadline_s: float | None = None,
    ) -> RequestStream:
        """Starts a request and returns its stream at once (event loop only).

        The prompt is tokenized and validated on the tokenizer thread, then
        handed to the engine thread, which admits it or refuses it; refusals
        (InvalidRequestError, DuplicateRequestError, QueueFullError,
        EngineDeadError) come out of the stream's iteration and its
        ``finished``. Raises EngineDeadError at once when the engine does not
        accept requests. deadline_s: the caller's deadline (``time.monotonic()``),
        journaled so that a request recovered after a crash still ends there.
        """
        self._check_accepting()
        assert self._all_done is not None
        stream = RequestStream(request_id, time.monotonic())
        stream._engine = self
        stream.deadline_s = deadline_s
        self._open.add(stream)
        self._all_done.clear()
        stream.finished.add_done_callback(lambda _: self._close(stream))
        asyncio.get_running_loop().create_task(self._hand_over(stream, prompt, sampling_params))
        return stream

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields this request's outputs as they are produced; the last one is finished.

        Errors are raised before the first item. If the caller stops iterating
        early or is cancelled, the request is aborted (cause cancelled) and its
        blocks freed before the engine's next step.
        """
        stream = self.add_request(request_id, prompt, sampling_params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort(AbortCause.CANCELLED)

    async def abort(self, request_id: str) -> None:
        """Aborts the live request with this id (cause abort_rpc); its stream ends with
        finish_reason "abort". Raises RequestNotFoundError when no live request has it."""
        reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit(_Abort(request_id, AbortCause.ABORT_RPC, None, reply))
        await reply

    async def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Token ids of a text, or of chat messages rendered with the chat template, computed on
        the tokenizer thread. Raises InvalidRequestError (field ``text`` or ``messages``): an
        unknown role, a model without a chat template, a text too long to be any prompt by its
        length alone (the work stays bounded; a text that tokenizes longer is counted)."""
        tokenize = functools.partial(self._core.input_processor.tokenize, prompt, text_field="text", as_prompt=False)
        _, token_ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, tokenize)
        return token_ids

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as files (``Tokenizer.export_files``: file name -> content), written out
        on the tokenizer thread, never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self._core.tokenizer.export_files)

    async def reset_prefix_cache(self) -> int:
        """Resets the prefix cache on the engine thread (``LLMEngine.reset_prefix_cache``); returns the
        blocks reset. Raises PrefixCacheResetRefusedError while blocks are held or caching is off."""
        self._check_accepting()
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._submit(_ResetPrefixCache(reply))
        return await reply

    def pool_status(self) -> PoolStatus:
        """The pool and queues as of the engine thread's last step (they change only in a step),
        with the log's progress and backlog read from the log now."""
        status = self._pool_status
        if status is None:
            raise EngineDeadError("engine not started")
        log = self._core.event_log
        if log is None:
            return status
        return dataclasses.replace(
            status,
            last_seq=log.last_seq,
            durable_seq=log.durable_seq,
            num_pending_batches=log.num_pending_batches,
            pending_bytes=log.pending_bytes,
        )

    def _check_accepting(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        if self._state is _State.NEW:
            raise EngineDeadError("engine not started; await start() first")
        if self._state is not _State.RUNNING:
            raise EngineDeadError(f"engine is {self._state.value}; not accepting requests")
        reason = self.event_log_not_durable_reason()
        if reason is not None:
            raise EventLogNotDurableError(
                f"event log not durable: {reason}; new requests are refused until it is (retry later, "
                "or on another server)"
            )

    async def _hand_over(self, stream: RequestStream, prompt: Prompt, params: SamplingParams | None) -> None:
        """Tokenizes on the tokenizer thread, then hands the request to the engine thread."""
        loop = asyncio.get_running_loop()
        try:
            stream.request = await loop.run_in_executor(
                self._tokenizer_pool,
                self._core.process_request,
                stream.request_id,
                prompt,
                params,
                stream.arrival_time,
            )
            self._check_accepting()
        except Exception as exc:
            if stream.abort_cause is not None:  # the caller left first: its ending, not the refusal
                stream._end_without_engine(stream.abort_cause)
            else:
                stream._refuse(exc)
            return
        if stream.abort_cause is not None:  # aborted while tokenizing: the engine never sees it
            stream._end_without_engine(stream.abort_cause)
            return
        if stream.deadline_s is not None:
            stream.request.deadline_wall_ns = time.time_ns() + round((stream.deadline_s - time.monotonic()) * 1e9)
        self._streams[stream.request.serial] = stream
        stream.submitted = True
        self._submit(_Add(stream.request))

    def _close_finished(self, stream: RequestStream, _finished: asyncio.Future[RequestOutput]) -> None:
        self._close(stream)

    def _close(self, stream: RequestStream) -> None:
        self._open.discard(stream)
        if stream.request is not None:
            self._streams.pop(stream.request.serial, None)
        if not self._open and self._all_done is not None:
            self._all_done.set()

    def _submit(self, message: _Add | _Abort | _ResetPrefixCache | _Stop) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    async def resume(self, request_id: str, after_token_index: int) -> AsyncIterator[RequestOutput]:
        """Streams request ``request_id`` from output token ``after_token_index`` on: the journaled
        tokens first, then the live ones, ending with its final output, like ``generate``.

        Works on a finished request (its journaled tail and its ending), on one recovered after a
        crash, and on one still running here; the same call twice streams the same tokens. Leaving
        the iteration does not abort the request. Token i is the i-th released output token
        (``RequestOutput.token_ids[i]``); a resume point inside an output cuts it, and its text is
        then left out. Raises JournalDisabledError when no journal is kept, RequestNotFoundError
        when the journal never saw the id and no live request has it.
        """
        if self._engine is None or not self._engine.journaling:
            raise JournalDisabledError(
                "the server keeps no request journal (--event-log-url none or --no-journal): nothing to resume"
            )
        if after_token_index < 0:
            raise InvalidRequestError("after_token_index", f"must be >= 0, got {after_token_index}")
        follower: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._followers.setdefault(request_id, set()).add(follower)
        try:
            live = any(s.request_id == request_id and not s.finished.done() for s in self._open)
            history = await asyncio.to_thread(self._read_history, request_id)
            if history is None and not live:
                raise RequestNotFoundError(f"request_id: no request {request_id!r} in the journal or running")
            next_index = after_token_index
            if history is not None:
                for output in history_outputs(history, after_token_index):
                    yield output
                    next_index = max(next_index, len(output.token_ids))
                if history.finish is not None:
                    return
            if not live:
                yield ended_output(history, request_id)
                return
            while True:
                output = await follower.get()
                if len(output.token_ids) > next_index or output.finished:
                    yield slice_output(output, next_index)
                    next_index = max(next_index, len(output.token_ids))
                if output.finished:
                    return
        finally:
            followers = self._followers.get(request_id)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    del self._followers[request_id]

    def _read_history(self, request_id: str) -> RequestHistory | None:
        from nanoserve.allocator.log.journal import read_request_history
        from nanoserve.allocator.log.log_reader import connect

        url = self.config.event_log.event_log_url
        assert url is not None
        with connect(url) as conn:
            return read_request_history(conn, self.config.event_log.pool_id, request_id)

    def _to_followers(self, output: RequestOutput) -> None:
        for follower in self._followers.get(output.request_id, ()):
            follower.put_nowait(output)

    # ---- event-loop side of the handover ------------------------------------

    def _dispatch_durable(
        self,
        watermark: int | None,
        outputs: list[RequestOutput],
        failures: list[tuple[int, BaseException]],
        made_s: float = 0.0,
    ) -> None:
        """Dispatches a step's outputs once the journal records that hold them are durable
        (``watermark``: the step's last journal seq; None: at once). ``made_s``: the step's end
        (time.monotonic()), for ``observe_durability_wait``."""
        if watermark is None:
            self._dispatch(outputs, failures)
            return
        self._held.append((watermark, outputs, failures, made_s))
        self._release_held()

    def _on_durable(self) -> None:
        """The writer committed (writer thread): wake the loop only when outputs wait. Skipping is
        safe: a step held after this check is checked against the then durable seq when it arrives."""
        if self._held:
            _call_soon(self._loop, self._release_held)

    def _release_held(self) -> None:
        """Dispatches held steps, in order, up to the log's durable journal seq."""
        log = self._engine.event_log if self._engine is not None else None
        durable = log.durable_journal_seq if log is not None else 0
        held = self._held
        observe = self.observe_durability_wait
        while held and held[0][0] <= durable:
            _, outputs, failures, made_s = held.popleft()
            self._dispatch(outputs, failures)
            if observe is not None and outputs:
                observe(time.monotonic() - made_s)

    def _release_all(self, outputs: list[RequestOutput]) -> None:
        """The engine stopped: every held step goes out (the log reports what it could not take),
        then the final outputs of the shutdown's aborts."""
        while self._held:
            _, held_outputs, failures, _ = self._held.popleft()
            self._dispatch(held_outputs, failures)
        self._dispatch(outputs, [])

    def _dispatch(self, outputs: list[RequestOutput], failures: list[tuple[int, BaseException]]) -> None:
        for output in outputs:
            stream = self._streams.get(output.serial)
            assert stream is not None, f"output of request {output.request_id!r} #{output.serial} has no stream"
            stream._deliver(output)
        for serial, error in failures:
            stream = self._streams.get(serial)
            assert stream is not None, f"refusal of request #{serial} has no stream"
            if stream.abort_cause is not None:
                stream._end_without_engine(stream.abort_cause)
            else:
                stream._refuse(error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine thread died: every request it held ends here, cause engine_error."""
        self._held.clear()
        for stream in list(self._streams.values()):
            stream._end_without_engine(AbortCause.ENGINE_ERROR, error)

    # ---- engine thread -----------------------------------------------------

    def _run(self) -> None:
        engine = self._core
        loop = self._loop
        gated = self._gated
        assert loop is not None
        try:
            while True:
                self._wakeup.clear()
                failures: list[tuple[int, BaseException]] = []
                if self._drain_inbox(engine, failures):
                    break
                if engine.has_unfinished_requests() or engine.has_pending_outputs:
                    outputs = engine.step()
                    self._pool_status = engine.pool_status()
                    watermark = engine.event_log.last_journal_seq if gated and engine.event_log is not None else None
                    loop.call_soon_threadsafe(self._dispatch_durable, watermark, outputs, failures, time.monotonic())
                else:
                    self._pool_status = engine.pool_status()
                    if failures:
                        loop.call_soon_threadsafe(self._dispatch_durable, None, [], failures)
                    self._wakeup.wait()
            self._shut_down(engine)
            outputs = engine.step()  # the aborts shutdown made
            loop.call_soon_threadsafe(self._release_all, outputs)
        except BaseException as exc:
            self._error = exc
            _log.exception("engine_loop_failed")
            dead = EngineDeadError(f"engine loop failed: {exc!r}")
            dead.__cause__ = exc
            loop.call_soon_threadsafe(self._fail_all, dead)
            try:
                self._shut_down(engine)
            except Exception:
                _log.exception("engine_shutdown_failed")
        finally:
            self._pool_status = engine.pool_status()

    def _shut_down(self, engine: LLMEngine) -> None:
        """Ends the engine; a log that did not take every event is reported (one line) and kept."""
        from nanoserve.allocator.log.errors import EventLogIncompleteError, safe_url

        try:
            engine.shutdown()
        except EventLogIncompleteError as exc:
            self._log_close_error = exc
            _log.error(
                "event_log_incomplete",
                url=safe_url(exc.url),
                num_events=exc.num_events,
                first_seq=exc.first_seq,
                last_seq=exc.last_seq,
                reason=exc.reason,
            )

    def _drain_inbox(self, engine: LLMEngine, failures: list[tuple[int, BaseException]]) -> bool:
        """Applies queued adds and aborts, in the order they were sent; True when asked to stop."""
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return False
            if isinstance(message, _Stop):
                return True
            if isinstance(message, _Add):
                try:
                    engine.add_processed(message.request)
                except (DuplicateRequestError, QueueFullError) as exc:
                    failures.append((message.request.serial, exc))
            elif isinstance(message, _ResetPrefixCache):
                try:
                    num_reset = engine.reset_prefix_cache()
                except PrefixCacheResetRefusedError as exc:
                    loop.call_soon_threadsafe(_resolve_value, message.reply, exc)
                else:
                    loop.call_soon_threadsafe(_resolve_value, message.reply, num_reset)
            elif isinstance(message, _Abort):
                try:
                    engine.abort(message.request_id, message.cause, message.serial)
                    verdict: BaseException | None = None
                except RequestNotFoundError as exc:  # ended in the meantime, or never live
                    verdict = exc
                if message.reply is not None:
                    loop.call_soon_threadsafe(_resolve, message.reply, verdict)


def _call_soon(loop: asyncio.AbstractEventLoop | None, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop`` from another thread; nothing once the loop has closed."""
    if loop is None:
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def _resolve_value(reply: asyncio.Future[int], result: int | BaseException) -> None:
    if reply.done():
        return
    if isinstance(result, BaseException):
        reply.set_exception(result)
    else:
        reply.set_result(result)


def _resolve(reply: asyncio.Future[None], error: BaseException | None) -> None:
    if reply.done():
        return
    if error is None:
        reply.set_result(None)
    else:
        reply.set_exception(error)
