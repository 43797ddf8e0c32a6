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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.engine.config import MATMUL_PRECISIONS
from nanoserve.engine.model import kernels
from nanoserve.engine.model.attention import AttentionBackend, AttentionMetadata, write_kv
from nanoserve.engine.model.kv_cache import KVCache
from nanoserve.engine.model.layers.embedding import Embedding
from nanoserve.engine.model.layers.quantized_linear import AnyLinear, QuantizedWeight, linear_tensors, make_linear
from nanoserve.engine.model.layers.rope import RotaryEmbedding, apply_rope


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed) of [T, N] rows: residual = hidden + delta, normed = RMSNorm(residual) * weight.

    nanoserve's one-pass kernel for float32 on the CPU where it loads, else torch's ops.
    """
    if hidden.dtype == torch.float32 and hidden.device.type == "cpu" and kernels.load():
        return kernels.add_rms_norm(hidden, delta, weight, eps)
    residual = hidden if delta is None else hidden + delta
    return residual, F.rms_norm(residual, (residual.shape[-1],), weight, eps)


def fused_ops_run(x: torch.Tensor) -> bool:
    """Whether a layer's small ops on ``x`` run as nanoserve's fused kernels (``silu_and_mul``,
    ``rope_and_write_kv``): float32 on the CPU where the kernels load. Tests turn it off to
    compare the two paths."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernels.load()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: gate_up [T, 2I] -> silu(gate) * up [T, I], gate and up its two halves.

    nanoserve's one-pass kernel where ``fused_ops_run`` (within a few ulp of torch's:
    relative error under 1e-6), else torch's silu and an in-place multiply.
    """
    if fused_ops_run(gate_up):
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


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


class LlamaDecoderLayer:
    """One block: x + attn(norm(x)), then x + mlp(norm(x)). Weights arrive through ``load``."""

    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        c = config
        self.layer_id = layer_id
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.intermediate_size = c.intermediate_size
        self.input_norm: torch.Tensor  # [hidden]
        self.post_attention_norm: torch.Tensor  # [hidden]
        self.q_norm: torch.Tensor | None = None  # [head_dim], Qwen3
        self.k_norm: torch.Tensor | None = None
        self.qkv_proj: AnyLinear  # hidden -> (H + 2 * Hkv) * D
        self.o_proj: AnyLinear  # H * D -> hidden
        self.gate_up_proj: AnyLinear  # hidden -> 2 * intermediate
        self.down_proj: AnyLinear  # intermediate -> hidden

    def load(
        self,
        tensor: Callable[[str, tuple[int, ...]], torch.Tensor],
        linear: Callable[[list[tuple[str, tuple[int, int]]], torch.Tensor | None], AnyLinear],
        config: LlamaConfig,
    ) -> None:
        """Take this layer's tensors and fuse them.

        ``tensor(hf_name, expected_shape)`` gives a dense tensor, ``linear([(hf_name,
        shape), ...], bias)`` one linear over the named weights stacked along the output rows.
        """
        c, p = config, f"model.layers.{self.layer_id}."
        h, q, kv, i = c.hidden_size, self.q_size, self.kv_size, c.intermediate_size
        bias = None
        if c.attention_bias:
            bias = torch.cat(
                [tensor(f"{p}self_attn.{n}_proj.bias", (size,)) for n, size in (("q", q), ("k", kv), ("v", kv))]
            )
        attn = f"{p}self_attn."
        self.qkv_proj = linear(
            [(f"{attn}q_proj.weight", (q, h)), (f"{attn}k_proj.weight", (kv, h)), (f"{attn}v_proj.weight", (kv, h))],
            bias,
        )
        self.o_proj = linear([(f"{attn}o_proj.weight", (h, q))], None)
        self.gate_up_proj = linear([(f"{p}mlp.gate_proj.weight", (i, h)), (f"{p}mlp.up_proj.weight", (i, h))], None)
        self.down_proj = linear([(f"{p}mlp.down_proj.weight", (h, i))], None)
        self.input_norm = tensor(f"{p}input_layernorm.weight", (h,))
        self.post_attention_norm = tensor(f"{p}post_attention_layernorm.weight", (h,))
        if c.qk_norm:
            self.q_norm = tensor(f"{p}self_attn.q_norm.weight", (c.head_dim,))
            self.k_norm = tensor(f"{p}self_attn.k_norm.weight", (c.head_dim,))

    def _qkv_with_kv_written(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv: [T, (H + 2 * Hkv) * D] -> q [T, H, D], k [T, Hkv, D] rotated, v [T, Hkv, D].

        Also writes this step's K and V into their cache slots: the attention backends only
        read the cache. Where ``fused_ops_run`` and the model has no per-head norms, one
        kernel pass rotates in place in qkv and writes (``kernels.rope_and_write_kv``,
        bit-equal to the torch path); otherwise torch's ops rotate and ``write_kv`` writes.
        """
        if self.q_norm is None and qkv.is_contiguous() and fused_ops_run(qkv):
            return kernels.rope_and_write_kv(
                qkv, cos, sin, key_cache, value_cache, slot_mapping, self.num_heads, self.num_kv_heads
            )
        q, k, v = self._rotated_qkv(qkv, cos, sin)
        write_kv(k, v, key_cache, value_cache, slot_mapping)
        return q, k, v

    def _rotated_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv: [T, (H + 2 * Hkv) * D] -> q [T, H, D], k [T, Hkv, D] rotated, v [T, Hkv, D].

        Without per-head norms Q and K are rotated in one pass over their H + Hkv heads
        (half the small ops of rotating each on its own, the same values).
        """
        num_tokens, heads = qkv.shape[0], self.num_heads
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qk, cos, sin)
            return qk[:, :heads], qk[:, heads:], v
        assert self.k_norm is not None, "qk_norm loads both q_norm and k_norm"
        q = qkv[:, : self.q_size].view(num_tokens, heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps)
        k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend[Any],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, delta) -> (hidden, delta) of the next layer, each [num_tokens, hidden_size].

        The residual stream is ``hidden + delta`` (delta None: hidden alone): each layer adds
        the previous one's output as it normalizes (``add_rms_norm``), one pass instead of two.
        """
        hidden, x = add_rms_norm(hidden, delta, self.input_norm, self.eps)
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        key_cache, value_cache = kv_cache.key_caches[self.layer_id], kv_cache.value_caches[self.layer_id]
        q, k, v = self._qkv_with_kv_written(qkv, cos, sin, key_cache, value_cache, attn_metadata.slot_mapping)
        attn = attention.forward(q, k, v, key_cache, value_cache, attn_metadata)  # [T, H * D]
        hidden, x = add_rms_norm(hidden, self.o_proj(attn), self.post_attention_norm, self.eps)
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        return hidden, self.down_proj(silu_and_mul(gate_up))


