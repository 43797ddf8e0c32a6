"""The scheduler gives drafts only the budget and blocks left after every other request: exact chunks and blocks."""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.core.request import Request
from nanoserve.engine.core.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sampling.params import SamplingParams

DRAFTS = [7, 8, 9]


class FixedProposer:
    """Proposes DRAFTS (cut to what is asked for) and remembers each call's (num tokens, num drafts asked)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        self.calls.append((len(token_ids), num_tokens))
        return DRAFTS[:num_tokens]


class CharDecoder:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _request(request_id: str, max_tokens: int = 100, prompt: tuple[int, ...] = (1, 2, 3), **params: object) -> Request:
    return Request(
        request_id,
        list(prompt),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        eos_token_ids=[],
        decoder=CharDecoder(),
    )


def _scheduler(num_blocks: int, **config: int) -> tuple[Scheduler, FixedProposer]:
    proposer = FixedProposer()
    allocator = BlockAllocator(num_blocks, block_size=2)
    return Scheduler(SchedulerConfig(**config), allocator, proposer=proposer, num_speculative_tokens=3), proposer


def _chunks(out: SchedulerOutput) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(c.request.request_id, c.start, c.num_new_tokens, c.draft_token_ids) for c in out.chunks]


def _prefill(scheduler: Scheduler, *requests: Request) -> None:
    """Admit and prefill ``requests`` (3 prompt tokens each), each then holding one sampled token."""
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()
    assert _chunks(out) == [(r.request_id, 0, 3, ()) for r in requests]  # a prefill never drafts
    for request in requests:
        request.num_computed_tokens = 3
        request.append_token(5, None)


def test_a_decode_grows_its_table_by_the_drafts() -> None:
    scheduler, proposer = _scheduler(num_blocks=8)
    a = _request("a")
    _prefill(scheduler, a)
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, (7, 8, 9))]
    assert proposer.calls == [(4, 3)]
    assert a.block_table is not None
    assert (a.block_table.block_ids, a.block_table.num_tokens) == ([0, 1, 2, 3], 7)  # 4 tokens + 3 drafts


def test_drafts_take_only_the_budget_left() -> None:
    scheduler, proposer = _scheduler(num_blocks=8, max_num_batched_tokens=3)
    _prefill(scheduler, _request("a"))
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, (7, 8))]
    assert proposer.calls == [(4, 2)]


def test_drafts_never_pass_max_tokens() -> None:
    scheduler, proposer = _scheduler(num_blocks=8)
    _prefill(scheduler, _request("a", max_tokens=3))  # 1 generated, 2 to go: the pass emits one more than it accepts
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, (7,))]
    assert proposer.calls == [(4, 1)]


def test_a_full_pool_gives_no_drafts_and_preempts_nobody() -> None:
    scheduler, _ = _scheduler(num_blocks=4)
    a, b = _request("a"), _request("b")
    _prefill(scheduler, a, b)  # blocks 0, 1 and 2, 3: the pool is full
    out = scheduler.schedule()
    assert _chunks(out) == [("a", 3, 1, ()), ("b", 3, 1, ())]
    assert out.preempted == []
    assert scheduler.allocator.num_free == 0


def test_the_oldest_decode_drafts_first_with_the_blocks_left() -> None:
    scheduler, _ = _scheduler(num_blocks=6)
    a, b = _request("a"), _request("b")
    _prefill(scheduler, a, b)  # 2 blocks free
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, (7, 8, 9)), ("b", 3, 1, ())]
    assert a.block_table is not None
    assert a.block_table.block_ids == [0, 1, 4, 5]  # the two blocks b left free


def test_requests_asking_for_prompt_logprobs_do_not_speculate() -> None:
    scheduler, proposer = _scheduler(num_blocks=8)
    _prefill(scheduler, _request("a", prompt_logprobs=1))
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, ())]
    assert proposer.calls == []


def test_drafts_evict_no_cached_free_block() -> None:
    proposer = FixedProposer()
    allocator = BlockAllocator(6, block_size=2)
    scheduler = Scheduler(
        SchedulerConfig(), allocator, enable_prefix_caching=True, proposer=proposer, num_speculative_tokens=3
    )
    cached = _request("cached")
    _prefill(scheduler, cached)
    scheduler.register_computed(cached, 3)  # block 0 (tokens 1, 2) is registered
    scheduler.finish(cached, FreeReason.FINISHED)  # block 0 cached-free, block 1 back on the free stack
    a, b = _request("a", prompt=(9, 8, 7)), _request("b", prompt=(6, 5, 4))  # prompts that miss the cache
    _prefill(scheduler, a, b)  # blocks 1, 2 and 3, 4: block 5 never cached, block 0 cached-free
    assert (allocator.num_free, allocator.num_cached_free) == (2, 1)
    assert _chunks(scheduler.schedule()) == [("a", 3, 1, ()), ("b", 3, 1, ())]  # 3 drafts need 2 blocks: 1 left
    assert allocator.num_cached_free == 1
