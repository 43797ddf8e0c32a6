"""LLMEngine: requests in, one scheduled forward pass per ``step()``, outputs out.

Synchronous and single-threaded by design: the scheduler, the allocator and
the model runner are touched only by the thread that calls ``step``
(AsyncLLMEngine runs it on its own thread).

One step::

    scheduler.schedule()                chunks to compute; may preempt and admit
    runner.forward(ForwardBatch)        logits for the chunks that end a sequence
    sampler(logits)                     one token per such sequence, batched
    request.append_token()              stop / length checks, detokenize
    scheduler.finish()                  free the blocks of finished requests
    _persist_events(step)               the allocator's events of the step go to the log as one batch
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog
import torch

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.errors import (
    DuplicateRequestError,
    EventLogUnusableError,
    PrefixCacheResetRefusedError,
    QueueFullError,
    RequestNotFoundError,
)
from nanoserve.engine.forward_batch import ForwardBatch, SeqSlice
from nanoserve.engine.input_processor import InputProcessor
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.outputs import AbortCause, RequestOutput
from nanoserve.engine.prompts import Prompt, TokensPrompt
from nanoserve.engine.request import Request
from nanoserve.engine.request_journal import (
    admit_record,
    not_recovered_record,
    output_record,
    restore_request,
    sampling_params,
)
from nanoserve.engine.sampler import Sampler
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import ScheduledChunk, Scheduler
from nanoserve.engine.status import ModelInfo, PoolStatus

_log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog
    from nanoserve.allocator.log.journal import JournalRecord
    from nanoserve.allocator.log.recovery import RecoveryPlanner
    from nanoserve.engine.tokenizer import Tokenizer


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Invariant between steps: every block of the pool is free or held by the
    block table of exactly one running request; finished and aborted
    requests hold none, so an idle engine's pool is all free.
    """

    def __init__(self, config: EngineConfig, *, runner: ModelRunner | None = None) -> None:
        """Loads the model (or takes ``runner``, already loaded from ``config``).

        The event log's store is checked (and migrated) before the model
        loads, and the epoch opened after: EventLogUnusableError, naming the
        store and the cause, when either fails.
        """
        self.config = config
        self._prepare_event_log()
        self.runner = runner if runner is not None else ModelRunner(config)
        self.tokenizer: Tokenizer = self.runner.tokenizer
        self.model_name: str = self.runner.model_name
        self.block_size: int = self.runner.block_size
        self.num_blocks: int = self.runner.num_kv_blocks
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        self.model_info = ModelInfo(
            model_name=self.model_name,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            vocab_size=self.vocab_size,
            has_chat_template=self.tokenizer.has_chat_template,
            eos_token_ids=tuple(sorted(self.tokenizer.eos_token_ids)),
            max_prompt_bytes=(min(self.max_model_len, self.num_blocks * self.block_size) - 1)
            * self.tokenizer.max_token_bytes,
            bos_token_id=self.tokenizer.bos_token_id,
            kv_cache_dtype=str(self.runner.kv_cache_dtype).removeprefix("torch."),
        )
        self.input_processor = InputProcessor(self.tokenizer, self.model_info)
        self.recovery: RecoveryPlanner | None = None  # set by _open_event_log when the journal is kept
        self.event_log: EventLog | None = self._open_event_log()
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(
            config.scheduler, self.allocator, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        self.sampler = Sampler()
        # request_id -> live (unfinished) request: the one registry of requests, the one
        # arbiter of duplicate ids and queue room
        self._requests: dict[str, Request] = {}
        self._pending_outputs: list[RequestOutput] = []  # final outputs of aborted requests
        self._serials = itertools.count(1)  # Request.serial; next() on a count is atomic in CPython
        self._step = 0
        self._closed = False
        # the request journal: records of this step, handed to the log with its events
        self.journaling = self.event_log is not None and config.event_log.journal
        self._journal: list[JournalRecord] = []
        self.recovered_requests: list[Request] = self._readmit_recovered()

    def _prepare_event_log(self) -> None:
        """Checks the log's store before the model loads: its filesystem (SQLite), the schema
        (migrated first unless event_log_migrate is off), a write that changes nothing."""
        url = self.config.event_log.event_log_url
        if url is None:
            return
        from nanoserve.allocator.log import check_filesystem, probe_store

        with _unusable_log(url):
            check_filesystem(url)
            if self.config.event_log.event_log_migrate:
                from nanoserve.migrations import upgrade

                upgrade(url)
            probe_store(url)
            if self.config.event_log.journal:
                from nanoserve.allocator.log.journal import check_journal_schema

                check_journal_schema(url)

    def _open_event_log(self) -> EventLog | None:
        """Opens a new epoch of the configured log (its store was checked by ``_prepare_event_log``)."""
        log_config = self.config.event_log
        if log_config.event_log_url is None:
            return None
        from nanoserve.allocator.log import EventLog

        if log_config.journal:
            from nanoserve.allocator.log.recovery import RecoveryPlanner

            self.recovery = RecoveryPlanner(log_config.journal_retention_s)
        started_s = time.perf_counter()
        with _unusable_log(log_config.event_log_url):
            log = EventLog.open(
                log_config.event_log_url,
                pool_id=log_config.pool_id,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                model=self.model_name,
                config=_jsonable(dataclasses.asdict(self.config)),
                sync=log_config.event_log_sync,
                num_events_per_snapshot=log_config.num_events_per_snapshot,
                max_pending_batches=log_config.event_log_max_pending_batches,
                prepare_journal=self.recovery,
            )
        self._log_open_s = time.perf_counter() - started_s  # recovery (audit, journal reads) included
        return log

    def _readmit_recovered(self) -> list[Request]:
        """Queues the requests recovery took over from the crashed epoch, in admission order,
        ahead of any new request: each a preempted request that recomputes prompt + journaled
        outputs. Their ADMIT records are already in the log (committed with POOL_INIT)."""
        recovery = self.recovery
        if recovery is None or recovery.recovered_epoch is None:
            return []
        requests = []
        unfit: list[JournalRecord] = []  # requests this engine cannot take back (another model or limits)
        for history in recovery.recovered:
            prompt = TokensPrompt(list(history.admit["prompt_token_ids"]))
            try:
                request = self.process_request(history.request_id, prompt, sampling_params(history))
                request.prompt = history.admit.get("prompt")
                restore_request(history, request, recovery.recovered_epoch)
            except Exception as exc:  # the journal was written under another model or other limits
                _log.warning("request_not_recovered", request_id=history.request_id, error=str(exc))
                unfit.append(not_recovered_record(history))
                continue
            self._requests[request.request_id] = request
            self.scheduler.add(request)
            requests.append(request)
        if unfit and self.event_log is not None:
            self.event_log.append_batch(None, [], journal=unfit)
        _log.info(
            "requests_recovered",
            epoch=recovery.recovered_epoch,
            num_recovered=len(requests),
            num_ended=len(recovery.ended),
            request_ids=[request.request_id for request in requests],
            log_open_s=round(self._log_open_s, 3),
        )
        return requests

    # ---- requests in -------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request.

        Raises InvalidRequestError (naming the field and the limit),
        DuplicateRequestError when ``request_id`` is live, QueueFullError when
        ``max_num_waiting`` requests already wait.
        """
        self.add_processed(self.process_request(request_id, prompt, sampling_params, arrival_time))

    def process_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenizes and validates a request without touching the scheduler.

        Safe to call from any thread (AsyncLLMEngine calls it on its tokenizer
        thread). Raises InvalidRequestError.
        """
        return self.input_processor.process(request_id, prompt, sampling_params, arrival_time, next(self._serials))

    def add_processed(self, request: Request) -> None:
        """Queues a request made by ``process_request``; engine thread only."""
        if request.request_id in self._requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already live")
        limit = self.config.scheduler.max_num_waiting
        if self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"{self.scheduler.num_waiting} requests are waiting (max_num_waiting {limit})")
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        if self.journaling:
            self._journal.append(admit_record(request))

    # ---- stepping ----------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def has_pending_outputs(self) -> bool:
        """Final outputs of aborted requests wait to be returned by ``step``."""
        return bool(self._pending_outputs)

    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, samples; returns outputs that changed.

        A request appears when it released new text or tokens, or finished
        (including aborts since the last step).
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        if not self.scheduler.has_unfinished_requests():
            return outputs
        step = self._begin_step()
        try:
            scheduled = self.scheduler.schedule()
            if scheduled.chunks:
                outputs.extend(self._execute(scheduled.chunks))
        finally:
            self._persist_events(step)
        return outputs

    def _begin_step(self) -> int:
        """The next step number; every allocator event before it has gone to the log."""
        assert self.allocator.num_pending_events == 0, (
            f"{self.allocator.num_pending_events} allocator events were left pending across steps"
        )
        self._step += 1
        return self._step

    def _persist_events(self, step: int) -> None:
        """Hands the allocator's pending events to the event log as one batch stamped ``step``.

        Every event is taken, so none is left pending across steps; without a
        log they are dropped. The log takes a snapshot of the pool when one is due.
        """
        events = self.allocator.take_events()
        journal, self._journal = self._journal, []
        if self.event_log is not None:
            self.event_log.append_batch(step, events, self.allocator.snapshot, journal)

    def _execute(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        now = time.monotonic()
        slices = []
        sampled: list[Request] = []  # requests whose chunk yields logits, in logits-row order
        for chunk in chunks:
            request = chunk.request
            assert request.block_table is not None
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            end = chunk.start + chunk.num_new_tokens
            slices.append(
                SeqSlice(
                    request.token_ids[chunk.start : end], chunk.start, request.block_table.block_ids, chunk.needs_logits
                )
            )
            if chunk.needs_logits:
                sampled.append(request)
        batch = ForwardBatch.build(slices, self.block_size, self.runner.device)
        logits = self.runner.forward(batch)  # [len(sampled), vocab_size] float32
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            self.scheduler.register_computed(chunk.request, chunk.num_new_tokens)  # only now is the chunk's KV written
        if not sampled:
            return []
        result = self.sampler(logits, sampled)
        now = time.monotonic()
        outputs = []
        for request, token_id, logprob in zip(sampled, result.token_ids, result.logprobs, strict=True):
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.append_token(token_id, logprob)
            output: RequestOutput | None
            if request.finish_reason is not None:
                output = self._finish(request, FreeReason.FINISHED, now)
            else:
                output = request.make_output(final=False)
            if output is not None:
                outputs.append(output)
                if self.journaling:
                    self._journal.append(output_record(output))
        return outputs

    def _finish(self, request: Request, reason: FreeReason, now: float) -> RequestOutput:
        self.scheduler.finish(request, reason)
        del self._requests[request.request_id]
        request.metrics.finished_time = now
        output = request.make_output(final=True)
        assert output is not None
        return output

    def abort(self, request_id: str, cause: AbortCause, serial: int | None = None) -> None:
        """Stops a waiting or running request and frees its blocks at once.

        Its final output (finish_reason "abort", ``abort_cause`` = ``cause``)
        comes from the next ``step``. ``serial``: abort only the request of
        that serial (a stream aborting its own request must not end a newer
        request that reuses the id). Raises RequestNotFoundError when no live
        request has this id (and serial).
        """
        request = self._requests.get(request_id)
        if request is None or (serial is not None and request.serial != serial):
            raise RequestNotFoundError(f"request_id: no live request {request_id!r}")
        _log.debug(
            "request_aborted", request_id=request_id, cause=cause.value, num_output_tokens=request.num_output_tokens
        )
        request.abort(cause)
        # Frees outside a scheduler step get a step of their own in the log.
        step = self._begin_step()
        try:
            output = self._finish(request, FreeReason.ABORTED, time.monotonic())
            self._pending_outputs.append(output)
            if self.journaling:
                self._journal.append(output_record(output))
        finally:
            self._persist_events(step)

    def reset_prefix_cache(self, owner: str = "reset_prefix_cache") -> int:
        """Drops every cached-free block's key (one CACHE_RESET event, a step of its own in the log).

        Returns the blocks reset. Raises PrefixCacheResetRefusedError while any
        block is held (a held block's key may be shared at any moment), and
        when prefix caching is off.
        """
        if not self.scheduler.enable_prefix_caching:
            raise PrefixCacheResetRefusedError("prefix caching is off (--no-enable-prefix-caching): nothing to reset")
        num_held = self.allocator.num_allocated
        num_cached_free = self.allocator.num_cached_free
        if num_held:
            raise PrefixCacheResetRefusedError(
                f"{num_held} blocks are held by {self.scheduler.num_running} running requests; "
                "reset the prefix cache when the server is idle"
            )
        step = self._begin_step()
        try:
            assert self.allocator.reset_prefix_cache(owner), "the allocator refused a reset with no block held"
        finally:
            self._persist_events(step)
        return num_cached_free

    # ---- status and shutdown ----------------------------------------------

    def pool_status(self) -> PoolStatus:
        log = self.event_log
        return PoolStatus(
            pool_id=self.config.event_log.pool_id,
            epoch=log.epoch if log is not None else None,
            num_blocks=self.allocator.num_blocks,
            block_size=self.allocator.block_size,
            num_free=self.allocator.num_free,
            num_allocated=self.allocator.num_allocated,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            last_seq=log.last_seq if log is not None else None,
            durable_seq=log.durable_seq if log is not None else None,
            num_cached=self.allocator.num_cached,
            num_cached_free=self.allocator.num_cached_free,
            num_shared=self.allocator.num_shared,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            enable_prefix_caching=self.scheduler.enable_prefix_caching,
        )

    def shutdown(self, log_close_timeout_s: float | None = None) -> None:
        """Aborts what is left and closes the event log (POOL_CLOSE). Idempotent.

        The log gets ``log_close_timeout_s`` (default: the config's
        ``event_log_close_timeout_s``) to take what waits. Raises
        EventLogIncompleteError, naming the seqs not written, when it did not
        (the store away, or the log failed); every request has ended anyway.
        """
        if self._closed:
            return
        self._closed = True
        log = self.event_log
        if log is not None:
            log.unbound()  # the aborts below must not wait for room in a stalled log
        for request_id in list(self._requests):
            try:
                self.abort(request_id, AbortCause.SHUTDOWN)
            except Exception as exc:  # a failed log: the request has ended, its events are reported lost
                if log is None or not log.failed:
                    raise
                _log.debug("abort_not_logged", request_id=request_id, error=str(exc))
        if log is not None:
            timeout_s = self.config.event_log.event_log_close_timeout_s
            log.close(timeout_s if log_close_timeout_s is None else log_close_timeout_s, self.allocator.snapshot())


@contextlib.contextmanager
def _unusable_log(url: str) -> Iterator[None]:
    """Turns every failure to prepare or open the log at ``url`` into EventLogUnusableError (one line)."""
    from nanoserve.allocator.log.errors import safe_url, store_cause

    try:
        yield
    except EventLogUnusableError:
        raise
    except Exception as exc:
        import sqlalchemy as sa

        lines = str(exc).strip().splitlines()
        cause = store_cause(exc) if isinstance(exc, sa.exc.SQLAlchemyError) else lines[0] if lines else ""
        raise EventLogUnusableError(safe_url(url), cause or type(exc).__name__) from exc


def _jsonable(value: Any) -> Any:
    """``value`` with torch dtypes as their names and tuples as lists: a JSON value."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    return value