class LlamaForCausalLM:
    """Token ids -> logits, reading and writing K/V through the paged cache.

    Weights are absent until ``load_weights``; the rope tables are built at init.
    """

    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype,
        device: torch.device,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.layers = [LlamaDecoderLayer(config, i) for i in range(config.num_layers)]
        self.embed_tokens: Embedding  # [vocab, hidden]
        self.norm: torch.Tensor  # [hidden]
        self.lm_head: AnyLinear  # hidden -> vocab
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
            rope_freq_factors,
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend[Any],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64; logits_indices: [num_logits] int64.

        Returns logits [num_logits, vocab_size] in the model dtype.
        """
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope.lookup(positions)
        delta: torch.Tensor | None = None
        for layer in self.layers:
            hidden, delta = layer.forward(hidden, delta, cos, sin, kv_cache, attention, attn_metadata)
        if logits_indices.shape[0] != hidden.shape[0]:  # as many indices as rows: every row, in order
            hidden = hidden.index_select(0, logits_indices)  # only the rows whose logits are wanted
            delta = None if delta is None else delta.index_select(0, logits_indices)
        _, hidden = add_rms_norm(hidden, delta, self.norm, self.config.rms_norm_eps)
        return self.lm_head(hidden)

    def num_weight_bytes(self) -> int:
        """Bytes the loaded weights take in memory (quantized codes and scales, dense copies, norms)."""
        tensors: list[torch.Tensor | None] = [self.norm]
        embed = self.embed_tokens
        tensors += [embed.weight, embed.quantized.blocks if embed.quantized is not None else None]
        linears = [self.lm_head]
        for layer in self.layers:
            linears += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
            tensors += [layer.input_norm, layer.post_attention_norm, layer.q_norm, layer.k_norm]
        for linear in linears:
            tensors += linear_tensors(linear)
        storages = {_storage_id(t): t for t in tensors if t is not None}  # a tied lm_head shares its blocks
        return sum(_nbytes(t) for t in storages.values())

    @torch.no_grad()
    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor | QuantizedWeight],
        quantization: str = "none",
        dense_for_large_steps: bool = False,
        matmul_precision: str = "highest",
        batch_invariant: bool = False,
    ) -> None:
        """Take Hugging Face-named tensors, cast to the model dtype and device, fuse per layer.

        quantization: ``none`` (dense, the exact path), ``auto`` (GGUF Q4_0/Q4_1/Q8_0
        stay quantized), ``int4`` / ``int8`` (float weights quantized here too); see
        ``make_linear``. dense_for_large_steps: int4 layers also keep a dense copy for
        steps of many tokens (prefill, big batches). matmul_precision: ``medium`` lets
        the GGUF kernel run steps of more than 8 tokens in bf16 (``ModelConfig``); batch_invariant:
        it runs every step by the decode path's arithmetic instead (``ModelConfig``). Tensors are converted one by one:
        no dense copy of the whole model exists at any moment.

        Raises ValueError naming the first missing tensor or a shape mismatch.
        """
        c = self.config
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {matmul_precision!r}")
        bf16 = matmul_precision == "medium"

        def raw(name: str, shape: tuple[int, ...]) -> torch.Tensor | QuantizedWeight:
            if name not in weights:
                raise ValueError(f"checkpoint lacks tensor {name!r}")
            value = weights[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, the config expects {shape}")
            return value

        def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            value = raw(name, shape)
            dense = value.dequantize() if isinstance(value, QuantizedWeight) else value
            return dense.to(device=self.device, dtype=self.dtype).contiguous()

        def linear(parts: list[tuple[str, tuple[int, int]]], bias: torch.Tensor | None) -> AnyLinear:
            values = [raw(name, shape) for name, shape in parts]
            fused: torch.Tensor | QuantizedWeight
            quantized = [v for v in values if isinstance(v, QuantizedWeight)]
            if len(quantized) == len(values) and len({v.quant_type for v in quantized}) == 1:
                fused = QuantizedWeight.cat(quantized)
            else:
                fused = torch.cat([v.dequantize() if isinstance(v, QuantizedWeight) else v for v in values])
            return make_linear(
                fused,
                self.dtype,
                self.device,
                quantization,
                bias,
                dense_for_large_steps,
                bf16_large_steps=bf16,
                batch_invariant=batch_invariant,
            )

        embed_shape = (c.vocab_size, c.hidden_size)
        embed = raw("model.embed_tokens.weight", embed_shape)
        self.embed_tokens = Embedding(embed, self.dtype, self.device)
        self.norm = tensor("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings:  # one read of the tensor: a kept-quantized head shares the embedding's blocks
            self.lm_head = make_linear(
                embed,
                self.dtype,
                self.device,
                quantization,
                None,
                dense_for_large_steps,
                shares_weight=True,
                bf16_large_steps=bf16,
                batch_invariant=batch_invariant,
            )
        else:
            self.lm_head = linear([("lm_head.weight", embed_shape)], None)
        for layer in self.layers:
            layer.load(tensor, linear, c)


def _storage_id(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # no storage to share
        return id(tensor)
    return tensor.untyped_storage().data_ptr()


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # an opaque oneDNN layout: as many elements as the plain tensor, maybe padded
        return tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()
