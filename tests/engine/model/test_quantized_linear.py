"""Quantized linears on torch's kernels (``int4`` / ``int8``): GGUF blocks repacked equal gguf's dequantization.

nanoserve's own kernel (``auto``) is tested in test_gguf_kernel.py.

Tolerances: with fp32 scales and fp32 activations the int4 kernel reproduces gguf's
weights bit for bit (checked through an identity input, where each output is one
product by 1.0); a random fp32 input differs from the dense product only by the
order of the fp32 sums (``FP32_RTOL``). With bf16 scales and activations every
weight and product carries bf16's 8-bit mantissa: ``BF16_RTOL`` of the output's
scale. Q8_0 requantized to one int8 scale per row: at most half a step of
max|row| / 127 per weight (``INT8_RTOL``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from nanoserve.engine.model.layers.embedding import Embedding
from nanoserve.engine.model.layers.linear import Linear
from nanoserve.engine.model.layers.quantized_linear import (
    Int4Linear,
    Int8Linear,
    QuantizedWeight,
    make_linear,
    quantize_q4,
    unpack_q4,
    unpack_q8,
)

FP32_RTOL = 1e-5
BF16_RTOL = 2e-2
INT8_RTOL = 1e-2
CPU = torch.device("cpu")


def q4_1_block(d: float, m: float, codes: list[int]) -> bytes:
    """One Q4_1 block: fp16 d, fp16 m, byte j = codes[j] | codes[j + 16] << 4."""
    assert len(codes) == 32
    nibbles = bytes(codes[j] | codes[j + 16] << 4 for j in range(16))
    return np.array([d, m], dtype="<f2").tobytes() + nibbles


def gguf_dense(weight: QuantizedWeight) -> torch.Tensor:
    values = dequantize(weight.blocks.numpy(), GGMLQuantizationType[weight.quant_type])
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(weight.shape)


def random_blocks(quant_type: str, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """Random codes with small fp16 scales (and mins), laid out as GGUF blocks."""
    rng = np.random.default_rng(seed)
    num_blocks = out_features * in_features // 32
    d = rng.uniform(0.001, 0.02, num_blocks).astype("<f2").view(np.uint8).reshape(num_blocks, 2)
    if quant_type == "Q8_0":
        payload = rng.integers(-127, 128, (num_blocks, 32)).astype(np.int8).view(np.uint8)
        blocks = np.concatenate([d, payload], axis=1)
    else:
        payload = rng.integers(0, 256, (num_blocks, 16)).astype(np.uint8)
        header = [d]
        if quant_type == "Q4_1":
            header.append(rng.uniform(-0.1, 0.0, num_blocks).astype("<f2").view(np.uint8).reshape(num_blocks, 2))
        blocks = np.concatenate([*header, payload], axis=1)
    return QuantizedWeight(
        torch.from_numpy(blocks.reshape(out_features, -1).copy()), quant_type, (out_features, in_features)
    )


def test_q4_1_block_unpacks_low_nibbles_first_then_high():
    codes = list(range(16)) + [15 - j for j in range(16)]  # element 16 is 15, element 31 is 0
    row = q4_1_block(0.5, -2.0, codes) * 2  # [1, 64]: two blocks
    weight = QuantizedWeight(torch.frombuffer(bytearray(row), dtype=torch.uint8).reshape(1, 40), "Q4_1", (1, 64))
    unpacked, scale, zero = unpack_q4(weight)
    assert unpacked[0].tolist() == codes * 2
    assert scale.tolist() == [[0.5, 0.5]]
    assert zero.tolist() == [[2.0, 2.0]]  # m + 8 d
    assert gguf_dense(weight)[0, :32].tolist() == [0.5 * c - 2.0 for c in codes]


def test_q4_1_repack_equals_gguf_dequantization_exactly_with_fp32_scales():
    blocks = b"".join(
        q4_1_block(0.25 * (1 + r % 3), -1.5 + r, [(r * 7 + j * 5) % 16 for j in range(32)]) for r in range(32)
    )
    weight = QuantizedWeight(torch.frombuffer(bytearray(blocks), dtype=torch.uint8).reshape(16, 40), "Q4_1", (16, 64))
    assert isinstance(make_linear(weight, torch.float32, CPU, "int4"), Int4Linear)
    linear = Int4Linear(*unpack_q4(weight), torch.float32)  # fp32 scales and activations
    recovered = linear(torch.eye(64)).T  # identity in: each output is one weight times 1.0
    torch.testing.assert_close(recovered, gguf_dense(weight), rtol=0, atol=0)


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_int4_repack_of_random_blocks_is_exact_in_fp32(quant_type):
    weight = random_blocks(quant_type, 64, 128)
    linear = Int4Linear(*unpack_q4(weight), torch.float32)
    torch.testing.assert_close(linear(torch.eye(128)).T, gguf_dense(weight), rtol=0, atol=0)


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_int4_linear_matches_dense_on_random_inputs(quant_type, num_tokens):
    weight = random_blocks(quant_type, 96, 256, seed=num_tokens)
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, gguf_dense(weight))
    scale = expected.abs().max().item()
    exact = Int4Linear(*unpack_q4(weight), torch.float32)
    torch.testing.assert_close(exact(x), expected, rtol=FP32_RTOL, atol=FP32_RTOL * scale)
    for dtype in (torch.float32, torch.bfloat16):  # a float32 model runs the kernel in bf16 too
        got = make_linear(weight, dtype, CPU, "int4")(x.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=BF16_RTOL, atol=BF16_RTOL * scale)


def test_q8_0_unpacks_to_gguf_values_and_int8_linear_stays_within_a_step():
    weight = random_blocks("Q8_0", 64, 128)
    codes, scale = unpack_q8(weight)
    dense = gguf_dense(weight)
    torch.testing.assert_close((codes.float().view(64, 4, 32) * scale[..., None]).view(64, 128), dense, rtol=0, atol=0)
    assert isinstance(make_linear(weight, torch.float32, CPU, "int8"), Int8Linear)
    linear = Int8Linear(dense, torch.float32)
    step = dense.abs().amax(dim=1, keepdim=True) / 127
    assert ((linear(torch.eye(128)).T - dense).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    expected = F.linear(x, dense)
    torch.testing.assert_close(linear(x), expected, rtol=INT8_RTOL, atol=INT8_RTOL * expected.abs().max().item())


def test_int8_linear_built_in_row_chunks_from_blocks_equals_one_requantization_of_the_dense_weight(monkeypatch):
    from nanoserve.engine.model.layers import quantized_linear

    weight = random_blocks("Q8_0", 10, 64, seed=4)
    dense = gguf_dense(weight)
    scale = (dense.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (dense / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    monkeypatch.setattr(quantized_linear, "ROWS_PER_CHUNK", 4)  # chunks of 4, 4 and 2 rows
    for source in (weight, dense):
        linear = Int8Linear(source, torch.float32)
        assert torch.equal(linear.codes, codes)
        assert torch.equal(linear.scale, scale)


def test_int4_setting_quantizes_float_weights_within_half_a_step():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    codes, scale, zero = quantize_q4(weight)
    restored = ((codes.float() - 8).view(32, 2, 32) * scale[..., None] + zero[..., None]).view(32, 64)
    assert ((restored - weight).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    assert isinstance(make_linear(weight, torch.float32, CPU, "int4"), Int4Linear)
    assert isinstance(make_linear(weight, torch.float32, CPU, "auto"), Linear)  # float stays float under auto


def test_none_dequantizes_and_unfit_shapes_fall_back_to_dense():
    weight = random_blocks("Q4_1", 12, 64)  # 12 output rows: the int4 packing wants multiples of 8
    assert isinstance(make_linear(weight, torch.float32, CPU, "int4"), Linear)
    exact = make_linear(random_blocks("Q4_1", 16, 64), torch.float32, CPU, "none")
    assert isinstance(exact, Linear)


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_1"])
def test_quantized_embedding_rows_equal_gguf_rows(quant_type):
    weight = random_blocks(quant_type, 40, 64)
    ids = torch.tensor([3, 0, 39, 3])
    rows = Embedding(weight, torch.float32, CPU)(ids)
    torch.testing.assert_close(rows, gguf_dense(weight)[ids], rtol=0, atol=0)


def test_fused_rows_keep_each_part():
    first, second = random_blocks("Q4_0", 8, 64, seed=1), random_blocks("Q4_0", 16, 64, seed=2)
    fused = QuantizedWeight.cat([first, second])
    assert fused.shape == (24, 64)
    torch.testing.assert_close(fused.dequantize(), torch.cat([gguf_dense(first), gguf_dense(second)]), rtol=0, atol=0)
    picked = fused.rows(torch.tensor([23, 0]))
    torch.testing.assert_close(picked.dequantize(), fused.dequantize()[[23, 0]], rtol=0, atol=0)


def test_explicit_int4_off_the_cpu_is_a_clear_error_and_auto_stays_dense():
    weight = random_blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="quantization 'int4' has CPU kernels only; on cuda use 'auto'"):
        make_linear(weight, torch.float32, torch.device("cuda"), "int4")
    assert isinstance(make_linear(weight, torch.float32, torch.device("meta"), "auto"), Linear)
