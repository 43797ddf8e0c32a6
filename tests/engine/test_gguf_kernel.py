"""nanoserve's GGUF block kernel (``quantization auto``): gguf's weights exactly, batch-invariant, clear errors.

Tolerance: the kernel forms each weight exactly as gguf dequantizes it (checked through
an identity input, where each output is one weight times 1.0, so any other rounding or
a wrong nibble order shows), then sums products in float32; against a float64 product
of the same weights it differs by float32 rounding of sums of up to K terms: ``FP32_RTOL``
of the output's scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine import kernels
from nanoserve.engine.models.quantized_linear import GGUFLinear, Int4Linear, Int8Linear, QuantizedWeight, make_linear
from tests.engine.test_quantized_linear import gguf_dense, q4_1_block, random_blocks

FP32_RTOL = 1e-5
CPU = torch.device("cpu")
QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]

needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """``kernels.load()`` decides again, as in a new process."""
    monkeypatch.setattr(kernels, "_state", {})


@needs_kernels
def test_auto_keeps_every_gguf_block_type_in_its_blocks_without_a_copy():
    for quant_type in QUANT_TYPES:
        weight = random_blocks(quant_type, 24, 64)
        linear = make_linear(weight, torch.float32, CPU, "auto")
        assert isinstance(linear, GGUFLinear)
        assert linear.blocks.data_ptr() == weight.blocks.data_ptr()


@needs_kernels
def test_hand_built_q4_1_blocks_give_gguf_values_low_nibbles_first():
    codes = list(range(16)) + [15 - j for j in range(16)]  # element 16 is 15, element 31 is 0
    row = q4_1_block(0.5, -2.0, codes) + q4_1_block(0.25, 1.0, codes[::-1])
    weight = QuantizedWeight(torch.frombuffer(bytearray(row * 3), dtype=torch.uint8).reshape(3, 40), "Q4_1", (3, 64))
    recovered = GGUFLinear(weight)(torch.eye(64)).T  # [3, 64]: each output is one weight times 1.0
    assert recovered[0, :32].tolist() == [0.5 * c - 2.0 for c in codes]
    assert recovered[0, 32:].tolist() == [0.25 * c + 1.0 for c in codes[::-1]]
    torch.testing.assert_close(recovered, gguf_dense(weight), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_weights_are_gguf_values_exactly(quant_type):
    weight = random_blocks(quant_type, 40, 128, seed=5)  # 40 rows: panels of 12 and a partial one
    linear = GGUFLinear(weight)
    for num_tokens in (1, 4, 128):  # the register path and the panel path
        eye = torch.eye(128)[:num_tokens]
        torch.testing.assert_close(linear(eye).T, gguf_dense(weight)[:, :num_tokens], rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 33])
def test_matches_a_float64_product_of_the_same_weights(quant_type, num_tokens):
    weight = random_blocks(quant_type, 50, 256, seed=num_tokens)
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x.double(), gguf_dense(weight).double())
    got = GGUFLinear(weight)(x)
    assert got.dtype == torch.float32
    assert got.shape == (num_tokens, 50)
    torch.testing.assert_close(got.double(), expected, rtol=FP32_RTOL, atol=FP32_RTOL * expected.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_a_rows_output_does_not_depend_on_its_batch(quant_type):
    weight = random_blocks(quant_type, 37, 96, seed=2)
    linear = GGUFLinear(weight)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([linear(x[i : i + 1]) for i in range(70)])
    for size in (2, 3, 4, 5, 7, 16, 70):  # register path up to 4 tokens, panels beyond, ragged tiles
        batched = torch.cat([linear(x[i : i + size]) for i in range(0, 70, size)])
        assert torch.equal(batched, alone), size
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_bf16_activations_and_a_bias_come_back_in_their_dtype():
    weight = random_blocks("Q4_1", 16, 64)
    bias = torch.arange(16, dtype=torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    got = make_linear(weight, torch.bfloat16, CPU, "auto", bias=bias)(x)
    expected = F.linear(x.float(), gguf_dense(weight)).to(torch.bfloat16) + bias
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_kernels
def test_inputs_it_cannot_take_are_clear_errors():
    weight = random_blocks("Q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="x must be float32, got Double"):
        kernels.gguf_linear(torch.zeros(1, 64, dtype=torch.float64), weight.blocks, "Q4_1", 64)
    with pytest.raises(RuntimeError, match=r"x must be \[T, 64\]"):
        kernels.gguf_linear(torch.zeros(1, 32), weight.blocks, "Q4_1", 64)
    with pytest.raises(RuntimeError, match="blocks of 40 bytes per row do not hold 96 weights"):
        kernels.gguf_linear(torch.zeros(1, 96), weight.blocks, "Q4_1", 96)


def test_a_cpu_without_avx2_falls_back_to_torchs_kernels_and_says_why(fresh_kernel_state, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert kernels.load() is False
    assert kernels.unavailable_reason() == "CPU capability DEFAULT: the kernels need AVX2"
    assert isinstance(make_linear(random_blocks("Q4_1", 16, 64), torch.float32, CPU, "auto"), Int4Linear)
    assert isinstance(make_linear(random_blocks("Q8_0", 16, 64), torch.float32, CPU, "auto"), Int8Linear)


def test_a_failed_build_falls_back_and_says_why(fresh_kernel_state, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(kernels, "library_path", lambda: tmp_path / "k" / "nanoserve_kernels.so")

    def no_compiler(target):
        raise FileNotFoundError("[Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(kernels, "_build", no_compiler)
    assert kernels.load() is False
    assert kernels.unavailable_reason() == (
        "build failed: FileNotFoundError: [Errno 2] No such file or directory: 'c++'"
    )
    assert kernels.load() is False  # decided once per process


def test_the_build_key_changes_with_the_source(monkeypatch, tmp_path):
    source = tmp_path / "k.cpp"
    source.write_text("int a;")
    monkeypatch.setattr(kernels, "SOURCES", [source])
    first = kernels.build_key()
    source.write_text("int b;")
    assert kernels.build_key() != first
