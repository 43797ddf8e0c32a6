"""The paged decode attention kernel's bodies against each other, microseconds per call.

    nice -n 19 .venv/bin/python -m bench.paged_attention [--batch 1,64] [--context-len 128,256]
        [--threads 1] [--repeats 7] [--layers 4] [--kv-cache-dtype float32,float16]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, block size 16, caches
[num_blocks, 16, 3, 64] in each ``--kv-cache-dtype``, the same values rounded); every
sequence ``--context-len`` tokens, its blocks scattered over one layer's cache (num_blocks =
batch x blocks per sequence, shuffled). Calls cycle over ``--layers`` such caches, as a
model's decode step does, so that with 4 (25 MB each at batch 64, context 256) each call
finds its K/V out of L3; with 1 they stay in L3 up to about context 128 at batch 64.
Per (batch, context): the best over ``--repeats`` runs of ``time.process_time`` (CPU time,
the machine is shared) of enough calls for about 2M keys read, the variants interleaved
(A/B/A/B) in one process: ``isa`` avx2 and avx512 where the kernel takes it and the CPU
has it, else the kernel as it is ("kernel"), times each cache dtype; the last column is
the first dtype's time over the last's (best isa). For a before/after, run this script against
another checkout's package, e.g. main's in a detached worktree:

    git worktree add --detach /work/wt/attn-base main
    mkdir -p /tmp/attnbase && ln -sfn /work/wt/attn-base /tmp/attnbase/nanoserve
    cd /tmp && PYTHONPATH=/tmp/attnbase nice -n 19 /work/wt/attn/.venv/bin/python \\
        /work/wt/attn/bench/paged_attention.py
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
from collections.abc import Callable

import torch

from nanoserve.engine.model import kernels

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
KEYS_PER_RUN = 2_000_000  # keys read per timed run (calls x batch x context)


def variants() -> list[str]:
    """The isa values to time: avx2 and avx512 (where the CPU has it), or one 'kernel' for an op without isa."""
    if "isa" not in inspect.signature(kernels.paged_decode_attention).parameters:
        return ["kernel"]
    return ["avx2", "avx512"] if kernels.best_isa() == "avx512" else ["avx2"]


def decode_calls(
    batch: int, context_len: int, num_layers: int, names: list[str], dtypes: list[str]
) -> dict[str, Callable[[], None]]:
    """Per variant (isa/dtype), one call of the op per layer on the same random inputs: q [batch, 9, 64],
    ``context_len`` keys."""
    gen = torch.Generator().manual_seed(batch * 1000 + context_len)
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    layers = []
    for _ in range(num_layers):
        key_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        value_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32)
        lens = torch.full((batch,), context_len, dtype=torch.int32)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
        layers.append((q, key_cache, value_cache, tables, lens, 1 / math.sqrt(HEAD_DIM)))

    def call(isa: str, dtype: str) -> Callable[[], None]:
        cast = getattr(torch, dtype)
        calls = [(q, k.to(cast), v.to(cast), *rest) for q, k, v, *rest in layers]

        def run() -> None:
            for args in calls:
                if isa == "kernel":  # an op without the isa argument
                    kernels.paged_decode_attention(*args)
                else:
                    kernels.paged_decode_attention(*args, isa=isa)  # type: ignore[call-arg]

        return run

    return {f"{n}/{d}": call(n, d) for n in names for d in dtypes}


def best_us_per_call(fns: dict[str, Callable[[], None]], calls: int, repeats: int) -> dict[str, float]:
    """CPU µs per call of each fn: the best over ``repeats`` runs of ``calls`` calls, the fns interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.process_time() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--context-len", default="128,256", help="comma-separated context lengths, tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the op's at::parallel_for)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant, the best kept")
    parser.add_argument("--layers", type=int, default=4, help="caches cycled over, one per layer (K/V cold in L3)")
    parser.add_argument(
        "--kv-cache-dtype", default="float32,float16", help="comma-separated cache dtypes: float32, float16, bfloat16"
    )
    args = parser.parse_args()
    if not kernels.load():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    names, dtypes = variants(), args.kv_cache_dtype.split(",")
    columns = [f"{n}/{d}" for n in names for d in dtypes]
    first, last = f"{names[-1]}/{dtypes[0]}", f"{names[-1]}/{dtypes[-1]}"
    print(f"threads {args.threads}, repeats {args.repeats}, layers {args.layers}, kernel {kernels.__file__}")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{c + ' µs':>16}" for c in columns) + f" {'ratio':>6}")
    for batch in [int(b) for b in args.batch.split(",")]:
        for context_len in [int(c) for c in args.context_len.split(",")]:
            calls = max(2, KEYS_PER_RUN // (batch * context_len * args.layers))
            fns = decode_calls(batch, context_len, args.layers, names, dtypes)
            us = {n: t / args.layers for n, t in best_us_per_call(fns, calls, args.repeats).items()}
            row = " ".join(f"{us[c]:>16.1f}" for c in columns)
            print(f"{batch:>5} {context_len:>7} {row} {us[first] / us[last]:>6.2f}")


if __name__ == "__main__":
    main()
