"""Where the model runs: resolving ``device`` and ``dtype`` settings to torch objects."""

from __future__ import annotations

import functools

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; otherwise the named device.

    Raises ValueError when ``cuda`` is asked for on a machine without it.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


@functools.cache
def cpu_supports_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX).

    Reads /proc/cpuinfo flags where present, else torch's own capability probe.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = set()
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
        if flags:
            return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")  # older/newer torch spellings


def resolve_dtype(name: str, device: torch.device, cpu_quantized_kernels: bool = False) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA and on bf16-capable CPUs, float32 otherwise.

    cpu_quantized_kernels: the linear weights run on nanoserve's GGUF block kernels, which
    (like its paged attention and RMSNorm kernels) take float32; ``auto`` is then float32
    on every CPU: bf16 activations would only add conversions around each kernel.
    Raises ValueError for a name outside ``auto``, ``float32``, ``bfloat16``, ``float16``.
    """
    if name == "auto":
        if device.type == "cpu" and cpu_quantized_kernels:
            return torch.float32
        if device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {('auto', *_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, cpu_quantized_kernels: bool = False) -> torch.dtype:
    """The KV cache's element type: ``auto`` -> the model's dtype, else the one named.

    cpu_quantized_kernels: the model runs on nanoserve's GGUF block kernels (float32 only
    because those kernels take float32); ``auto`` is then float16, llama.cpp's default
    cache type for the same files: half the bytes per token, K and V rounded to 11
    significant bits (perplexity of the default model within 0.1% of a float32 cache).
    Raises ValueError for a name outside ``auto``, ``float32``, ``bfloat16``, ``float16``.
    """
    if name == "auto":
        return torch.float16 if cpu_quantized_kernels and model_dtype == torch.float32 else model_dtype
    if name not in _DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {('auto', *_DTYPES)}, got {name!r}")
    return _DTYPES[name]
