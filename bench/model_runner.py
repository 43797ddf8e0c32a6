"""Forward-pass throughput of ModelRunner against Hugging Face transformers, same model, same run.

Decode: ``batch`` sequences, each with ``--context-len`` tokens already cached,
each step one new token per sequence; tokens/s = batch * steps / seconds. The
caches are filled with random K/V instead of running a prefill (the numbers in
them do not change the cost). transformers decodes with its DynamicCache at the
same batch size and context length.
Prefill: ``--prefill-batch`` prompts of ``--prefill-len`` tokens in one forward
(ours packed, theirs [batch, len]; equal lengths, so no padding), logits of the
last position only on both sides.

Both sides load the same GGUF (SmolLM2-135M-Instruct by default) in the same dtype.

    .venv/bin/python -m bench.model_runner                       # full table
    .venv/bin/python -m bench.model_runner --batch-sizes 1,16 --dtypes bfloat16   # quick look
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nanoserve.allocator import cdiv
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice
from nanoserve.engine.model.model_runner import ModelRunner
from nanoserve.engine.model.weights import resolve_model_path


def load_transformers(model: str | None, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True, **kwargs).eval()


REPEATS = 2


def timed(fn) -> float:
    """Seconds per call: the best of REPEATS calls after one warm-up (the machine may be shared)."""
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def ours_decode(runner: ModelRunner, batch_size: int, context_len: int, steps: int) -> float:
    blocks_per_seq = cdiv(context_len + steps + 1, runner.block_size)
    for cache in runner.kv_cache.key_caches + runner.kv_cache.value_caches:
        cache.normal_()
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)]
    batches = [
        ForwardBatch.build([SeqSlice([17], context_len + s, t) for t in tables], runner.block_size, runner.device)
        for s in range(steps)
    ]

    def run() -> None:
        for batch in batches:
            runner.forward(batch)

    return batch_size * steps / timed(run)


@torch.inference_mode()
def hf_decode(model: torch.nn.Module, batch_size: int, context_len: int, steps: int) -> float:
    from transformers import DynamicCache

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    shape = (batch_size, config.num_key_value_heads, context_len, head_dim)
    dtype = model.dtype

    def run() -> None:
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
        tokens = torch.full((batch_size, 1), 17)
        mask = torch.ones(batch_size, context_len, dtype=torch.int64)
        for s in range(steps):
            mask = torch.cat([mask, torch.ones(batch_size, 1, dtype=torch.int64)], dim=1)
            positions = torch.full((batch_size, 1), context_len + s)
            model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)

    # cache set-up is inside the timed call: time it separately and subtract
    def setup_only() -> None:
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)

    return batch_size * steps / (timed(run) - timed(setup_only))


def ours_prefill(runner: ModelRunner, batch_size: int, length: int) -> float:
    blocks_per_seq = cdiv(length, runner.block_size)
    prompt = torch.randint(3, runner.vocab_size, (length,)).tolist()
    slices = [SeqSlice(prompt, 0, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(batch_size)]
    batch = ForwardBatch.build(slices, runner.block_size, runner.device)
    return batch_size * length / timed(lambda: runner.forward(batch))


@torch.inference_mode()
def hf_prefill(model: torch.nn.Module, batch_size: int, length: int) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, length)).repeat(batch_size, 1)
    return batch_size * length / timed(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1))


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder; default SmolLM2-135M-Instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context-len", type=int, default=128, help="tokens cached per sequence before decoding")
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed per batch size")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per cell; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default torch's own")
    args = parser.parse_args()
    REPEATS = args.repeats
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_batch = max([*batch_sizes, args.prefill_batch])
    tokens_per_seq = max(args.context_len + args.steps + 1, args.prefill_len)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; context {args.context_len}, "
        f"{args.steps} decode steps; prefill {args.prefill_batch} x {args.prefill_len}"
    )
    print(f"{'dtype':<9} {'phase':<8} {'batch':>5} {'nanoserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for dtype_name in args.dtypes.split(","):
        num_blocks = max_batch * cdiv(tokens_per_seq, 16)
        runner = ModelRunner(EngineConfig.from_kwargs(model=args.model, dtype=dtype_name, num_kv_blocks=num_blocks))
        model = load_transformers(args.model, runner.dtype)
        cells = [
            (
                "decode",
                b,
                functools.partial(ours_decode, runner, b, args.context_len, args.steps),
                functools.partial(hf_decode, model, b, args.context_len, args.steps),
            )
            for b in batch_sizes
        ]
        cells.append(
            (
                "prefill",
                args.prefill_batch,
                functools.partial(ours_prefill, runner, args.prefill_batch, args.prefill_len),
                functools.partial(hf_prefill, model, args.prefill_batch, args.prefill_len),
            )
        )
        for phase, batch, run_ours, run_theirs in cells:
            ours, theirs = run_ours(), run_theirs()
            print(
                f"{dtype_name:<9} {phase:<8} {batch:>5} {ours:>16.1f} {theirs:>19.1f} {ours / theirs:>5.2f}x",
                flush=True,
            )
        del runner, model


if __name__ == "__main__":
    main()
