"""nanoserve's GGUF block kernel (``quantization auto``): gguf's weights exactly, batch-invariant, clear errors.

Tolerance: the kernel uses each weight exactly as gguf dequantizes it (checked through an
identity input, where each output is one weight times 1.0, so any other rounding or a
wrong nibble order shows). Up to ``FEW_MAX_TOKENS`` rows of x it rounds x to 16-bit codes
per block of 32 (``rounded_x``, a power-of-two scale) and sums integer products exactly;
beyond, it keeps x in float32, or (``isa`` avx512_bf16, ``matmul_precision`` medium)
rounds x and the weights to bf16. Against a float64 product of the weights and of the
x it used, it differs by float32 rounding of sums of up to K terms: ``FP32_RTOL`` of the
output's scale; against the float x, by the 16-bit rounding too: ``ACT16_RTOL``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine.model import kernels
from nanoserve.engine.model.layers.quantized_linear import (
    GGUFLinear,
    Int4Linear,
    Int8Linear,
    QuantizedWeight,
    bf16_isa,
    make_linear,
)
from tests.engine.model.test_quantized_linear import gguf_dense, q4_1_block, random_blocks

FP32_RTOL = 1e-5
ACT16_RTOL = 2e-4  # x rounded to 2^-15 of its block's largest element, summed over 256 products
FEW_MAX_TOKENS = 8  # gguf_linear.cpp's kFewMaxTokens
CPU = torch.device("cpu")
QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]

needs_kernels = pytest.mark.skipif(not kernels.load(), reason=f"kernels unavailable: {kernels.unavailable_reason()}")
# the bf16 bodies this CPU has: AVX-512 BF16 dot products, AMX tiles
BF16_ISAS = [
    isa
    for isa, available in (("avx512_bf16", "has_bf16_dot"), ("amx_bf16", "has_amx_bf16"))
    if kernels.load() and getattr(kernels, available)()
]


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """The x the decode path multiplies: per block of 32, a power-of-two scale 2^(e - 15) with
    max|x| = f * 2^e (f in [0.5, 1)), codes rounded half to even and capped at 32767. [T, K] float64."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    _, exponent = torch.frexp(blocks.abs().amax(dim=-1, keepdim=True))
    scale = torch.pow(2.0, (exponent - 15).double())
    codes = torch.round(blocks / scale).clamp(-32768, 32767)
    return torch.where(blocks.abs().amax(dim=-1, keepdim=True) > 0, codes * scale, 0.0).reshape(x.shape)


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """``kernels.load()`` decides again, as in a new process."""
    monkeypatch.setattr(kernels, "_state", {})


@needs_kernels
def test_auto_keeps_q8_0_and_shared_weights_in_the_files_blocks_and_regroups_q4():
    for quant_type in QUANT_TYPES:
        weight = random_blocks(quant_type, 24, 64)
        linear = make_linear(weight, torch.float32, CPU, "auto")
        assert isinstance(linear, GGUFLinear)
        if quant_type == "Q8_0":
            assert linear.layout == "rows"
            assert linear.blocks.data_ptr() == weight.blocks.data_ptr()
        else:  # the same bytes, regrouped: 24 rows -> 6 groups of 4
            assert linear.layout == "groups"
            assert linear.blocks.shape == (6, weight.blocks.shape[1] * 4)
            assert linear.blocks.numel() == weight.blocks.numel()
        shared = make_linear(weight, torch.float32, CPU, "auto", shares_weight=True)  # the tied embedding's
        assert shared.layout == "rows"
        assert shared.blocks.data_ptr() == weight.blocks.data_ptr()
    ragged = make_linear(random_blocks("Q4_1", 6, 64), torch.float32, CPU, "auto")  # not whole groups
    assert ragged.layout == "rows"


