"""What the engine reports about itself: its model (fixed at load) and its pool (changing)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.allocator import BlockAllocator
    from nanoserve.allocator.log import EventLog
    from nanoserve.engine.core.request import Request
    from nanoserve.engine.core.scheduler import Scheduler
    from nanoserve.engine.model.model_runner import ModelRunner
    from nanoserve.engine.model.runner_process import RunnerProcess


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model and the limits every request is checked against; fixed for the engine's life.

    vocab_size: the model's output vocabulary (rows of its logits), the one bound
        for every token id a request may carry.
    max_model_len: longest sequence (prompt + generated tokens), tokens.
    eos_token_ids: the ids that end generation with finish_reason "stop" and no
        stop_reason (unless ``ignore_eos``).
    max_prompt_bytes: the longest prompt text, in UTF-8 bytes, that could still
        fit in ``max_model_len``: longer texts are refused from their length
        alone, before tokenization (a server derives its message size limit
        from it).
    bos_token_id: the tokenizer's BOS id; None where it defines none.
    kv_cache_dtype: the KV cache's element type (float32, bfloat16 or float16); ``dtype``
        is the model's.
    """

    model_name: str
    dtype: str
    device: str
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    has_chat_template: bool
    eos_token_ids: tuple[int, ...]
    max_prompt_bytes: int
    bos_token_id: int | None = None
    kv_cache_dtype: str = "float32"

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request may reach, tokens: max_model_len, or the whole pool if smaller."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt, tokens: it leaves room for one generated token."""
        return self.max_seq_len - 1


@dataclass(frozen=True)
class PoolStatus:
    """The KV block pool and queues.

    num_free / num_allocated / num_running / num_waiting belong to the engine
    thread and are as of its last step (they cannot change while it is idle).
    last_seq / durable_seq: the event log's last assigned and last committed
    sequence numbers, read from the log when the status is asked for (the log's
    writer commits after the step, while the engine is idle); epoch likewise;
    None where the engine keeps no log.
    num_pending_batches / pending_bytes: the log's backlog (steps whose events
    are not yet committed, and their records' bytes), read likewise.
    num_cached / num_cached_free / num_shared: registered blocks, those of
    them free (counted in num_free too), blocks held by more than one request.
    prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in the
    prefix cache at first admissions, and those found (vLLM's names); a
    preempted request's re-admission counts in neither.
    scopes: running and waiting requests and the blocks they hold, per request-id
        scope (``ScopeUsage``), sorted by scope; as of the last step.
    num_forked_blocks / num_copied_blocks: block references parallel sampling's
    forks took, and blocks copied on write, since the engine started.
    num_draft_tokens / num_accepted_draft_tokens: speculative decoding's draft tokens
    verified, and those accepted, since the engine started (acceptance rate = their ratio).
    """

    pool_id: str
    epoch: int | None
    num_blocks: int
    block_size: int
    num_free: int
    num_allocated: int
    num_running: int
    num_waiting: int
    last_seq: int | None
    durable_seq: int | None
    num_pending_batches: int | None = None
    pending_bytes: int | None = None
    num_cached: int = 0
    num_cached_free: int = 0
    num_shared: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    enable_prefix_caching: bool = False
    scopes: tuple[ScopeUsage, ...] = ()
    num_forked_blocks: int = 0
    num_copied_blocks: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


SCOPE_SEPARATOR = "/"


def scope_of(request_id: str) -> str:
    """A request id's scope: the text before its first ``/`` ("" for an id without one). A server
    that keeps tenants apart puts the tenant there (``tenant/id``); the engine only groups by it."""
    scope, separator, _ = request_id.partition(SCOPE_SEPARATOR)
    return scope if separator else ""


@dataclass(frozen=True)
class ScopeUsage:
    """One request-id scope's share of the engine (``scope_of``), as of the last step.

    num_blocks_held counts the KV blocks in its requests' block tables: a block shared
    by prefix caching counts once for each request holding it (so the scopes' sum may
    pass ``num_allocated``); a waiting request holds none.
    """

    scope: str
    num_running: int
    num_waiting: int
    num_blocks_held: int


def scope_usage(running: Iterable[Request], waiting: Iterable[Request]) -> tuple[ScopeUsage, ...]:
    """Running and waiting requests and their blocks per request-id scope, sorted by scope (O(requests))."""
    usage: dict[str, list[int]] = {}
    for request in running:
        counts = usage.setdefault(scope_of(request.request_id), [0, 0, 0])
        counts[0] += 1
        counts[2] += request.block_table.num_blocks if request.block_table is not None else 0
    for request in waiting:
        usage.setdefault(scope_of(request.request_id), [0, 0, 0])[1] += 1
    return tuple(ScopeUsage(scope, *usage[scope]) for scope in sorted(usage))


def model_info_of(runner: ModelRunner | RunnerProcess) -> ModelInfo:
    """The loaded model's facts and limits, from its runner and tokenizer (once, at load). The longest
    prompt by bytes: the tokens that fit the context and the pool, less one, at the longest token's bytes."""
    tokenizer = runner.tokenizer
    max_prompt_tokens = min(runner.max_model_len, runner.num_kv_blocks * runner.block_size) - 1
    return ModelInfo(
        model_name=runner.model_name,
        dtype=str(runner.dtype).removeprefix("torch."),
        device=str(runner.device),
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        num_blocks=runner.num_kv_blocks,
        vocab_size=runner.vocab_size,
        has_chat_template=tokenizer.has_chat_template,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        max_prompt_bytes=max_prompt_tokens * tokenizer.max_token_bytes,
        bos_token_id=tokenizer.bos_token_id,
        kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
    )


def pool_status_of(
    pool_id: str,
    allocator: BlockAllocator,
    scheduler: Scheduler,
    log: EventLog | None,
    num_draft_tokens: int = 0,
    num_accepted_draft_tokens: int = 0,
) -> PoolStatus:
    """The pool, the queues and the log's progress as of now (the engine thread's view), with the
    engine's speculative draft tokens verified and accepted so far."""
    return PoolStatus(
        pool_id=pool_id,
        epoch=log.epoch if log is not None else None,
        num_blocks=allocator.num_blocks,
        block_size=allocator.block_size,
        num_free=allocator.num_free,
        num_allocated=allocator.num_allocated,
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        last_seq=log.last_seq if log is not None else None,
        durable_seq=log.durable_seq if log is not None else None,
        num_cached=allocator.num_cached,
        num_cached_free=allocator.num_cached_free,
        num_shared=allocator.num_shared,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        enable_prefix_caching=scheduler.enable_prefix_caching,
        scopes=scope_usage(scheduler.running, scheduler.waiting),
        num_forked_blocks=allocator.num_forked_blocks,
        num_copied_blocks=allocator.num_copied_blocks,
        num_draft_tokens=num_draft_tokens,
        num_accepted_draft_tokens=num_accepted_draft_tokens,
    )


def with_log_progress(status: PoolStatus, log: EventLog | None) -> PoolStatus:
    """``status`` with the log's progress and backlog as of now (any thread: the log's counters are
    read, not locked); ``status`` itself without a log."""
    if log is None:
        return status
    return dataclasses.replace(
        status,
        last_seq=log.last_seq,
        durable_seq=log.durable_seq,
        num_pending_batches=log.num_pending_batches,
        pending_bytes=log.pending_bytes,
    )
