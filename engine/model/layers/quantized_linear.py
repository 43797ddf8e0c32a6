"""Linear layers whose weights stay quantized: GGUF blocks repacked for torch's CPU kernels.

GGUF block layouts (spec: github.com/ggml-org/ggml/blob/master/docs/gguf.md, ggml's
``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``), 32 weights per block along a row:

    Q4_0: d (fp16) | 16 bytes of nibbles          w = d * (q - 8)
    Q4_1: d (fp16) | m (fp16) | 16 bytes nibbles  w = d * q + m
    Q8_0: d (fp16) | 32 int8                      w = d * q

In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in
its high nibble. torch's int4 weight-only matmul (``_weight_int4pack_mm_for_cpu``,
the tinygemm convention) computes ``w = (q - 8) * scale + zero`` per group of 32,
so a Q4_1 block maps exactly onto it with ``scale = d`` and ``zero = m + 8 d``
(Q4_0: ``zero = 0``); with fp32 scales the product equals gguf's dequantization.

Q8_0 has no torch CPU kernel keeping its per-32 scales; ``Int8Linear`` requantizes each
row to one scale (``_weight_int8pack_mm``), half the bytes of bf16 at a relative
error of at most 1/254 of the row's largest weight.

``GGUFLinear`` (``quantization auto`` where nanoserve's own kernels load, see
``nanoserve.engine.model.kernels``) multiplies the blocks as they lie in the file, Q4_0, Q4_1
and Q8_0 alike: no repack at load, gguf's weight values exactly, float32 activations,
and an output that does not depend on the batch. torch's kernels above remain the
``int4`` / ``int8`` settings and the fallback where ours cannot be built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog
import torch

from nanoserve.engine.model import kernels
from nanoserve.engine.model.layers.linear import Linear

log = structlog.get_logger(__name__)

GROUP_SIZE = 32  # weights per GGUF block and per int4 scale group
INNER_K_TILES = 2  # int4 packing tiles: K must be a multiple of INNER_K_TILES * 16
Q4_0, Q4_1, Q8_0 = "Q4_0", "Q4_1", "Q8_0"
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
ROWS_PER_CHUNK = 2048  # rows an Int8Linear requantizes at a time at load
DENSE_MIN_TOKENS = 9  # steps of this many tokens or more use an Int4Linear's dense copy, when it has one
_fallbacks_logged: set[tuple[str, str]] = set()


@dataclass
class QuantizedWeight:
    """A GGUF tensor kept in its blocks.

    blocks: [out_features, in_features // 32 * block_bytes] uint8, one row of blocks
        per output row (a view of the memory-mapped file until something copies it).
    quant_type: ``Q4_0``, ``Q4_1`` or ``Q8_0``.
    """

    blocks: torch.Tensor
    quant_type: str
    shape: tuple[int, int]  # (out_features, in_features)

    def __post_init__(self) -> None:
        out_features, in_features = self.shape
        row_bytes = in_features // GROUP_SIZE * BLOCK_BYTES[self.quant_type]
        if in_features % GROUP_SIZE or tuple(self.blocks.shape) != (out_features, row_bytes):
            raise ValueError(f"{self.quant_type} blocks {tuple(self.blocks.shape)} do not hold a {self.shape} weight")

    def dequantize(self) -> torch.Tensor:
        """The dense weight [out_features, in_features] float32, by ``gguf.quants`` (the reference)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.quant_type])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of the rows ``index`` (a permutation or selection of output rows)."""
        return QuantizedWeight(self.blocks.index_select(0, index), self.quant_type, (len(index), self.shape[1]))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack weights of one type along the output rows (fusing Q, K, V or gate and up)."""
        assert len({p.quant_type for p in parts}) == 1, "only weights of one quant type fuse"
        if len(parts) == 1:
            return parts[0]  # no copy: the tied lm_head shares the embedding's blocks
        blocks = torch.cat([p.blocks for p in parts])
        return QuantizedWeight(blocks, parts[0].quant_type, (blocks.shape[0], parts[0].shape[1]))


