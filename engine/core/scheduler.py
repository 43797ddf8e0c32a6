"""Iteration-level scheduling with chunked prefill and preemption by recompute.

Each step the scheduler decides which requests run and how many of their
tokens go through the model (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al.
SOSP 2023). A request is simply "``num_tokens`` tokens, of which
``num_computed_tokens`` have K/V in the cache": a decode computes the one
newest token, a prefill computes a chunk of the prompt, a preempted request
recomputes prompt + generated tokens from scratch. The last scheduled chunk of
a request yields logits, and the sampler adds its next token.

Order within a step, under the ``max_num_batched_tokens`` budget:
  1. running decodes (one token each), oldest first;
  2. running prefills (a chunk each);
  3. waiting requests, front first, while ``max_num_seqs`` and the pool allow.
Decodes go first so a long prompt being prefilled never stalls them.

With prefix caching, admission first looks the request's full blocks up
(all but the block of its last token, so at least one token is computed
and yields logits) and shares the hits: the request starts with
``num_computed_tokens`` at the end of the cached prefix and computes only
the tail. Nothing is taken unless the tail's blocks fit too.

A request with several samples (``SamplingParams.n`` / ``best_of``) is
prefilled once; then ``fork`` puts its samples in its place, each holding its
prompt's blocks by reference (``engine/core/sample_group.py``). A preempted
sample is admitted again by forking its parent's prompt table once more and
recomputing only its own tokens.

With speculative decoding on (``engine/speculative/``), what is left of the
budget and the pool after all of that goes to draft tokens: a decode of a
request that may speculate grows by up to ``num_speculative_tokens`` drafts
that its proposer guessed, verified by the same forward pass. Drafts never
preempt, delay or keep out another request.

When a running request needs a block and the pool raises KVCacheExhausted,
the most recently admitted running request is preempted: its blocks are
freed (reason PREEMPTED) and it goes to the front of the waiting queue. No
request is admitted in a step that preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanoserve.allocator import BlockAllocator, BlockKey, BlockTable, FreeReason, KVCacheExhausted, cdiv
from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.core.request import Request, RequestStatus
from nanoserve.engine.errors import QueueFullError
from nanoserve.engine.speculative import Proposer


def may_speculate(request: Request) -> bool:
    """Whether ``request`` may decode speculatively: not a parallel request (n, best_of: the parent forks at
    its prompt's last chunk, which may be one token long after a prefix-cache hit) nor one of its samples,
    not constrained (structured outputs) and not asking for prompt logprobs."""
    return (
        request.group is None
        and request.sampling_params.num_samples == 1
        and request.matcher is None
        and request.sampling_params.constraint is None
        and request.prompt_logprobs is None
    )


def _forked_parent(request: Request) -> Request | None:
    """The parent holding the prompt of ``request``, a sample of a forked request; None for any other."""
    group = request.group
    if group is None or group.parent is request or group.parent.status is not RequestStatus.FORKED:
        return None
    return group.parent


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` to compute this step, from ``start``; a decode
    that speculates also computes ``draft_token_ids`` after them (its table holds their slots)."""

    request: Request
    start: int  # position of the first token of the chunk (== num_computed_tokens)
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: guessed tokens to verify this step

    @property
    def needs_logits(self) -> bool:
        """The chunk reaches the newest token, so the request samples its next one."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # in forward-batch order
    preempted: list[Request]  # requests preempted this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


class Scheduler:
    """Waiting and running queues over one block pool.

    Invariants: a request is in at most one queue; running requests hold a
    block table, waiting ones hold no blocks; ``running`` is in admission
    order, so its last element is the first to be preempted.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        *,
        enable_prefix_caching: bool = False,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.enable_prefix_caching = enable_prefix_caching
        self.proposer = proposer  # speculative decoding's draft tokens (None: off)
        self.num_speculative_tokens = num_speculative_tokens  # drafts per request per step, at most
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # prompt tokens looked up at first admissions, and those found cached (vLLM's
        # prefix_cache_queries / prefix_cache_hits); a preempted request's recompute counts in neither
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def check_room(self) -> None:
        """Raises QueueFullError when running + waiting requests already number ``max_num_seqs +
        max_num_waiting``: a waiting request that a free running slot will take at the next step is
        not queued, so the engine holds at most that many, whatever step they arrive between."""
        config = self.config
        if self.num_running + self.num_waiting >= config.max_num_seqs + config.max_num_waiting:
            raise QueueFullError(
                f"{self.num_running} requests are running and {self.num_waiting} waiting"
                f" (max_num_seqs {config.max_num_seqs} + max_num_waiting {config.max_num_waiting})"
            )

    def add(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING
        assert request.block_table is None
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Picks this step's chunks, growing block tables and preempting as needed."""
        budget = self.config.max_num_batched_tokens
        chunks: dict[int, ScheduledChunk] = {}  # id(request) -> chunk, in batch order
        preempted: list[Request] = []
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow(request, num_new, chunks, preempted):
                continue
            chunks[id(request)] = ScheduledChunk(request, request.num_computed_tokens, num_new)
            budget -= num_new
        budget = self.config.max_num_batched_tokens - sum(c.num_new_tokens for c in chunks.values())
        if not preempted:
            budget = self._admit(budget, chunks)
        if self.proposer is not None:
            self._add_drafts(budget, chunks)
        return SchedulerOutput(list(chunks.values()), preempted)

    def _add_drafts(self, budget: int, chunks: dict[int, ScheduledChunk]) -> None:
        """Extends this step's decodes that may speculate by their proposer's drafts, oldest first,
        while ``budget`` tokens and never-cached free blocks are left (a draft never makes another
        request wait, nor evicts a cached prefix).

        A request drafts at most the tokens it may still generate minus one (the verify pass
        emits one more than it accepts), so no draft passes max_tokens or max_model_len.
        """
        assert self.proposer is not None
        for key, chunk in list(chunks.items()):
            if budget <= 0:
                return
            request = chunk.request
            if chunk.num_new_tokens != 1 or not chunk.needs_logits or not may_speculate(request):
                continue
            num_drafts = min(self.num_speculative_tokens, budget, request.max_tokens - request.num_output_tokens - 1)
            if num_drafts <= 0:
                continue
            drafts = self.proposer.propose(request.token_ids, num_drafts)
            if not drafts:
                continue
            table = request.block_table
            assert table is not None
            # only never-cached free blocks: a draft evicts no prefix-cache entry
            if table.blocks_needed(len(drafts)) > self.allocator.num_free - self.allocator.num_cached_free:
                continue
            table.append_tokens(len(drafts), FreeReason.DRAFT)  # its ALLOCATE_FOR, if any, says "draft" in the log
            chunks[key] = ScheduledChunk(request, chunk.start, 1, tuple(drafts))
            budget -= len(drafts)

    def _grow(
        self, request: Request, num_new: int, chunks: dict[int, ScheduledChunk], preempted: list[Request]
    ) -> bool:
        """Grows ``request``'s block table by ``num_new`` tokens, preempting others when
        the pool is exhausted. False when ``request`` itself had to be preempted."""
        assert request.block_table is not None
        while True:
            try:
                request.block_table.append_tokens(num_new)
                return True
            except KVCacheExhausted:
                victim = self.running[-1]
                chunks.pop(id(victim), None)
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return False

    def _admit(self, budget: int, chunks: dict[int, ScheduledChunk]) -> int:
        block_size = self.allocator.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            parent = _forked_parent(request)
            if parent is not None:  # a preempted sample: forks its prompt again, recomputes only its own tokens
                refork = self._refork(request, parent, budget)
                if refork is None:
                    break
                table, num_cached, num_new = refork
                self.waiting.popleft()
                self._start(request, table, num_cached, num_new, chunks)
                budget -= num_new
                continue
            keys = self._prefix_keys(request)
            num_hits, num_hits_free = self.allocator.count_prefix_hits(request.request_id, keys) if keys else (0, 0)
            num_cached = num_hits * block_size
            num_new = min(request.num_tokens - num_cached, budget)
            # the hits that are cached-free stop being free once shared: the tail must fit in the rest
            if cdiv(num_cached + num_new, block_size) - num_hits > self.allocator.num_free - num_hits_free:
                break
            table = BlockTable(self.allocator, request.request_id)
            if num_hits:
                assert table.share_prefix(keys[:num_hits]) == num_cached, "the pool changed between count and share"
            table.append_tokens(num_new)
            self.waiting.popleft()
            if self.enable_prefix_caching and request.metrics.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
                request.metrics.num_cached_tokens = num_cached
            self._start(request, table, num_cached, num_new, chunks)
            budget -= num_new
        return budget

    def _start(
        self,
        request: Request,
        table: BlockTable,
        num_cached: int,
        num_new: int,
        chunks: dict[int, ScheduledChunk],
    ) -> None:
        """``request`` (taken off ``waiting``) runs with ``table``, holding ``num_cached`` tokens computed;
        its first chunk, ``num_new`` tokens from there, joins this step's ``chunks``."""
        request.block_table = table
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        chunks[id(request)] = ScheduledChunk(request, num_cached, num_new)

    def _refork(self, request: Request, parent: Request, budget: int) -> tuple[BlockTable, int, int] | None:
        """(table, tokens it holds computed, tokens to compute now) of a preempted sample forked again from its
        parent's prompt table; None when the pool cannot take its copy and new blocks now (nothing changes)."""
        assert parent.block_table is not None
        prompt_table = parent.block_table
        num_shared = prompt_table.num_tokens
        num_new = min(request.num_tokens - num_shared, budget)
        num_copies = 1 if num_shared % self.allocator.block_size else 0  # its partly filled last block
        if prompt_table.blocks_needed(num_new) + num_copies > self.allocator.num_free:
            return None
        table = prompt_table.fork(request.request_id)
        table.append_tokens(num_new)
        return table, num_shared, num_new

    def _prefix_keys(self, request: Request) -> list[BlockKey]:
        """The keys of the request's blocks a cache hit may cover: every full block but the one
        holding its last token (that token is always computed, to yield logits)."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        return request.block_keys(self.allocator.block_size)[: (request.num_tokens - 1) // self.allocator.block_size]

    def register_computed(self, request: Request, num_new_tokens: int) -> None:
        """Register the request's full blocks whose KV the finished forward pass wrote.

        num_new_tokens: the tokens of the chunk just computed (``num_computed_tokens``
        already counts them). A chunk that fills no block (most decodes) has nothing
        to register: the blocks full before it were registered when the chunk that
        filled them finished, or shared at admission. Skipping it spares the keys'
        update each decode step.
        """
        block_size = self.allocator.block_size
        num_computed = request.num_computed_tokens
        if num_computed // block_size == (num_computed - num_new_tokens) // block_size:
            return
        if self.enable_prefix_caching and request.block_table is not None:
            request.block_table.register(request.block_keys(block_size), num_computed)

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and puts it at the front of the waiting queue."""
        assert request.status is RequestStatus.RUNNING
        assert request.block_table is not None
        self.running.remove(request)
        request.block_table.release(FreeReason.PREEMPTED)
        request.block_table = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Replaces the running ``parent`` (its prompt just computed) by ``children`` holding its blocks.

        Each child gets ``parent``'s block table forked (FORK events; the
        partly filled last block is copied at each child's first write) and
        its place in ``running``, so the children are preempted before older
        requests. The parent becomes FORKED: it keeps its table, unscheduled,
        until ``finish``.
        """
        assert parent.status is RequestStatus.RUNNING
        assert parent.block_table is not None
        position = self.running.index(parent)
        for child in children:
            child.block_table = parent.block_table.fork(child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
        self.running[position : position + 1] = children
        parent.status = RequestStatus.FORKED

    def finish(self, request: Request, reason: FreeReason) -> None:
        """Removes a request from whichever queue holds it and frees its blocks."""
        if request.status is RequestStatus.FORKED:
            assert request.block_table is not None
            request.block_table.release(reason)
            request.block_table = None
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            assert request.block_table is not None
            request.block_table.release(reason)
            request.block_table = None
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
