"""The scheduler on small pools: exact chunks, block ids, preemption order.

The engine's part of a step (advance computed tokens, append a sampled
token) is played by ``_complete``, so these tests need no model.
"""

from __future__ import annotations

import pytest

from nanoserve.allocator import BlockAllocator, FreeReason
from nanoserve.engine.config import SchedulerConfig
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput

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
    assert scheduler.num_running == 2 and scheduler.num_waiting == 0


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
    assert b.status is RequestStatus.WAITING and b.block_table is None
    assert b.num_computed_tokens == 0 and b.metrics.num_preemptions == 1
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
    assert a.finished and b.token_ids == [0, 1, 2, TOKEN, TOKEN]
    out = scheduler.schedule()
    assert _chunks(out) == [("b", 0, 5, True)]
    assert b.block_table.block_ids == [3, 1, 0]


def test_a_request_alone_that_cannot_grow_preempts_itself() -> None:
    scheduler = _scheduler(num_blocks=2, block_size=2)
    a = _request("a", 4)
    scheduler.add(a)
    _complete(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # position 4 needs a third block
    assert out.chunks == [] and out.preempted == [a]
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
    assert target not in scheduler.running and target not in scheduler.waiting
