"""The scheduler on small pools: exact chunks, block ids, preemption order.

The engine's part of a step (advance computed tokens, append a sampled
token) is played by ``_complete``, so these tests need no model.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.core.request import Request, RequestStatus
from nanoserve.engine.core.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.sampling.params import SamplingParams

TOKEN = 5  # the token every request "samples"


class CharDecoder:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _request(request_id: str, num_prompt_tokens: int, max_tokens: int = 100) -> Request:
    return Request(
        request_id,
        list(range(num_prompt_tokens)),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        eos_token_ids=[],
        decoder=CharDecoder(),
    )


def _scheduler(num_blocks: int, block_size: int = 2, **config: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockAllocator(num_blocks, block_size))


def _chunks(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request.request_id, c.start, c.num_new_tokens, c.needs_logits) for c in out.chunks]


def _complete(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward pass."""
    for chunk in out.chunks:
        needs_logits = chunk.needs_logits
        chunk.request.num_computed_tokens += chunk.num_new_tokens
        if needs_logits:
            chunk.request.append_token(TOKEN, None)
            if chunk.request.finish_reason is not None:
                scheduler.finish(chunk.request, FreeReason.FINISHED)


def test_admits_in_order_and_gives_blocks_lifo() -> None:
    scheduler = _scheduler(num_blocks=8)
    a, b = _request("a", 3), _request("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert _chunks(out) == [("a", 0, 3, True), ("b", 0, 4, True)]
    assert a.block_table.block_ids == [0, 1]
    assert b.block_table.block_ids == [2, 3]
    assert scheduler.num_running == 2
    assert scheduler.num_waiting == 0


def test_max_num_seqs_caps_running() -> None:
    scheduler = _scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add(_request("a", 2))
    scheduler.add(_request("b", 2))
    assert _chunks(scheduler.schedule()) == [("a", 0, 2, True)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    scheduler = _scheduler(num_blocks=8, max_num_batched_tokens=4)
    a = _request("a", 10)
    scheduler.add(a)
    seen = []
    for _ in range(3):
        out = scheduler.schedule()
        seen.append(_chunks(out))
        _complete(scheduler, out)
    assert seen == [[("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)]]
    assert a.num_output_tokens == 1
    assert a.block_table.block_ids == [0, 1, 2, 3, 4]


def test_decodes_are_scheduled_before_a_prefill_chunk() -> None:
    scheduler = _scheduler(num_blocks=16, max_num_batched_tokens=4)
    a = _request("a", 2)
    scheduler.add(a)
    _complete(scheduler, scheduler.schedule())
    scheduler.add(_request("b", 9))
    out = scheduler.schedule()
    assert _chunks(out) == [("a", 2, 1, True), ("b", 0, 3, False)]


def test_exhausted_pool_preempts_most_recently_admitted() -> None:
    scheduler = _scheduler(num_blocks=4, block_size=2)
    a, b = _request("a", 3), _request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    _complete(scheduler, scheduler.schedule())  # prefill: a [0, 1], b [2, 3]
    _complete(scheduler, scheduler.schedule())  # decode position 3 fits both last blocks
    out = scheduler.schedule()  # position 4 needs a new block each: pool empty
    assert out.preempted == [b]
    assert _chunks(out) == [("a", 4, 1, True)]
    assert a.block_table.block_ids == [0, 1, 3]  # b's blocks came back, 3 on top
    assert b.status is RequestStatus.WAITING
    assert b.block_table is None
    assert b.num_computed_tokens == 0
    assert b.metrics.num_preemptions == 1
    assert list(scheduler.waiting) == [b]
    assert scheduler.allocator.num_free == 1


def test_preempted_request_recomputes_prompt_and_generated_tokens() -> None:
    scheduler = _scheduler(num_blocks=4, block_size=2)
    a, b = _request("a", 3, max_tokens=3), _request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):
        _complete(scheduler, scheduler.schedule())
    # a finished after its 3rd token and freed its blocks; b comes back as 5 tokens
    assert a.finished
    assert b.token_ids == [0, 1, 2, TOKEN, TOKEN]
    out = scheduler.schedule()
    assert _chunks(out) == [("b", 0, 5, True)]
    assert b.block_table.block_ids == [3, 1, 0]


def test_a_request_alone_that_cannot_grow_preempts_itself() -> None:
    scheduler = _scheduler(num_blocks=2, block_size=2)
    a = _request("a", 4)
    scheduler.add(a)
    _complete(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # position 4 needs a third block
    assert out.chunks == []
    assert out.preempted == [a]
    assert scheduler.allocator.num_free == 2


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = _scheduler(num_blocks=4, block_size=2)
    a, b = _request("a", 3), _request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    _complete(scheduler, scheduler.schedule())
    _complete(scheduler, scheduler.schedule())
    scheduler.add(_request("c", 1))
    out = scheduler.schedule()
    assert out.preempted == [b]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


@pytest.mark.parametrize("admitted", [True, False])
def test_finish_frees_blocks_of_running_or_waiting_request(admitted: bool) -> None:
    scheduler = _scheduler(num_blocks=4, max_num_seqs=1)
    a, b = _request("a", 3), _request("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    target = a if admitted else b
    scheduler.finish(target, FreeReason.ABORTED)
    assert target.status is RequestStatus.FINISHED
    assert scheduler.allocator.num_free == (4 if admitted else 2)
    assert target not in scheduler.running
    assert target not in scheduler.waiting


@st.composite
def _workloads(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """Operations: ("add", prompt_len, max_tokens), ("abort", index, 0), ("step", 0, 0)."""
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["add", "add", "abort", "step", "step", "step"]))
        if kind == "add":
            ops.append(("add", draw(st.integers(1, 12)), draw(st.integers(1, 8))))
        elif kind == "abort":
            ops.append(("abort", draw(st.integers(0, 20)), 0))
        else:
            ops.append(("step", 0, 0))
    return ops


@settings(max_examples=150, deadline=None)
@given(ops=_workloads(), num_blocks=st.integers(6, 12), budget=st.integers(4, 16), max_num_seqs=st.integers(1, 4))
def test_any_workload_keeps_block_ownership_exact_and_ends_all_free(
    ops: list[tuple[str, int, int]], num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    scheduler = _scheduler(num_blocks, block_size=2, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    requests: list[Request] = []

    def check() -> None:
        owned = {}
        for request in scheduler.running:
            assert request.block_table is not None
            assert request.block_table.num_tokens == request.num_computed_tokens
            for block_id in request.block_table.block_ids:
                assert block_id not in owned
                owned[block_id] = request.request_id
        assert all(r.block_table is None and r.num_computed_tokens == 0 for r in scheduler.waiting)
        assert {b: scheduler.allocator.owner_of(b) for b in owned} == owned
        assert scheduler.allocator.num_free + len(owned) == num_blocks

    for kind, a, b in ops:
        if kind == "add":  # a request that fits the pool alone, as the engine guarantees
            prompt_len = min(a, num_blocks * 2 - b)
            requests.append(_request(f"r{len(requests)}", max(prompt_len, 1), max_tokens=b))
            scheduler.add(requests[-1])
        elif kind == "abort" and a < len(requests) and not requests[a].finished:
            scheduler.finish(requests[a], FreeReason.ABORTED)
        elif kind == "step":
            _complete(scheduler, scheduler.schedule())
        check()
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        _complete(scheduler, scheduler.schedule())
        check()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.allocator.num_free == num_blocks
    assert all(r.finished for r in requests)
    for request in requests:  # aborted ones stop early; the rest generate exactly max_tokens
        assert request.num_output_tokens <= request.max_tokens


def _prefix_caching_scheduler(num_blocks: int, block_size: int = 2) -> Scheduler:
    return Scheduler(SchedulerConfig(), BlockAllocator(num_blocks, block_size), enable_prefix_caching=True)


def test_register_computed_registers_the_blocks_a_chunk_fills() -> None:
    scheduler = _prefix_caching_scheduler(num_blocks=8)
    request = _request("a", 5)
    scheduler.add(request)
    out = scheduler.schedule()
    _complete(scheduler, out)
    scheduler.register_computed(request, 5)
    assert request.block_table is not None
    assert request.block_table.num_registered_blocks == 2  # positions 0-3


def test_register_computed_skips_a_chunk_that_fills_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = _prefix_caching_scheduler(num_blocks=8)
    request = _request("a", 5)
    scheduler.add(request)
    _complete(scheduler, scheduler.schedule())
    scheduler.register_computed(request, 5)
    _complete(scheduler, scheduler.schedule())  # the decode of position 5 fills block 2
    scheduler.register_computed(request, 1)
    assert request.block_table is not None
    assert request.block_table.num_registered_blocks == 3

    def fail(block_size: int) -> list[object]:
        raise AssertionError("keys updated for a chunk that filled no block")

    monkeypatch.setattr(request, "block_keys", fail)
    _complete(scheduler, scheduler.schedule())  # position 6 starts block 3
    scheduler.register_computed(request, 1)
    assert request.block_table.num_registered_blocks == 3
