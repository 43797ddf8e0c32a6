"""The Llama family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache.

Pre-norm transformer (Touvron et al. 2023): RMSNorm (Zhang & Sennrich 2019),
rotary positions, grouped-query attention (Ainslie et al. 2023), SwiGLU MLP
(Shazeer 2020). The variants differ only by config flags: ``attention_bias``
(Qwen2's Q/K/V bias) and ``qk_norm`` (Qwen3's per-head RMSNorm on Q and K).

Weights arrive in Hugging Face names and are fused at load time: Q, K and V into
one ``qkv_proj``, gate and up into one ``gate_up_proj``, so a layer runs three
matmuls plus the output projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.engine.attention import AttentionBackend
from nanoserve.engine.kv_cache import KVCache
from nanoserve.engine.models.rope import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of one checkpoint, read from GGUF metadata or config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


class LlamaDecoderLayer(nn.Module):
    """One block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, layer_id: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_id = layer_id
        c = config
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.hidden_shape = (c.hidden_size,)

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.input_norm = empty(c.hidden_size)
        self.qkv_proj = empty(self.q_size + 2 * self.kv_size, c.hidden_size)
        self.qkv_bias = empty(self.q_size + 2 * self.kv_size) if c.attention_bias else None
        self.q_norm = empty(c.head_dim) if c.qk_norm else None
        self.k_norm = empty(c.head_dim) if c.qk_norm else None
        self.o_proj = empty(c.hidden_size, self.q_size)
        self.post_attention_norm = empty(c.hidden_size)
        self.gate_up_proj = empty(2 * c.intermediate_size, c.hidden_size)
        self.down_proj = empty(c.hidden_size, c.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend,
        attn_metadata: object,
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> same shape."""
        num_tokens = hidden.shape[0]
        x = F.rms_norm(hidden, self.hidden_shape, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)  # [T, (H + 2 * Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = attention.forward(
            q, k, v, kv_cache.key_caches[self.layer_id], kv_cache.value_caches[self.layer_id], attn_metadata
        )  # [T, H * D]
        hidden = hidden + F.linear(attn, self.o_proj)
        x = F.rms_norm(hidden, self.hidden_shape, self.post_attention_norm, self.eps)
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)  # each [T, intermediate]
        return hidden + F.linear(F.silu(gate) * up, self.down_proj)


class LlamaForCausalLM(nn.Module):
    """Token ids -> logits, reading and writing K/V through the paged cache.

    Weights are empty until ``load_weights``; the rope tables are built at init.
    """

    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype,
        device: torch.device,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, device) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty_like(self.embed_tokens), requires_grad=False)
        )
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
            rope_freq_factors,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend,
        attn_metadata: object,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64; logits_indices: [num_logits] int64.

        Returns logits [num_logits, vocab_size] in the model dtype.
        """
        hidden = F.embedding(input_ids, self.embed_tokens)  # [T, hidden]
        cos, sin = self.rope.lookup(positions)
        for layer in self.layers:
            hidden = layer.forward(hidden, cos, sin, kv_cache, attention, attn_metadata)
        hidden = hidden.index_select(0, logits_indices)  # only the rows whose logits are wanted
        hidden = F.rms_norm(hidden, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy (and fuse) Hugging Face-named tensors into the model.

        Raises ValueError naming the first missing tensor or a shape mismatch.
        """

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            return weights[name]

        def put(param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config expects {tuple(param.shape)}")
            param.copy_(tensor)

        put(self.embed_tokens, "model.embed_tokens.weight", take("model.embed_tokens.weight"))
        put(self.norm, "model.norm.weight", take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            put(self.lm_head, "lm_head.weight", take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            put(layer.qkv_proj, f"{p}self_attn.qkv_proj", torch.cat(attn))
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, f"{p}self_attn.qkv_bias", torch.cat([take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]))
            if layer.q_norm is not None:
                put(layer.q_norm, f"{p}self_attn.q_norm.weight", take(f"{p}self_attn.q_norm.weight"))
                put(layer.k_norm, f"{p}self_attn.k_norm.weight", take(f"{p}self_attn.k_norm.weight"))
            put(layer.o_proj, f"{p}self_attn.o_proj.weight", take(f"{p}self_attn.o_proj.weight"))
            put(layer.input_norm, f"{p}input_layernorm.weight", take(f"{p}input_layernorm.weight"))
            put(layer.post_attention_norm, f"{p}post_attention_layernorm.weight", take(f"{p}post_attention_layernorm.weight"))
            gate_up = torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
            put(layer.gate_up_proj, f"{p}mlp.gate_up_proj", gate_up)
            put(layer.down_proj, f"{p}mlp.down_proj.weight", take(f"{p}mlp.down_proj.weight"))
