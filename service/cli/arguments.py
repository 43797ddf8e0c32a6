"""argparse types of bounded numbers: a flag outside its range is refused by argparse (exit 2, the usage
line, ``argument --max-tokens: must be >= 1, got 0``) before the command connects anywhere.

The bounds are the engine's (``nanoserve.engine.sampling.limits``) and the contract's wire types
(int32, int64): a number protobuf cannot carry would otherwise end in a traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

INT32_MAX = 2**31 - 1  # the contract's int32 fields (max_tokens, n, logprobs, ...)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # its int64 (seed)


def integer(low: int, high: int = INT32_MAX, also: int | None = None) -> Callable[[str], int]:
    """An int in [low, high] (or the one value ``also``, e.g. -1 for "as many as fit")."""
    allowed = f">= {low}" if high == INT32_MAX else f"in [{low}, {high}]"
    if also is not None:
        allowed = f"{also} or {allowed}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None
        if value > high and high == INT32_MAX:
            raise argparse.ArgumentTypeError(f"must be at most {INT32_MAX} (the API's int32), got {value}")
        if not (low <= value <= high or value == also):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def number(low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (``low_open``: (low, high])."""
    if high == math.inf:
        allowed = f"> {low:g}" if low_open else f">= {low:g}"
    else:
        allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        if not (math.isfinite(value) and above_low and value <= high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    parse.__name__ = "number"
    return parse
