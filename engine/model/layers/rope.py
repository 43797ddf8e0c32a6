"""Rotary position embedding (Su et al. 2021, "RoFormer"), with the rope scalings in use.

The cos/sin tables for every position up to ``max_position`` are computed once;
a forward pass indexes them by position, once for all layers. The layout is
"rotate half" (the Hugging Face Llama layout): dims ``i`` and ``i + D/2`` form a pair.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies, scaled per ``scaling``.

    scaling: None, ``{"rope_type": "linear", "factor": f}`` or the Llama 3.1 form
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``. Raises ValueError for other types.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, smoothed, scaled)
    raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}")


class RotaryEmbedding:
    """Precomputed tables: ``cos`` and ``sin_signed``, each [max_position, head_dim].

    ``sin_signed`` carries the sign of the rotation (-sin on the first half, +sin
    on the second), so that applying rope is ``x * cos + roll(x, D/2) * sin_signed``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        freq_factors: torch.Tensor | None = None,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        if freq_factors is not None:  # GGUF's rope_freqs tensor (Llama 3.1 scaling, precomputed)
            inv_freq = inv_freq / freq_factors.float()
        # float32 throughout, as the reference implementation computes it
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()  # [max_position, D/2]
        self.head_dim = head_dim
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype)
        self.sin_signed = torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin_signed), each [num_tokens, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> rotated, same shape (new contiguous tensor).

    The half swap is one ``flip`` of the two halves (``roll`` by D/2 equals it, in
    three ops: two narrows and a cat); the result is bit-identical.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [T, H, D]: (x2, x1)
    return torch.addcmul(x * cos, swapped, sin_signed)