@needs_kernels
def test_the_grouped_layout_is_four_rows_nibbles_then_their_d_then_their_m():
    rows = [q4_1_block(0.5 + r, -1.0 - r, [(r + j) % 16 for j in range(32)]) for r in range(4)]
    blocks = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(4, 20)
    record = kernels.group_rows(blocks, "Q4_1", 32)
    assert record.shape == (1, 80)
    for r in range(4):
        assert record[0, 16 * r : 16 * r + 16].tolist() == blocks[r, 4:].tolist()  # nibbles
        assert record[0, 64 + 2 * r : 66 + 2 * r].tolist() == blocks[r, 0:2].tolist()  # d
        assert record[0, 72 + 2 * r : 74 + 2 * r].tolist() == blocks[r, 2:4].tolist()  # m
    with pytest.raises(RuntimeError, match="Q4_0 or Q4_1 only"):
        kernels.group_rows(random_blocks("Q8_0", 4, 32).blocks, "Q8_0", 32)
    with pytest.raises(RuntimeError, match="rows must be a multiple of 4, got 6"):
        kernels.group_rows(random_blocks("Q4_0", 6, 32).blocks, "Q4_0", 32)


@needs_kernels
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1"])
def test_the_grouped_layout_gives_the_rows_layouts_bits(quant_type):
    isas = ["avx2", "avx512"] if kernels.best_isa() == "avx512" else ["avx2"]
    isas += BF16_ISAS
    # 52 rows: bf16 panels of 32 and of 20 (one whole register of 16 rows and one group of 4)
    for out_features in (48, 52):
        weight = random_blocks(quant_type, out_features, 128, seed=9)
        grouped = kernels.group_rows(weight.blocks, quant_type, 128)
        for num_tokens in (1, 2, 3, 4, 5, 37):  # decode tiles and the float (or bf16) panels
            x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(num_tokens)) * 5
            for isa in isas:
                rows = kernels.gguf_linear(x, weight.blocks, quant_type, 128, isa=isa)
                assert torch.equal(kernels.gguf_linear(x, grouped, quant_type, 128, isa=isa, layout="groups"), rows)


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
    # rows of very different sizes, and blocks within a row too: the scales are per block
    x = torch.randn(num_tokens, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 256)
    used = rounded_x(x) if num_tokens <= FEW_MAX_TOKENS else x.double()
    expected = F.linear(used, gguf_dense(weight).double())
    got = GGUFLinear(weight)(x)
    assert got.dtype == torch.float32
    assert got.shape == (num_tokens, 50)
    torch.testing.assert_close(got.double(), expected, rtol=FP32_RTOL, atol=FP32_RTOL * expected.abs().max().item())
    exact = F.linear(x.double(), gguf_dense(weight).double())
    torch.testing.assert_close(got.double(), exact, rtol=ACT16_RTOL, atol=ACT16_RTOL * exact.abs().max().item())


@needs_kernels
def test_decode_path_rounds_x_to_16_bits_per_block_by_a_power_of_two():
    weight = random_blocks("Q8_0", 8, 64, seed=4)
    dense = gguf_dense(weight).double()
    # block 0: max 1.0 -> scale 2^-14; 1 + 2^-16 is 16384.25 codes -> 1.0;
    # 3 * 2^-15 is 1.5 codes -> 2 (half to even) -> 2^-13
    # block 1: max 0.75 -> scale 2^-15, -0.75 exact
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 33] = 1.0, 1.0 + 2**-16, 3 * 2**-15, -0.75
    want = torch.zeros(1, 64, dtype=torch.float64)
    want[0, 0], want[0, 1], want[0, 2], want[0, 33] = 1.0, 1.0, 2**-13, -0.75
    assert torch.equal(rounded_x(x), want)
    got = GGUFLinear(weight)(x).double()
    torch.testing.assert_close(got, F.linear(want, dense), rtol=FP32_RTOL, atol=0)
    # a non-finite input gives NaN in every output it reaches, never a number; a zero block adds nothing
    x[0, 40] = float("inf")
    assert GGUFLinear(weight)(x).isnan().all()
    assert torch.equal(GGUFLinear(weight)(torch.zeros(2, 64)), torch.zeros(2, 8))


@needs_kernels
@pytest.mark.skipif(kernels.load() and kernels.best_isa() != "avx512", reason="this CPU has no AVX-512")
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_the_avx2_and_avx512_bodies_give_the_same_bits(quant_type):
    weight = random_blocks(quant_type, 45, 192, seed=7)  # 45 rows: whole and partial panels and tiles
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(8)) * 30
    # the decode path (AVX2: 4 rows a call; AVX-512: up to 8, 2 weight rows a tile), then the panel path
    for num_tokens in [*range(1, FEW_MAX_TOKENS + 1), 9, 10, 15, 16, 17, 33, 70]:
        avx2 = kernels.gguf_linear(x[:num_tokens], weight.blocks, quant_type, 192, isa="avx2")
        avx512 = kernels.gguf_linear(x[:num_tokens], weight.blocks, quant_type, 192, isa="avx512")
        assert torch.equal(avx2, avx512), num_tokens


