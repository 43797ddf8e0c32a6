"""LLMEngine: requests in, one scheduled forward pass per ``step()``, outputs out.

Synchronous and single-threaded by design: the scheduler, the allocator and
the model runner are touched only by the thread that calls ``step``
(AsyncLLMEngine runs it on its own thread).

One step::

    scheduler.schedule()                chunks to compute; may preempt and admit
    runner.forward(ForwardBatch)        logits for the chunks that end a sequence
    structured.token_mask(sampled)      structured outputs: each constrained row's allowed tokens
    sampler(logits, token_mask)         one token per such sequence, batched
    _verify_drafts(verified)            speculative decodes: each verified position sampled, the
                                        accepted prefix appended, rejected draft slots rolled back
    request.advance_grammar()           the constrained rows' matchers take their tokens
    request.append_token()              stop / length checks, detokenize
    scheduler.finish()                  free the blocks of finished requests
    _persist_events(step)               the allocator's events of the step go to the log as one batch
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import structlog
import torch

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.core.request import Request
from nanoserve.engine.core.sample_group import add_cumulative_logprobs, fork_prefilled
from nanoserve.engine.core.scheduler import ScheduledChunk, Scheduler
from nanoserve.engine.core.status import PoolStatus, model_info_of, pool_status_of
from nanoserve.engine.core.step_rows import build_step_rows
from nanoserve.engine.errors import (
    DuplicateRequestError,
    PrefixCacheResetRefusedError,
    RequestNotFoundError,
)
from nanoserve.engine.journal.request_journal import (
    admit_record,
    group_finish_record,
    output_record,
    rebuild_requests,
)
from nanoserve.engine.model.forward_batch import ForwardBatch
from nanoserve.engine.model.model_runner import ModelRunner
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler, SamplerOutput
from nanoserve.engine.speculative import append_accepted, make_proposer, sample_verified
from nanoserve.engine.structured.structured_outputs import StructuredOutputs
from nanoserve.engine.text.input_processor import InputProcessor
from nanoserve.engine.text.prompts import Prompt

_log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    from nanoserve.allocator.log import EventLog
    from nanoserve.engine.journal.recovery import RecoveryPlanner
    from nanoserve.engine.journal.store import JournalRecord
    from nanoserve.engine.model.runner_process import RunnerProcess
    from nanoserve.engine.text.tokenizer import Tokenizer


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Invariant between steps: every block of the pool is free or held by the
    block table of exactly one running request; finished and aborted
    requests hold none, so an idle engine's pool is all free.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        runner: ModelRunner | RunnerProcess | None = None,
        event_log: EventLog | None = None,
        recovery: RecoveryPlanner | None = None,
    ) -> None:
        """Loads the model (or takes ``runner``, already loaded from ``config``).

        event_log: the opened epoch of ``config``'s log, recovery: what its
        opening recovered from a crashed epoch; both are handed in by the entry
        point (``nanoserve.engine.core.log_setup.build_engine``), as the runner
        may be. Raises ValueError when ``config`` names a log and none is handed in.
        """
        if config.event_log.event_log_url is not None and event_log is None:
            raise ValueError(
                "event_log: config.event_log.event_log_url names a log but no opened log was handed in "
                "(build the engine with nanoserve.engine.core.log_setup.build_engine)"
            )
        self.config = config
        self.runner: ModelRunner | RunnerProcess = runner if runner is not None else ModelRunner(config)
        self.tokenizer: Tokenizer = self.runner.tokenizer
        self.model_name: str = self.runner.model_name
        self.block_size: int = self.runner.block_size
        self.num_blocks: int = self.runner.num_kv_blocks
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        self.model_info = model_info_of(self.runner)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_info, max_parallel_samples=config.scheduler.max_parallel_samples
        )
        self.recovery = recovery
        self.event_log = event_log
        self.allocator = BlockAllocator(self.num_blocks, self.block_size)
        self.scheduler = Scheduler(
            config.scheduler,
            self.allocator,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            proposer=make_proposer(config.speculative, self.runner.on_gguf_kernels),
            num_speculative_tokens=config.speculative.num_speculative_tokens,
        )
        # speculative decoding, over the engine's life: draft tokens verified, and those accepted
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.sampler = Sampler()
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, config.structured_output)
        self.grammars = self.structured.grammars
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

    def _readmit_recovered(self) -> list[Request]:
        """Queues the requests recovery took over from the crashed epoch, in admission order,
        ahead of any new request: each a preempted request that recomputes prompt + journaled
        outputs. Their ADMIT records are already in the log (committed with POOL_INIT)."""
        recovery = self.recovery
        if recovery is None or recovery.recovered_epoch is None:
            return []
        requests, unfit = rebuild_requests(recovery.recovered, recovery.recovered_epoch, self.process_request)
        for request in requests:
            self._requests[request.request_id] = request
            self.scheduler.add(request)
        if unfit and self.event_log is not None:
            self.event_log.append_batch(None, [], journal=unfit)
            # durable before the server serves: a Resume of one then reads its FINISH and the reason in it
            # (not yet written, the request would read as unfinished and running nowhere, without a reason)
            if not self.event_log.flush(self.config.event_log.event_log_close_timeout_s):
                _log.warning("requests_not_recovered_not_durable", num_ended=len(unfit))
        _log.info(
            "requests_recovered",
            epoch=recovery.recovered_epoch,
            num_recovered=len(requests),
            num_ended=len(recovery.ended) + len(unfit),  # ended by recovery's plan, or refused here
            request_ids=[request.request_id for request in requests],
            log_open_s=round(recovery.log_open_s, 3) if recovery.log_open_s is not None else None,
            journal_from_seq=recovery.journal_from_seq,
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
        running + waiting requests already number ``max_num_seqs + max_num_waiting``.
        """
        self.add_processed(self.process_request(request_id, prompt, sampling_params, arrival_time))

    def process_request(
        self,
        request_id: str,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        attach_grammar: bool = True,
    ) -> Request:
        """Tokenizes and validates a request without touching the scheduler.

        Safe to call from any thread (AsyncLLMEngine calls it on its tokenizer
        thread). A constrained request's grammar is compiled here (waiting at
        most ``structured_output_compile_timeout_s``) unless ``attach_grammar`` is
        False: then the caller attaches ``grammars.matcher(...)`` itself
        (AsyncLLMEngine waits for it off its one tokenizer thread). Raises
        InvalidRequestError.
        """
        request = self.input_processor.process(request_id, prompt, sampling_params, arrival_time, next(self._serials))
        if attach_grammar and request.sampling_params.constraint is not None:  # compiled here, off the engine thread
            request.attach_matcher(self.grammars.matcher(request.sampling_params.constraint))
        return request

    def add_processed(self, request: Request) -> None:
        """Queues a request made by ``process_request``; engine thread only."""
        if request.request_id in self._requests:
            raise DuplicateRequestError(f"request_id {request.request_id!r} is already live")
        self.scheduler.check_room()
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        self.structured.admitted(request.sampling_params.constraint)
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
        step = build_step_rows(chunks, time.monotonic())
        if step.copies:
            self.runner.copy_blocks(step.copies)  # forked blocks copied on write: their K/V rows before the writes
        batch = ForwardBatch.build(step.slices, self.block_size, self.runner.device)
        logits = self.runner.forward(batch)  # [num_rows, vocab_size] float32
        for request, first_row, start in step.prompt_rows:
            request.add_prompt_logprobs(start, logits[first_row:])
        # [k + 1, vocab_size] per verify pass
        verified = [(c, logits[first : first + len(c.draft_token_ids) + 1]) for c, first in step.verifying]
        if step.num_rows != len(step.sample_rows):
            logits = logits[step.sample_rows]  # [len(sampled), vocab_size]
        for chunk in chunks:
            if chunk.draft_token_ids:
                continue  # computed up to what its verification accepts (_accept_drafts)
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            self.scheduler.register_computed(chunk.request, chunk.num_new_tokens)  # only now is the chunk's KV written
        outputs = self._verify_drafts(verified) if verified else []
        if not step.sampled:
            return outputs
        rows, row_logits = fork_prefilled(step.sampled, self.scheduler, self._serials)
        if len(rows) != len(step.sampled):
            logits = logits[row_logits]  # [len(rows), vocab_size]: a parent's row once per sample
        result = self.sampler(logits, rows, self.structured.token_mask(rows))
        add_cumulative_logprobs(logits, rows, result.token_ids)
        now = time.monotonic()
        for request, token_id, logprob in zip(rows, result.token_ids, result.logprobs, strict=True):
            request.note_first_token(now)
            if not request.advance_grammar(token_id):  # the grammar allowed nothing: the token is discarded
                _log.info("grammar_dead_end", request_id=request.request_id, error=_matcher_error(request))
                request.abort(AbortCause.GRAMMAR)
                outputs.extend(self._end(request, FreeReason.ABORTED, now))
                continue
            request.append_token(token_id, logprob)
            outputs.extend(self._emit(request, now))
        return outputs

    def _emit(self, request: Request, now: float) -> list[RequestOutput]:
        """What ``request``'s newest tokens make, journaled: its ending when a finish check ended it,
        else its delta (a sample's as its group shows it; None of a best_of sample until the end)."""
        if request.finish_reason is not None:
            return self._end(request, FreeReason.FINISHED, now)
        group = request.group
        output = request.make_output(final=False)
        if group is not None:
            output = group.child_output(request, output)
        if output is None:
            return []
        if self.journaling and group is None:
            self._journal.append(output_record(output))
        return [output]

    def _end(self, request: Request, reason: FreeReason, now: float) -> list[RequestOutput]:
        """``_finish``, and the final output journaled (a sample's once its group has ended)."""
        ended = self._finish(request, reason, now)
        if self.journaling and ended and ended[-1].finished:
            final = ended[-1]
            self._journal.append(output_record(final) if request.group is None else group_finish_record(final))
        return ended

    def _verify_drafts(self, verified: list[tuple[ScheduledChunk, torch.Tensor]]) -> list[RequestOutput]:
        """Samples every verified position of this step's speculative decodes in one sampler call
        (``sample_verified``) and appends each request's accepted tokens.

        verified: (chunk, its logits [k + 1, vocab_size]), row i the position after draft i - 1.
        """
        targets = sample_verified(self.sampler, [(c.request, c.draft_token_ids, rows) for c, rows in verified])
        now = time.monotonic()
        return [
            out for (c, _), part in zip(verified, targets, strict=True) for out in self._accept_drafts(c, part, now)
        ]

    def _accept_drafts(self, chunk: ScheduledChunk, targets: SamplerOutput, now: float) -> list[RequestOutput]:
        """Appends the tokens a verify pass emits (``append_accepted``: through the request's finish
        checks, the rejected drafts' slots dropped, blocks only they needed freed as REJECTED_DRAFT),
        then registers the accepted blocks and emits the request's output.

        targets: the token sampled at each of the chunk's k + 1 positions, and its logprob.
        """
        request = chunk.request
        assert request.group is None, f"sample {request.request_id!r} of a parallel request drafted"
        num_appended, num_accepted = append_accepted(request, chunk.draft_token_ids, targets)
        self.num_draft_tokens += len(chunk.draft_token_ids)
        self.num_accepted_draft_tokens += num_accepted
        request.note_first_token(now)
        if request.finish_reason is None:
            self.scheduler.register_computed(request, num_appended)
        return self._emit(request, now)

    def _finish(self, request: Request, reason: FreeReason, now: float) -> list[RequestOutput]:
        """Ends ``request`` (a sample: its group too once it was the last); its outputs, the final one last."""
        self.scheduler.finish(request, reason)
        request.metrics.finished_time = now
        output = request.make_output(final=True)
        assert output is not None
        group = request.group
        if group is None or group.parent is request:
            del self._requests[request.request_id]
            return [output]
        outputs = [] if (shown := group.child_output(request, output)) is None else [shown]
        if group.done:
            parent = group.parent
            self.scheduler.finish(parent, reason)
            del self._requests[parent.request_id]
            parent.metrics.finished_time = now
            outputs.append(group.final_output())
        return outputs

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
            now = time.monotonic()
            # every sample still running ends with it; the last one's ending ends the group
            for target in [request] if request.group is None else request.group.live_children:
                target.abort(cause)
                outputs = self._end(target, FreeReason.ABORTED, now)
            assert outputs[-1].finished, "an aborted request's last output is its final one"
            self._pending_outputs.append(outputs[-1])
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
        """The pool, the queues and the log's progress now (engine thread; ``status.pool_status_of``)."""
        pool_id = self.config.event_log.pool_id
        drafts = (self.num_draft_tokens, self.num_accepted_draft_tokens)
        return pool_status_of(pool_id, self.allocator, self.scheduler, self.event_log, *drafts)

    def shutdown(self, log_close_timeout_s: float | None = None) -> None:
        """Aborts what is left, closes the runner (ends its process under ``runner_process``) and the
        event log (POOL_CLOSE). Idempotent.

        The log gets ``log_close_timeout_s`` (default: the config's
        ``event_log_close_timeout_s``) to take what waits. Raises
        EventLogIncompleteError, naming the seqs not written, when it did not
        (the store away, or the log failed); every request has ended anyway.
        """
        if self._closed:
            return
        self._closed = True
        self.structured.close()
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
        self.runner.close()  # the aborts above ran no step: nothing needs the model any more
        if log is not None:
            timeout_s = self.config.event_log.event_log_close_timeout_s
            log.close(timeout_s if log_close_timeout_s is None else log_close_timeout_s, self.allocator.snapshot())


def _matcher_error(request: Request) -> str:
    matcher = request.matcher
    return matcher.get_error() if matcher is not None else ""
