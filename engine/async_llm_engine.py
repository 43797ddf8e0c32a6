"""AsyncLLMEngine: LLMEngine on its own thread, streams for asyncio callers.

The engine thread owns the LLMEngine (scheduler, allocator, model runner);
nothing else touches them. Work crosses threads in two places only:

    asyncio loop ──inbox (SimpleQueue) + wake-up Event──▶ engine thread
    asyncio loop ◀──loop.call_soon_threadsafe(outputs)─── engine thread

The engine thread sleeps on the Event while idle (no polling) and, while
requests run, drains the inbox before every step, so an abort frees its
blocks before the next forward pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.errors import DuplicateRequestError, EngineDeadError, QueueFullError, RequestNotFoundError
from nanoserve.engine.llm_engine import LLMEngine, PoolStatus
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.prompts import Prompt
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
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
    reason: str


class _Stop:
    pass


class AsyncLLMEngine:
    """Streams per-request outputs to asyncio code while the engine steps on a thread.

    Invariant: ``_streams`` (touched on the event loop only) holds exactly the
    requests whose caller still waits for a final output.
    """

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self._engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # request_id -> its outputs
        self._all_done: asyncio.Event | None = None  # set while _streams is empty
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._state = _State.NEW
        self._error: BaseException | None = None
        self._pool_status: PoolStatus | None = None  # published by the engine thread after each step

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
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineDeadError("engine not started")
        return self._engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops accepting requests, lets running ones finish for up to ``grace_s``
        seconds, aborts the rest, stops the thread and closes the event log."""
        if self._state in (_State.NEW, _State.STOPPED):
            self._state = _State.STOPPED
            return
        self._state = _State.DRAINING
        assert self._all_done is not None
        try:
            await asyncio.wait_for(self._all_done.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            for request_id in list(self._streams):
                self._submit(_Abort(request_id, "shutdown"))
        self._submit(_Stop())
        assert self._thread is not None
        await asyncio.to_thread(self._thread.join)
        self._state = _State.STOPPED

    # ---- requests ----------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs as they are produced; the last one is finished.

        Validation errors (InvalidRequestError, DuplicateRequestError,
        QueueFullError, EngineDeadError) are raised before the first item. If
        the caller stops iterating early or is cancelled, the request is
        aborted and its blocks freed before the engine's next step.
        """
        self._check_accepting()
        request = self.engine.process_request(request_id, prompt, sampling_params)
        if request_id in self._streams:
            raise DuplicateRequestError(f"request_id {request_id!r} is already live")
        self._check_queue_room()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        assert self._all_done is not None
        self._all_done.clear()
        if self._error is not None:  # the loop died before it could fail this stream
            self._streams.pop(request_id)
            self._mark_if_all_done()
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        self._submit(_Add(request))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has dropped the request already
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished and self._streams.pop(request_id, None) is not None:
                self._submit(_Abort(request_id, "cancelled"))
                self._mark_if_all_done()

    async def abort(self, request_id: str) -> None:
        """Aborts a live request; its stream ends with finish_reason "abort".

        Raises RequestNotFoundError when no live request has this id.
        """
        if request_id not in self._streams:
            raise RequestNotFoundError(request_id)
        self._submit(_Abort(request_id, "aborted"))

    def pool_status(self) -> PoolStatus:
        """The pool as of the engine thread's last step."""
        if self._pool_status is None:
            raise EngineDeadError("engine not started")
        return self._pool_status

    def _check_accepting(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        if self._state is _State.NEW:
            raise EngineDeadError("engine not started; await start() first")
        if self._state is not _State.RUNNING:
            raise EngineDeadError(f"engine is {self._state.value}; not accepting requests")

    def _check_queue_room(self) -> None:
        limit = self.config.scheduler.max_num_waiting
        status = self._pool_status
        num_running = status.num_running if status is not None else 0
        num_waiting = len(self._streams) - num_running  # requests handed over but not admitted
        if num_waiting >= limit:
            raise QueueFullError(f"{num_waiting} requests are waiting (max_num_waiting {limit})")

    def _submit(self, message: _Add | _Abort | _Stop) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # ---- event-loop side of the handover ------------------------------------

    def _dispatch(self, outputs: list[RequestOutput], failures: list[tuple[str, BaseException]]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # the caller went away; the engine has aborted it
            stream.put_nowait(output)
            if output.finished:
                del self._streams[output.request_id]
        for request_id, error in failures:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(error)
        self._mark_if_all_done()

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
        self._streams.clear()
        self._mark_if_all_done()

    def _mark_if_all_done(self) -> None:
        if not self._streams and self._all_done is not None:
            self._all_done.set()

    # ---- engine thread -----------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        loop = self._loop
        assert loop is not None
        try:
            while True:
                self._wakeup.clear()
                failures: list[tuple[str, BaseException]] = []
                if self._drain_inbox(engine, failures):
                    break
                if engine.has_unfinished_requests() or engine.has_pending_outputs:
                    outputs = engine.step()
                    self._pool_status = engine.pool_status()
                    loop.call_soon_threadsafe(self._dispatch, outputs, failures)
                else:
                    self._pool_status = engine.pool_status()
                    if failures:
                        loop.call_soon_threadsafe(self._dispatch, [], failures)
                    self._wakeup.wait()
            engine.shutdown()
            outputs = engine.step()  # the aborts shutdown made
            loop.call_soon_threadsafe(self._dispatch, outputs, [])
        except BaseException as exc:
            self._error = exc
            _log.exception("engine_loop_failed")
            dead = EngineDeadError(f"engine loop failed: {exc!r}")
            dead.__cause__ = exc
            loop.call_soon_threadsafe(self._fail_all, dead)
            try:
                engine.shutdown()
            except Exception:
                _log.exception("engine_shutdown_failed")
        finally:
            self._pool_status = engine.pool_status()

    def _drain_inbox(self, engine: LLMEngine, failures: list[tuple[str, BaseException]]) -> bool:
        """Applies queued adds and aborts; True when asked to stop."""
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
                    failures.append((message.request.request_id, exc))
            elif isinstance(message, _Abort):
                with contextlib.suppress(RequestNotFoundError):  # finished in the meantime
                    engine.abort(message.request_id, message.reason)
