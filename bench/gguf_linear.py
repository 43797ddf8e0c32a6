"""nanoserve's GGUF matmul kernel on the default model's shapes: milliseconds per decode step's worth of matmuls.

    .venv/bin/python -m bench.gguf_linear [--tokens 1,4,64,512] [--layers 30] [--repeats 3] [--threads 1]

SmolLM2-135M's linears, as ``quantization auto`` holds them: per layer QKV [960, 576],
o_proj [576, 576], gate/up [3072, 576] and down [576, 1536] in Q4_1, regrouped four rows
to a record (``kernels.group_rows``), and the tied lm_head [49152, 576] in Q8_0 rows. The
blocks are random codes with scales of the model's size (the cost does not depend on the
values). Per token count T: ``--layers`` layers' four matmuls of x [T, K], then the
lm_head once, each timed by ``time.process_time`` (CPU time: the machine is shared), the
best of ``--repeats``, for each body the CPU has (``isa`` avx2, avx512: float32 x, the
same bits; avx512_bf16 and amx_bf16: bfloat16 x, as a bf16 model passes it), interleaved in
one process. Up to 8 tokens the decode path runs (16-bit activations, integer dots; the bf16
isas are avx512 there); beyond, the float32 panels, avx512_bf16's bf16 dot products,
amx_bf16's AMX tiles, or int16's panels (the decode path's arithmetic at every step size,
batch invariance; AVX-512 VNNI, else the decode tiles 8 (AVX2: 4) rows at a time).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from nanoserve.engine.model import kernels

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out_features, in_features)
VOCAB_SIZE, HIDDEN_SIZE = 49152, 576


def random_blocks(quant_type: str, rows: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """GGUF blocks [rows, in_features / 32 * block bytes] uint8: random codes, d ~ 1e-3..1e-2 (and m < 0)."""
    num_blocks = in_features // 32
    block_bytes = {"Q4_1": 20, "Q8_0": 34}[quant_type]
    raw = rng.integers(0, 256, size=(rows, num_blocks, block_bytes), dtype=np.uint8)
    d = (rng.random((rows, num_blocks)) * 0.009 + 0.001).astype(np.float16)
    raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, num_blocks, 2)
    if quant_type == "Q4_1":
        m = (-rng.random((rows, num_blocks)) * 0.05).astype(np.float16)
        raw[:, :, 2:4] = m.view(np.uint8).reshape(rows, num_blocks, 2)
    return torch.from_numpy(raw.reshape(rows, num_blocks * block_bytes))


def best_cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The least CPU time of ``repeats`` calls after one warm-up, in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def run_layers(
    layers: list[tuple[torch.Tensor, int]], inputs: dict[int, torch.Tensor], num_layers: int, isa: str
) -> None:
    """``num_layers`` layers' four matmuls, x [T, K] for each weight's K."""
    for _ in range(num_layers):
        for blocks, k in layers:
            kernels.gguf_linear(inputs[k], blocks, "Q4_1", k, isa=isa, layout="groups")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4,64,512", help="comma-separated token counts T")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if not kernels.load():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    layers = [(kernels.group_rows(random_blocks("Q4_1", n, k, rng), "Q4_1", k), k) for n, k in LAYER_SHAPES]
    lm_head = random_blocks("Q8_0", VOCAB_SIZE, HIDDEN_SIZE, rng)
    isas = ["avx2", "avx512"] if kernels.best_isa() == "avx512" else ["avx2"]
    isas += ["avx512_bf16"] if kernels.has_bf16_dot() else []
    isas += ["amx_bf16"] if kernels.has_amx_bf16() else []
    isas += ["int16"]
    print(f"threads {args.threads}; {args.layers} layers; best of {args.repeats}; CPU ms")
    print(f"{'T':>5} {'isa':>11} {'layers ms':>10} {'lm_head ms':>11}")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        float_inputs = {k: torch.randn(num_tokens, k) for _, k in LAYER_SHAPES}
        bf16_inputs = {k: x.bfloat16() for k, x in float_inputs.items()}
        for isa in isas:
            inputs = bf16_inputs if isa.endswith("_bf16") else float_inputs
            layers_ms = best_cpu_ms(partial(run_layers, layers, inputs, args.layers, isa), args.repeats)
            head_ms = best_cpu_ms(
                partial(kernels.gguf_linear, inputs[HIDDEN_SIZE], lm_head, "Q8_0", HIDDEN_SIZE, isa=isa), args.repeats
            )
            print(f"{num_tokens:>5} {isa:>11} {layers_ms:>10.1f} {head_ms:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