def _split_blocks(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks -> (header [N, G, header_bytes] uint8, payload [N, G, payload_bytes] uint8)."""
    n, k = weight.shape
    header = 2 if weight.quant_type in (Q4_0, Q8_0) else 4
    blocks = weight.blocks.reshape(n, k // GROUP_SIZE, BLOCK_BYTES[weight.quant_type])
    return blocks[..., :header], blocks[..., header:]


def _fp16_pair(header: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 stored little-endian at ``offset`` of each block header -> float32 [N, G]."""
    return header[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def unpack_q4(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1 blocks -> (codes [N, K] int32 in 0..15, scale [N, G] fp32, zero [N, G] fp32).

    ``w = (codes - 8) * scale + zero`` per group of 32 along K, exactly gguf's value.
    """
    n, k = weight.shape
    header, nibbles = _split_blocks(weight)  # nibbles: [N, G, 16]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(n, k).to(torch.int32)
    d = _fp16_pair(header, 0)
    zero = torch.zeros_like(d) if weight.quant_type == Q4_0 else _fp16_pair(header, 2) + 8 * d
    return codes, d, zero


def unpack_q8(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks -> (codes [N, K] int8, scale [N, G] fp32); ``w = codes * scale``."""
    n, k = weight.shape
    header, payload = _split_blocks(weight)
    return payload.contiguous().view(torch.int8).reshape(n, k), _fp16_pair(header, 0)


def unpacked_float(weight: QuantizedWeight) -> torch.Tensor:
    """The dense weight [N, K] float32 by the torch unpackers above: gguf's values (tests prove it), faster."""
    n, k = weight.shape
    if weight.quant_type == Q8_0:
        codes8, scale = unpack_q8(weight)
        return (codes8.float().view(n, -1, GROUP_SIZE) * scale[..., None]).view(n, k)
    codes, scale, zero = unpack_q4(weight)
    return ((codes.float() - 8).view(n, -1, GROUP_SIZE) * scale[..., None] + zero[..., None]).view(n, k)


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] -> asymmetric 4-bit groups of 32 (codes, scale, zero) as ``unpack_q4`` returns.

    Per group: scale = (max - min) / 15, codes = round((w - min) / scale), zero = min + 8 scale.
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return codes, scale, low + 8 * scale


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether the int4 CPU kernel takes an [out, in] weight (tile sizes of its packing)."""
    return in_features % (INNER_K_TILES * 16) == 0 and in_features % GROUP_SIZE == 0 and out_features % 8 == 0


class Int4Linear:
    """``y = x @ w.T + bias`` with w in 4-bit groups of 32 (``_weight_int4pack_mm_for_cpu``).

    Holds the packed codes ([N, K / 2] bytes in the kernel's tiles) and
    ``scale_and_zero`` [K / 32, N, 2] in the activation dtype. x: [T, K] -> [T, N].
    ``dense``: an optional oneDNN copy used for steps of at least
    ``dense_min_tokens`` tokens, where the int4 kernel is compute-bound and slower.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        dense: Linear | None = None,
        dense_min_tokens: int = DENSE_MIN_TOKENS,
    ) -> None:
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES)
        # [N, G] each -> [G, N, 2]
        self.scale_and_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.bias = bias
        self.dense = dense
        self.dense_min_tokens = dense_min_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_min_tokens:
            return self.dense(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.dtype), self.packed, GROUP_SIZE, self.scale_and_zero)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class GGUFLinear:
    """``y = x @ w.T + bias`` with w in its GGUF blocks, by nanoserve's kernel (``kernels.gguf_linear``).

    weight: a Q4_0 / Q4_1 / Q8_0 ``QuantizedWeight`` [N, K / 32 * block_bytes] uint8.
    group_rows: Q4_0 / Q4_1 with N a multiple of 4 are regrouped once, four rows to a record
    per block (``kernels.group_rows``: the same bytes rearranged, no more memory, about 13%
    faster decode steps); otherwise, and for Q8_0, the blocks are used as they are (a view of
    the memory-mapped file stays one; the tied embedding keeps sharing them).
    bf16_large_steps: steps of more than 8 tokens round x and the weights to bf16 and sum
    bf16 dot products in float32: by AMX tiles where the CPU has them (``isa`` ``amx_bf16``),
    else by AVX-512 BF16 (``avx512_bf16``, twice the float32 rate); on CPUs with neither, and
    always up to 8 tokens, the same as without.
    batch_invariant: every step size by the decode path's arithmetic (``isa`` ``int16``: 16-bit
    activations, exact integer block sums; AVX-512 VNNI panels for large steps where the CPU
    has them, else the decode tiles four rows at a time): an output row's bits depend on its
    x row alone, whatever T. Wins over bf16_large_steps.
    x: [T, K] in any float dtype -> [T, N] in x's dtype, summed in float32.
    """

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        group_rows: bool = True,
        bf16_large_steps: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.quant_type = weight.quant_type
        self.layout = "rows"
        blocks = weight.blocks if weight.blocks.is_contiguous() else weight.blocks.contiguous()
        if group_rows and self.quant_type in (Q4_0, Q4_1) and self.out_features % kernels.GROUP_ROWS == 0:
            blocks = kernels.group_rows(blocks, self.quant_type, self.in_features)
            self.layout = "groups"
        self.blocks = blocks
        self.bias = bias
        self.isa = "int16" if batch_invariant else bf16_isa() if bf16_large_steps else "best"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = kernels.gguf_linear(x, self.blocks, self.quant_type, self.in_features, isa=self.isa, layout=self.layout)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Linear:
    """``y = x @ (codes * scale).T + bias``, int8 codes [N, K] with one scale per output row.

    Built ``ROWS_PER_CHUNK`` rows at a time from a dense or a quantized weight, so
    the float copy made at load is [ROWS_PER_CHUNK, K], not the whole [N, K] (the
    tied embedding / lm_head: 113 MiB in float32).
    """

    def __init__(
        self, weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.codes = torch.empty(weight.shape, dtype=torch.int8)  # [N, K]
        scale = torch.empty(self.out_features)  # [N] fp32
        for start in range(0, self.out_features, ROWS_PER_CHUNK):
            end = min(start + ROWS_PER_CHUNK, self.out_features)
            rows = _float_rows(weight, start, end)  # [end - start, K] fp32
            row_scale = (rows.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            self.codes[start:end] = (rows / row_scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            scale[start:end] = row_scale
        self.scale = scale.to(dtype)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.codes, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


def bf16_isa() -> str:
    """The kernels' isa for bf16 large steps here: ``amx_bf16``, ``avx512_bf16``, or ``best`` (float32)."""
    if kernels.has_amx_bf16():
        return "amx_bf16"
    return "avx512_bf16" if kernels.has_bf16_dot() else "best"


def _float_rows(weight: torch.Tensor | QuantizedWeight, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a weight as float32 [end - start, K] (quantized: by ``unpacked_float``)."""
    if isinstance(weight, QuantizedWeight):
        return unpacked_float(
            QuantizedWeight(weight.blocks[start:end], weight.quant_type, (end - start, weight.shape[1]))
        )
    return weight[start:end].float()


AnyLinear = Linear | Int4Linear | Int8Linear | GGUFLinear


def linear_tensors(linear: AnyLinear) -> list[torch.Tensor | None]:
    """Every tensor a linear holds (for counting its memory)."""
    if isinstance(linear, Int4Linear):
        dense = linear_tensors(linear.dense) if linear.dense is not None else []
        return [linear.packed, linear.scale_and_zero, linear.bias, *dense]
    if isinstance(linear, Int8Linear):
        return [linear.codes, linear.scale, linear.bias]
    if isinstance(linear, GGUFLinear):
        return [linear.blocks, linear.bias]
    return [linear.weight, linear.packed, linear.bias]


def _log_fallback(reason: str, detail: str) -> None:
    if (reason, detail) not in _fallbacks_logged:
        _fallbacks_logged.add((reason, detail))
        log.info("quantized_linear.dense_fallback", reason=reason, detail=detail)


def gguf_kernels_take(quant_types: set[str], quantization: str, device: torch.device) -> bool:
    """Whether ``make_linear`` puts weights of these block types on nanoserve's GGUF kernel.

    True under ``quantization auto`` on the CPU when some type is one the kernel multiplies
    and the kernels load (``kernels.load()``, which builds them on first use).
    """
    return (
        quantization == "auto"
        and device.type == "cpu"
        and bool(quant_types & set(kernels.GGML_TYPE_IDS))
        and kernels.load()
    )


def make_linear(
    weight: torch.Tensor | QuantizedWeight,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
    bias: torch.Tensor | None = None,
    dense_for_large_steps: bool = False,
    shares_weight: bool = False,
    bf16_large_steps: bool = False,
    batch_invariant: bool = False,
) -> AnyLinear:
    """The fastest linear for a weight under a ``quantization`` setting.

    shares_weight: another holder (the tied embedding) keeps using the weight's GGUF blocks,
    so ``GGUFLinear`` leaves them as they are rather than regroup a second copy.
    bf16_large_steps: a ``GGUFLinear`` runs steps of more than 8 tokens in bf16 where the
    CPU has AVX-512 BF16 (``ModelConfig.matmul_precision`` ``medium``). batch_invariant: a
    ``GGUFLinear`` runs every step by the decode path's arithmetic (``ModelConfig.batch_invariant``).

    ``none``: dense in ``dtype`` (a quantized weight is dequantized by gguf).
    ``auto``: Q4_0/Q4_1/Q8_0 -> ``GGUFLinear`` where nanoserve's kernels load (``kernels.load()``),
    else Q4_0/Q4_1 -> ``Int4Linear`` and Q8_0 -> ``Int8Linear``; float weights dense.
    The quantized kernels run in ``dtype``, or bf16 when ``dtype`` is float32 (inputs and
    outputs stay float32); an ``Int4Linear`` built directly in float32 is the exact path.
    ``int4`` / ``int8``: float weights are quantized at load too.
    Shapes or devices the kernels cannot take fall back to dense, logged once per reason.
    Raises ValueError for ``int4`` / ``int8`` on a device other than the CPU.
    """
    out_features, in_features = weight.shape
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    # torch's int4/int8 CPU kernels are vectorized for bf16 activations; in float32 they ran 10-50x slower here
    kernel_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    quant_type = weight.quant_type if isinstance(weight, QuantizedWeight) else None

    def dense(fast: bool = False) -> Linear:
        """Dense in ``dtype``: gguf's dequantization (the reference), or the torch unpacker (equal, faster)."""
        if isinstance(weight, QuantizedWeight):
            values = unpacked_float(weight) if fast and weight.quant_type in BLOCK_BYTES else weight.dequantize()
        else:
            values = weight
        return Linear(values.to(device=device, dtype=dtype).contiguous(), bias)

    want = {"none": None, "auto": None, "int4": "int4", "int8": "int8"}[quantization]
    if quantization == "auto":
        want = {Q4_0: "int4", Q4_1: "int4", Q8_0: "int8"}.get(quant_type or "")
    if want is None:
        return dense()
    if isinstance(weight, QuantizedWeight) and gguf_kernels_take({weight.quant_type}, quantization, device):
        return GGUFLinear(
            weight,
            bias,
            group_rows=not shares_weight,
            bf16_large_steps=bf16_large_steps,
            batch_invariant=batch_invariant,
        )
    if device.type != "cpu":
        if quantization in ("int4", "int8"):
            raise ValueError(
                f"quantization {quantization!r} has CPU kernels only; on {device.type} use 'auto' (dense) or 'none'"
            )
        _log_fallback("device", f"{device.type}: no quantized layout here yet, weights dequantized")
        return dense()
    if want == "int8":
        return Int8Linear(weight, kernel_dtype, bias)
    if not int4_shape_ok(out_features, in_features):
        _log_fallback("shape", f"int4 kernel cannot take [{out_features}, {in_features}]")
        return dense()
    if quant_type in (Q4_0, Q4_1):
        assert isinstance(weight, QuantizedWeight)
        codes, scale, zero = unpack_q4(weight)
    else:
        values = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        codes, scale, zero = quantize_q4(values)
    return Int4Linear(codes, scale, zero, kernel_dtype, bias, dense(fast=True) if dense_for_large_steps else None)
