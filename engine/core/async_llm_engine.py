"""AsyncLLMEngine: LLMEngine on its own thread, streams for asyncio callers.

The engine thread owns the LLMEngine (scheduler, allocator, model runner, the
registry of live requests); nothing else touches them. Work crosses threads
in three places only:

    asyncio loop ──tokenizer thread──▶ processed Request (tokenized, validated)
    asyncio loop ──inbox (SimpleQueue) + wake-up Event──▶ engine thread
    asyncio loop ◀──loop.call_soon_threadsafe(outputs)─── engine thread

Ownership: the engine thread alone decides whether a request is admitted (a
duplicate live id, a full queue) and how every request ends. The event loop
holds one ``RequestStream`` per call, keyed by the request's serial
(``request_stream``); outputs wait in ``durability_gate`` for the journal.

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
import enum
import functools
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING

import structlog

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.durability_gate import DurabilityGate
from nanoserve.engine.core.engine_inbox import (
    AbortRequest,
    AddRequest,
    InboxMessage,
    ResetPrefixCache,
    StopEngine,
    apply_messages,
)
from nanoserve.engine.core.llm_engine import LLMEngine
from nanoserve.engine.core.log_reads import LogReads, ReadPacer
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.core.read_gate import ReadGate
from nanoserve.engine.core.recovered_streams import adopt_recovered
from nanoserve.engine.core.request_intake import RequestIntake
from nanoserve.engine.core.request_stream import RequestStream, StreamRegistry
from nanoserve.engine.core.resume_followers import ResumeFollowers, read_journaled
from nanoserve.engine.core.status import ModelInfo, PoolStatus, with_log_progress
from nanoserve.engine.core.stored_events import StoredEvents
from nanoserve.engine.errors import (
    EngineDeadError,
    EventLogNotDurableError,
    JournalDisabledError,
    RequestNotFoundError,
)
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.structured_outputs import StructuredOutputStats
from nanoserve.engine.text.input_processor import MAX_REQUEST_ID_CHARS
from nanoserve.engine.text.prompts import ChatPrompt, Prompt
from nanoserve.engine.text.stored_text import check_stored_text

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog, EventLogIncompleteError
    from nanoserve.engine.text.tokenizer import Tokenizer

_log = structlog.get_logger(__name__)


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"  # shutdown begun: no new requests
    STOPPED = "stopped"


class AsyncLLMEngine:
    """Streams per-request outputs to asyncio code while the engine steps on a thread.

    The narrow face the service uses: ``add_request`` / ``generate`` /
    ``abort`` / ``tokenize`` / ``tokenizer_files``, ``model_info``, ``pool_status()``,
    ``event_log`` and ``health``. Its parts, each in its module: the streams
    (``StreamRegistry``), the durability gate, the Resume followers, the
    adoption of recovered requests; this class is the thread bridge between them
    and the engine thread.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine: LLMEngine | None = None,
        *,
        load: Callable[[EngineConfig], LLMEngine] = LLMEngine,
    ) -> None:
        """engine: an LLMEngine built on ``config``; None: ``start`` builds one with ``load`` on a
        worker thread (an entry point passes ``log_setup.build_engine``, which opens the log)."""
        self.config = config
        self._engine = engine
        self._load = load
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams = StreamRegistry()
        self._recovered: list[RequestStream] = []  # streams of recovered requests, until the server takes them
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # tokenization, chat templating and grammar compiles: never on the event loop
        self._intake = RequestIntake(lambda: self._core)
        self._state = _State.NEW
        self._error: BaseException | None = None
        self._log_close_error: EventLogIncompleteError | None = None  # set by the engine thread at shutdown
        self._pool_status: PoolStatus | None = None  # published by the engine thread after each step
        self._gate = DurabilityGate(self._streams.dispatch, lambda: self._engine.event_log if self._engine else None)
        # Resume and WatchEvents catch-up read the log here, a bounded number at a time
        self.log_reads = LogReads(config.event_log.max_concurrent_log_reads, config.event_log.max_tenant_log_reads)
        # the pages of stored events catch-ups read, decoded once for all of them (forget: after an archive cut)
        self.stored_events = StoredEvents(self.log_reads)
        # what the read paths send goes out at this pace while requests run (as of the last step)
        generating = lambda: self._pool_status is not None and self._pool_status.num_running > 0  # noqa: E731
        gate = ReadGate(config.event_log.max_read_loop_share, generating)  # and in the loop's spare time
        self.read_pacer = ReadPacer(config.event_log.max_read_items_per_s, generating, gate=gate)
        self._followers = ResumeFollowers(
            functools.partial(read_journaled, config), self._streams.is_live, self.log_reads, self.read_pacer
        )

    # ---- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Loads the model (off the event loop, unless an engine was handed in) and starts the engine thread."""
        if self._state is not _State.NEW:
            raise EngineDeadError(f"engine already {self._state.value}")
        self._loop = asyncio.get_running_loop()
        if self._engine is None:
            self._engine = await asyncio.to_thread(self._load, self.config)
        self._pool_status = self._engine.pool_status()
        self._recovered = adopt_recovered(self._engine.recovered_requests, self, self._streams, self._loop)
        log = self._engine.event_log
        if log is not None and self._gated:
            self._gate.attach(self._loop, log)
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
            self._intake.shutdown()
            self.log_reads.shutdown()
            return
        self._state = _State.DRAINING
        log = self._core.event_log
        if log is not None:
            log.unbound()  # a step waiting for room in a stalled log goes on: streams can end, the loop stop
        try:
            await asyncio.wait_for(self._streams.all_done.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            for stream in self._streams:
                stream.abort(AbortCause.SHUTDOWN)
        self._submit(StopEngine())
        assert self._thread is not None
        await asyncio.to_thread(self._thread.join)
        self._intake.shutdown()
        self.log_reads.shutdown()
        self._state = _State.STOPPED

    @property
    def _gated(self) -> bool:
        """Outputs wait for their journal batch to be durable (the journal is kept, and
        stream_before_durable is off)."""
        engine = self._engine
        return engine is not None and engine.journaling and not self.config.event_log.stream_before_durable

    def take_recovered_streams(self) -> list[RequestStream]:
        """The streams of the requests recovery re-admitted at start (each once: the list is emptied).

        Nobody iterates them; the server records each one's ending from its
        ``finished`` (one ``request_finished`` line, one count), like any other request.
        """
        streams, self._recovered = self._recovered, []
        return streams

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
        stream = RequestStream(request_id, time.monotonic(), self.config.stream)
        stream._engine = self
        stream.deadline_s = deadline_s
        self._streams.add(stream)
        self._followers.forget(request_id)  # a finished request of this id no longer answers Resume
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
        finish_reason "abort". Raises RequestNotFoundError when no live request has it.

        An id no open stream has is refused here, on the event loop: a flood of unknown ids
        costs the engine thread nothing."""
        if not self._streams.is_live(request_id):
            raise RequestNotFoundError(f"request_id: no live request {request_id!r}")
        reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._submit(AbortRequest(request_id, AbortCause.ABORT_RPC, None, reply))
        await reply

    async def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        """Token ids of a text, or of chat messages rendered with the chat template, computed on
        the tokenizer thread. Raises InvalidRequestError (field ``text`` or ``messages``): an
        unknown role, a model without a chat template, a text too long to be any prompt by its
        length alone (the work stays bounded; a text that tokenizes longer is counted)."""
        return await self._intake.tokenize(prompt)

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as files (``Tokenizer.export_files``: file name -> content), written out
        on the tokenizer thread, never on the event loop."""
        return await self._intake.tokenizer_files()

    async def reset_prefix_cache(self) -> int:
        """Resets the prefix cache on the engine thread (``LLMEngine.reset_prefix_cache``); returns the
        blocks reset. Raises PrefixCacheResetRefusedError while blocks are held or caching is off."""
        self._check_accepting()
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._submit(ResetPrefixCache(reply))
        return await reply

    def structured_output_stats(self) -> StructuredOutputStats:
        """Constrained requests by kind (running totals), and the compile and mask timings since
        the last call (``StructuredOutputs.take_stats``; safe from the event loop)."""
        return self._core.structured.take_stats()

    def pool_status(self) -> PoolStatus:
        """The pool and queues as of the engine thread's last step (they change only in a step),
        with the log's progress and backlog read from the log now (``status.with_log_progress``)."""
        if self._pool_status is None:
            raise EngineDeadError("engine not started")
        return with_log_progress(self._pool_status, self._core.event_log)

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
        """Tokenizes on the tokenizer thread, waits for a constraint's grammar to compile on another
        (so that a slow compile holds up no other request's tokenizing), then hands the request to
        the engine thread."""
        try:
            stream.request = await self._intake.process(stream.request_id, prompt, params, stream.arrival_time)
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
        self._streams.hand_over(stream)
        self._submit(AddRequest(stream.request))

    def _submit(self, message: InboxMessage) -> None:
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
        check_stored_text("request_id", request_id, MAX_REQUEST_ID_CHARS)  # the journal is queried with it
        if self._engine is None or not self._engine.journaling:
            raise JournalDisabledError(
                "the server keeps no request journal (--event-log-url none or --no-journal): nothing to resume"
            )
        async for output in self._followers.follow(request_id, after_token_index):
            yield output

    def _to_followers(self, output: RequestOutput) -> None:
        self._followers.deliver(output)

    @property
    def observe_durability_wait(self) -> Callable[[float], None] | None:
        """Called with the seconds each step's outputs waited for durability (the server's histogram)."""
        return self._gate.observe_wait

    @observe_durability_wait.setter
    def observe_durability_wait(self, observe: Callable[[float], None] | None) -> None:
        self._gate.observe_wait = observe

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
                if apply_messages(self._inbox, engine, loop, failures):
                    break
                if engine.has_unfinished_requests() or engine.has_pending_outputs:
                    outputs = engine.step()
                    self._pool_status = engine.pool_status()
                    watermark = engine.event_log.last_journal_seq if gated and engine.event_log is not None else None
                    loop.call_soon_threadsafe(self._gate.submit, watermark, outputs, failures, time.monotonic())
                else:
                    self._pool_status = engine.pool_status()
                    if failures:
                        loop.call_soon_threadsafe(self._gate.submit, None, [], failures)
                    self._wakeup.wait()
            self._shut_down(engine)
            outputs = engine.step()  # the aborts shutdown made
            loop.call_soon_threadsafe(self._gate.release_all, outputs)
        except BaseException as exc:
            self._error = exc
            _log.exception("engine_loop_failed")
            dead = EngineDeadError(f"engine loop failed: {exc!r}")
            dead.__cause__ = exc
            loop.call_soon_threadsafe(self._gate.drop)  # every request the thread held ends at once:
            loop.call_soon_threadsafe(self._streams.fail_all, dead)  # cause engine_error
            try:
                self._shut_down(engine)
            except Exception:
                _log.exception("engine_shutdown_failed")
        finally:
            self._pool_status = engine.pool_status()

    def _shut_down(self, engine: LLMEngine) -> None:
        """Ends the engine; a log that did not take every event is reported (one line) and kept."""
        from nanoserve.allocator.log.errors import EventLogIncompleteError

        try:
            engine.shutdown()
        except EventLogIncompleteError as exc:
            self._log_close_error = exc
            _log.error("event_log_incomplete", **exc.log_fields())
