"""The allocator's one domain error: the pool ran out of blocks."""

from __future__ import annotations


class KVCacheExhausted(RuntimeError):
    """The pool has fewer free blocks than a request needs.

    ``requested`` and ``available`` are block counts. Nothing was reserved. The
    scheduler catches this by name (to preempt or to wait); it never leaves the
    engine.
    """

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"KV cache exhausted: requested {requested} blocks, {available} free")
        self.requested = requested
        self.available = available

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return (type(self), (self.requested, self.available))
