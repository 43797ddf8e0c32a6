"""TokenBuckets: each peer's Abort/Resume allowance, on a clock the test moves."""

from __future__ import annotations

import pytest

from nanoserve.service.grpc.read_rate_limit import TokenBuckets


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    now = [100.0]
    buckets = TokenBuckets(4.0, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(4)] == [None] * 4
    assert buckets.take("a") == pytest.approx(0.25)
    assert buckets.take("b") is None  # each peer has its own
    now[0] += 0.5  # two tokens back
    assert [buckets.take("a") for _ in range(3)] == [None, None, pytest.approx(0.25)]
    now[0] += 60.0  # never more than the burst
    assert [buckets.take("a") is None for _ in range(5)] == [True] * 4 + [False]


def test_a_rate_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="max_read_calls_per_s must be > 0, got 0"):
        TokenBuckets(0.0)
