"""The speculative decoding counters follow the engine's running totals."""

from __future__ import annotations

from nanoserve.service.grpc.metrics import ServerMetrics


def test_draft_and_accepted_counters_advance_to_the_engine_totals() -> None:
    metrics = ServerMetrics()
    metrics.observe_speculation(12, 5)
    metrics.observe_speculation(20, 9)
    metrics.observe_speculation(20, 9)  # a status read twice is not counted twice
    sample = metrics.registry.get_sample_value
    assert sample("nanoserve_speculative_draft_tokens_total") == 20.0
    assert sample("nanoserve_speculative_accepted_tokens_total") == 9.0
