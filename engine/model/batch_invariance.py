"""Which batch-invariance guarantee a loaded model holds, for the start-up log line.

Batch invariance: a row's logits depend only on the model, its own prefix and its position,
not on what it is batched with, how its prefill was chunked, whether its prefix came from the
prefix cache or a recompute after preemption, or the thread count (the property SGLang's
deterministic mode and vLLM's batch-invariant mode buy at a cost; Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025). It holds, to the bit, where every op on a
row's path reduces in an order fixed by that row alone:

- the linears: nanoserve's GGUF kernel under ``isa`` ``int16`` (``GGUFLinear`` with
  ``batch_invariant``): every step size by the decode path's 16-bit activations and exact
  integer block sums, then one float chain per output (``kernels/gguf_linear_tile.h``);
- attention: the paged decode kernel for every query row (``CpuPagedAttentionBackend`` with
  ``prefill_by_decode_kernel``), over K/V read back from the cache;
- RMSNorm, RoPE, SiLU (nanoserve's per-row kernels), the embedding lookup and the sampler
  (per-row torch ops) never reduce across rows.

torch's dense matmuls (``--quantization none``, float weights) and SDPA choose their blocking
by shape, so off the GGUF kernels (or with ``--batch-invariant off``) there is no such guarantee.
"""

from __future__ import annotations

from typing import Any

from nanoserve.engine.model import kernels
from nanoserve.engine.model.cpu_paged_attention import CpuPagedAttentionBackend
from nanoserve.engine.model.layers.quantized_linear import GGUFLinear


def linears_of(model: Any) -> list[Any]:
    """Every linear of a ``LlamaForCausalLM``: each layer's four, then the lm_head."""
    parts = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return [getattr(layer, name) for layer in model.layers for name in parts] + [model.lm_head]


def wants_batch_invariance(mode: str, on_gguf_kernels: bool) -> bool:
    """``ModelConfig.batch_invariant`` (``auto``, ``on``, ``off``) -> whether to build for it.

    ``auto`` is on where nanoserve's GGUF kernels run and the CPU has AVX-512 VNNI (large steps
    on the int16 panels, about as fast as without); elsewhere the decode tiles would run large
    steps, about twice as slow, so ``auto`` is off there and ``on`` asks for it anyway.
    """
    if mode == "auto":
        return on_gguf_kernels and kernels.has_int16_panels()
    return mode == "on"


def batch_invariance(model: Any, attention: Any) -> str:
    """``bitwise`` (and how large steps run) where the guarantee above holds, else ``none`` and why."""
    linears = linears_of(model)
    if not all(isinstance(linear, GGUFLinear) and linear.isa == "int16" for linear in linears):
        return "none: not every linear runs on nanoserve's GGUF kernel by its int16 arithmetic"
    if not (isinstance(attention, CpuPagedAttentionBackend) and attention.prefill_by_decode_kernel):
        return "none: prefill attention is not the paged decode kernel's"
    if kernels.has_int16_panels():
        return "bitwise (large steps: int16 panels, AVX-512 VNNI)"
    return "bitwise (large steps: the decode tiles 8 rows at a time, 4 on AVX2; no AVX-512 VNNI, slower)"
