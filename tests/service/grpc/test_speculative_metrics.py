"""The speculative decoding counters: metrics follow the engine's running totals, GetPoolStatus carries them."""

from __future__ import annotations

from nanoserve.engine.core.status import PoolStatus
from nanoserve.service.grpc import allocation_convert
from nanoserve.service.grpc.metrics import ServerMetrics


def test_draft_and_accepted_counters_advance_to_the_engine_totals() -> None:
    metrics = ServerMetrics()
    metrics.observe_speculation(12, 5)
    metrics.observe_speculation(20, 9)
    metrics.observe_speculation(20, 9)  # a status read twice is not counted twice
    sample = metrics.registry.get_sample_value
    assert sample("nanoserve_speculative_draft_tokens_total") == 20.0
    assert sample("nanoserve_speculative_accepted_tokens_total") == 9.0


def test_pool_status_carries_the_draft_counts_on_the_wire() -> None:
    status = PoolStatus(
        pool_id="p",
        epoch=None,
        num_blocks=8,
        block_size=4,
        num_free=8,
        num_allocated=0,
        num_running=0,
        num_waiting=0,
        last_seq=None,
        durable_seq=None,
        num_draft_tokens=40,
        num_accepted_draft_tokens=31,
    )
    response = allocation_convert.to_pool_status(status)
    assert (response.num_draft_tokens, response.num_accepted_draft_tokens) == (40, 31)
