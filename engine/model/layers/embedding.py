"""Token embedding lookup over a dense table or GGUF blocks kept quantized.

A quantized table (the tied embedding / lm_head of a GGUF, often Q8_0) is not
expanded: each step gathers the block rows of its token ids and dequantizes
only those, so the table costs its file size in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.engine.model.layers.quantized_linear import QuantizedWeight, unpacked_float


class Embedding:
    """token ids [T] int64 -> rows [T, hidden] in ``dtype``."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.quantized = weight if isinstance(weight, QuantizedWeight) else None
        self.weight: torch.Tensor | None = None
        if self.quantized is None:
            assert isinstance(weight, torch.Tensor)
            self.weight = weight.to(device=device, dtype=dtype).contiguous()
        self.num_embeddings, self.embedding_dim = weight.shape

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(input_ids, self.weight)
        assert self.quantized is not None, "an Embedding holds a dense or a quantized table"
        return unpacked_float(self.quantized.rows(input_ids)).to(self.dtype)  # [T, hidden]