needs_bf16_dot = pytest.mark.skipif(
    kernels.load() and not kernels.has_bf16_dot(), reason="this CPU has no AVX-512 BF16"
)


@needs_kernels
@pytest.mark.parametrize(
    "isa",
    [
        pytest.param(isa, marks=pytest.mark.skipif(isa not in BF16_ISAS, reason=f"this CPU has no {isa} body"))
        for isa in ("avx512_bf16", "amx_bf16")
    ],
)
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_the_bf16_bodies_multiply_bf16_rounded_x_and_weights(quant_type, isa):
    weight = random_blocks(quant_type, 45, 192, seed=4)  # 45 rows: a whole panel of 32 and a ragged one
    dense = gguf_dense(weight)
    rounded = dense.bfloat16()
    assert not torch.equal(rounded.float(), dense)  # the test can tell the roundings apart
    # identity rows of x: each output is one weight times 1.0, so exactly its bf16 rounding
    got = kernels.gguf_linear(torch.eye(192), weight.blocks, quant_type, 192, isa=isa)
    assert torch.equal(got, rounded.float().T)
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(5)) * 30
    reference = x.bfloat16().double() @ rounded.double().T  # float64 of the rounded operands
    scale = x.double().abs() @ dense.double().abs().T
    for num_tokens in (9, 12, 13, 24, 32, 70):  # whole tiles (12 rows of x; AMX: 32) and ragged ones
        got = kernels.gguf_linear(x[:num_tokens], weight.blocks, quant_type, 192, isa=isa)
        assert ((got.double() - reference[:num_tokens]).abs() <= FP32_RTOL * scale[:num_tokens]).all()
        # x already in bf16 (a bf16 model's activations): the same bits
        bf16_x = kernels.gguf_linear(x[:num_tokens].bfloat16(), weight.blocks, quant_type, 192, isa=isa)
        assert torch.equal(bf16_x, got)
    # up to 8 rows, the decode path: avx512's bits, bf16 or not
    for num_tokens in range(1, FEW_MAX_TOKENS + 1):
        want = kernels.gguf_linear(x[:num_tokens], weight.blocks, quant_type, 192, isa="avx512")
        assert torch.equal(kernels.gguf_linear(x[:num_tokens], weight.blocks, quant_type, 192, isa=isa), want)


@needs_kernels
@needs_bf16_dot
def test_gguf_linear_takes_the_bf16_body_only_when_asked():
    weight = random_blocks("Q4_1", 32, 64)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))  # beyond the decode path's 8 rows
    bf16 = kernels.gguf_linear(x, weight.blocks, "Q4_1", 64, isa=bf16_isa())
    assert torch.equal(GGUFLinear(weight, bf16_large_steps=True)(x), bf16)
    assert torch.equal(make_linear(weight, torch.float32, CPU, "auto", bf16_large_steps=True)(x), bf16)
    float32 = GGUFLinear(weight)(x)  # matmul_precision highest
    assert torch.equal(float32, kernels.gguf_linear(x, weight.blocks, "Q4_1", 64))
    assert not torch.equal(float32, bf16)


@needs_kernels
@needs_bf16_dot
def test_large_steps_take_amx_tiles_where_the_cpu_has_them_else_the_bf16_dot_body(monkeypatch):
    weight = random_blocks("Q4_1", 32, 64)
    assert GGUFLinear(weight, bf16_large_steps=True).isa == ("amx_bf16" if kernels.has_amx_bf16() else "avx512_bf16")
    monkeypatch.setattr(kernels, "has_amx_bf16", lambda: False)
    assert GGUFLinear(weight, bf16_large_steps=True).isa == "avx512_bf16"


