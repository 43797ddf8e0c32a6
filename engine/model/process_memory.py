"""The process's resident memory, from ``/proc/self/status`` (Linux; elsewhere None).

Start-up logs it around the weights' load so the load's own cost shows: the
resident set before (interpreter and imports), after, and the peak (VmHWM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessMemory:
    """rss_bytes: resident now (VmRSS); peak_rss_bytes: the most ever resident (VmHWM)."""

    rss_bytes: int
    peak_rss_bytes: int


def process_memory(status_path: str = "/proc/self/status") -> ProcessMemory | None:
    """Resident and peak resident bytes of this process (of ``status_path``); None where it cannot be read."""
    values: dict[str, int] = {}
    try:
        with open(status_path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024  # the file counts kB
    except OSError:
        return None
    if len(values) < 2:
        return None
    return ProcessMemory(values["VmRSS"], values["VmHWM"])


def release_free_heap() -> bool:
    """Hands the C heap's free pages back to the kernel (glibc ``malloc_trim``); False where there is none.

    glibc raises its mmap threshold as large buffers are freed, so the load's
    later transients (unpacked codes, repack inputs) come from the heap and
    stay resident after being freed until trimmed: ~28 MiB after the default model.
    A call takes microseconds once the C library has been found (the first call).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (no C library found, or not glibc); looked up once."""
    name = ctypes.util.find_library("c")  # runs ldconfig: milliseconds
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
