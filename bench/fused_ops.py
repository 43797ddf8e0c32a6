"""The fused layer ops of a float32 CPU decode against the torch ops they replace, and one step A/B.

    nice -n 19 .venv/bin/python -m bench.fused_ops [--tokens 1,64] [--repeats 7] [--threads 1] [--no-step]

Ops, per layer call, on SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads,
head_dim 64, intermediate 1536), microseconds per call (the best of ``--repeats`` runs
of ``--calls`` calls each, old and new interleaved in the same process):

- rope + K/V: old = ``LlamaDecoderLayer._rotated_qkv`` (apply_rope over Q and K) then
  ``write_kv`` (two ``index_copy_``); new = ``kernels.rope_and_write_kv`` (in place, one pass).
- silu * up: old = ``F.silu(gate).mul_(up)``; new = ``kernels.silu_and_mul``.

Step: one decode step of ``ModelRunner.forward`` on the default GGUF (float32, weights as
the server keeps them), ``--tokens`` sequences with ``--context-len`` tokens cached,
milliseconds, fused ops on and off (``llama.fused_ops_run``) alternating.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nanoserve.allocator import cdiv
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.model import kernels, llama
from nanoserve.engine.model.attention import write_kv
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice
from nanoserve.engine.model.layers.rope import RotaryEmbedding
from nanoserve.engine.model.model_runner import ModelRunner

SMOLLM2 = llama.LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)
BLOCK_SIZE = 16


def best_per_call(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each fn: the best over ``repeats`` runs of ``calls`` calls, the fns interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def op_timings(num_tokens: int, calls: int, repeats: int) -> list[tuple[str, float, float]]:
    """(op, old µs, new µs) for one layer call at ``num_tokens`` tokens."""
    c, gen = SMOLLM2, torch.Generator().manual_seed(0)
    layer = llama.LlamaDecoderLayer(c, 0)
    rope = RotaryEmbedding(
        c.head_dim, c.max_position_embeddings, c.rope_theta, None, torch.float32, torch.device("cpu")
    )
    cos, sin = rope.lookup(torch.arange(100, 100 + num_tokens))
    qkv = torch.randn(num_tokens, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, generator=gen)
    num_blocks = cdiv(num_tokens, BLOCK_SIZE) * 4
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]

    def rope_old() -> None:
        _, k, v = layer._rotated_qkv(qkv, cos, sin)
        write_kv(k, v, key_cache, value_cache, slots)

    def rope_new() -> None:  # rotates qkv in place on every call: the cost is the same
        kernels.rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, slots, c.num_heads, c.num_kv_heads)

    gate_up = torch.randn(num_tokens, 2 * c.intermediate_size, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    rope_s = best_per_call({"old": rope_old, "new": rope_new}, calls, repeats)
    silu_s = best_per_call(
        {"old": lambda: F.silu(gate).mul_(up), "new": lambda: kernels.silu_and_mul(gate_up)}, calls, repeats
    )
    return [
        ("rope + K/V write", rope_s["old"] * 1e6, rope_s["new"] * 1e6),
        ("silu * up", silu_s["old"] * 1e6, silu_s["new"] * 1e6),
    ]


def decode_step_timings(runner: ModelRunner, batch_size: int, context_len: int, repeats: int) -> tuple[float, float]:
    """(torch ops ms, fused ops ms) per decode step of ``batch_size`` sequences, alternating."""
    blocks_per_seq = cdiv(context_len + 1, runner.block_size)
    gen = torch.Generator().manual_seed(1)
    for cache in [*runner.kv_cache.key_caches, *runner.kv_cache.value_caches]:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    slices = [
        SeqSlice([100 + i], context_len, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
        for i in range(batch_size)
    ]
    batch = ForwardBatch.build(slices, runner.block_size)
    fused = llama.fused_ops_run

    def unfused(x: torch.Tensor) -> bool:
        return False

    def step(use_fused: bool) -> None:
        llama.fused_ops_run = fused if use_fused else unfused  # type: ignore[assignment]
        runner.forward(batch)

    try:
        times = best_per_call({"old": lambda: step(False), "new": lambda: step(True)}, calls=3, repeats=repeats)
    finally:
        llama.fused_ops_run = fused  # type: ignore[assignment]
    return times["old"] * 1e3, times["new"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,64", help="tokens per call (ops) and sequences per step")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--no-step", action="store_true", help="ops only, no model load")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"threads {args.threads}; best of {args.repeats} x {args.calls} calls")
    print(f"{'op':<18} {'T':>4} {'old µs':>9} {'new µs':>9} {'old/new':>8}")
    with torch.inference_mode():
        for num_tokens in token_counts:
            for name, old, new in op_timings(num_tokens, args.calls, args.repeats):
                print(f"{name:<18} {num_tokens:>4} {old:>9.1f} {new:>9.1f} {old / new:>7.2f}x")
    if args.no_step:
        return
    num_blocks = max(token_counts) * cdiv(args.context_len + 1, BLOCK_SIZE)
    config = EngineConfig.from_kwargs(
        device="cpu", dtype="float32", num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, num_threads=args.threads
    )
    runner = ModelRunner(config)
    print(f"\ndecode step, {runner.model_name}, context {args.context_len}, best of {args.repeats} x 3 steps")
    print(f"{'batch':>5} {'torch ops ms':>13} {'fused ms':>9} {'old/new':>8}")
    for batch_size in token_counts:
        old, new = decode_step_timings(runner, batch_size, args.context_len, args.repeats)
        print(f"{batch_size:>5} {old:>13.2f} {new:>9.2f} {old / new:>7.2f}x")


if __name__ == "__main__":
    main()