AMX_OFF_CHILD = """
import torch
from nanoserve.engine.model import kernels
from nanoserve.engine.model.layers.quantized_linear import GGUFLinear
from tests.engine.model.test_quantized_linear import random_blocks
assert kernels.load()
weight = random_blocks("Q4_1", 16, 64)
print(kernels.has_amx_bf16(), GGUFLinear(weight, bf16_large_steps=True).isa)
try:
    kernels.gguf_linear(torch.zeros(8, 64), weight.blocks, "Q4_1", 64, isa="amx_bf16")
except RuntimeError as exc:
    print(str(exc).splitlines()[0])
"""


@needs_kernels
def test_without_amx_large_steps_take_the_bf16_dot_body_and_asking_for_amx_is_a_clear_error():
    """NANOSERVE_NO_AMX=1 (or a CPU without AMX): no tiles, and a call that asks for them says why."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NANOSERVE_NO_AMX": "1"}
    child = subprocess.run([sys.executable, "-c", AMX_OFF_CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr
    choice, error = child.stdout.splitlines()[-2:]
    assert choice == f"False {'avx512_bf16' if kernels.has_bf16_dot() else 'best'}"
    assert "isa amx_bf16 asked for on a CPU without AMX BF16 tiles, or where Linux refused their state" in error


@needs_kernels
def test_a_cpu_without_avx512_bf16_keeps_the_float32_panels_at_medium_precision(monkeypatch):
    monkeypatch.setattr(kernels, "has_amx_bf16", lambda: False)
    monkeypatch.setattr(kernels, "has_bf16_dot", lambda: False)
    weight = random_blocks("Q4_1", 32, 64)
    linear = GGUFLinear(weight, bf16_large_steps=True)
    assert linear.isa == "best"
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))  # beyond the decode path's 8 rows
    assert torch.equal(linear(x), kernels.gguf_linear(x, weight.blocks, "Q4_1", 64, isa="avx2"))


@needs_kernels
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("bf16_large_steps", [False, True])
def test_a_rows_output_does_not_depend_on_its_batch(quant_type, bf16_large_steps):
    weight = random_blocks(quant_type, 37, 96, seed=2)
    linear = GGUFLinear(weight, bf16_large_steps=bf16_large_steps)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([linear(x[i : i + 1]) for i in range(70)])
    for size in range(2, FEW_MAX_TOKENS + 1):  # the decode path: any number of rows up to 8, ragged tiles
        batched = torch.cat([linear(x[i : i + size]) for i in range(0, 70, size)])
        assert torch.equal(batched, alone), size
    whole = linear(x)
    for size in (9, 11, 16):  # the panel path (float32 or bf16): ragged panels and tiles
        batched = torch.cat([linear(x[i : i + size]) for i in range(0, 70 - 70 % size, size)])
        assert torch.equal(batched, whole[: 70 - 70 % size]), size
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x), whole)
        assert torch.equal(torch.cat([linear(x[i : i + 1]) for i in range(70)]), alone)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_bf16_activations_and_a_bias_come_back_in_their_dtype():
    weight = random_blocks("Q4_1", 16, 64)
    bias = torch.arange(16, dtype=torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)  # the float32 panel path: gguf's weights times x exactly
    got = make_linear(weight, torch.bfloat16, CPU, "auto", bias=bias)(x)
    expected = F.linear(x.float(), gguf_dense(weight)).to(torch.bfloat16) + bias
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_kernels
def test_inputs_it_cannot_take_are_clear_errors():
    weight = random_blocks("Q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16, got Double"):
        kernels.gguf_linear(torch.zeros(1, 64, dtype=torch.float64), weight.blocks, "Q4_1", 64)
    with pytest.raises(RuntimeError, match=r"x must be \[T, 64\]"):
        kernels.gguf_linear(torch.zeros(1, 32), weight.blocks, "Q4_1", 64)
    with pytest.raises(RuntimeError, match="blocks of 40 bytes per row do not hold 96 weights"):
        kernels.gguf_linear(torch.zeros(1, 96), weight.blocks, "Q4_1", 96)
    with pytest.raises(
        RuntimeError,
        match=r"isa must be 0 \(best\), 1 \(avx2\), 2 \(avx512\), 3 \(avx512_bf16\), 4 \(amx_bf16\), 5 \(int16\) "
        r"or 6 \(int16_avx2\), got 7",
    ):
        torch.ops.nanoserve.gguf_linear(torch.zeros(1, 64), weight.blocks, 3, 64, 7)


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
