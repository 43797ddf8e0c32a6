"""Small integer arithmetic shared by the allocator and the engine."""

from __future__ import annotations


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` in integers: the blocks ``numerator`` tokens fill.

    Exact for any size (no float rounding); ``denominator`` must be > 0.
    """
    return -(-numerator // denominator)
