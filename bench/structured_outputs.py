"""Structured outputs: what the grammar mask costs a batch, per step, and per compile.

Three measurements, printed as tables, on the default model (SmolLM2-135M GGUF) on the CPU:

1. Throughput: ``--num-requests`` (64) chat requests in parallel, greedy, ``--max-tokens``
   each; once all unconstrained, once with half of them constrained by a JSON schema.
   Generated tokens per second of each run, and the ratio constrained / unconstrained
   (target >= 0.9). The runs alternate ``--rounds`` times on the same engine; the best of
   each is kept (the machine may be shared).
2. Mask time per step: ``TokenMasker.fill`` (llguidance's bitmask for every row), then
   ``TokenMasker.bias`` and ``apply_token_mask`` (the logits set to -inf outside it, in place as the engine does
   when no row asks for logprobs) at batch 1 and 64, each row a
   JSON-schema matcher partway into its object; the median of ``--mask-repeats`` calls.
3. Compile time: a small schema (a person, 5 fields) and a large one (3 levels of 8-way
   oneOf), cold (a fresh compile) and cached (``GrammarCompiler.matcher`` again: a lookup
   and a matcher copy); the llguidance tokenizer's one-off build beside them.

    .venv/bin/python -m bench.structured_outputs
    .venv/bin/python -m bench.structured_outputs --num-requests 16 --max-tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.llm_engine import LLMEngine
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.structured.constraint import Constraint
from nanoserve.engine.structured.grammar_compiler import GrammarCompiler, compile_matcher, grammar_tokenizer
from nanoserve.engine.structured.token_mask import TokenMask, TokenMasker, apply_token_mask
from nanoserve.engine.text.prompts import ChatPrompt

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "colour", "address", "tags"],
}
TOPICS = ["a person", "a cat", "a city", "a book", "a car", "a song", "a planet", "a recipe"]


def large_schema(depth: int = 3, width: int = 8) -> dict:
    """``depth`` levels of ``width``-way oneOf, each branch an object with a patterned string."""
    schema: dict = {"type": "string"}
    for level in range(depth):
        branches = []
        for i in range(width):
            pattern = {"type": "string", "pattern": f"[a-z]{{{i},{i + 5}}}"}
            branches.append(
                {
                    "type": "object",
                    "properties": {f"k{level}_{i}": schema, f"x{i}": pattern},
                    "required": [f"k{level}_{i}"],
                }
            )
        schema = {"oneOf": branches}
    return schema


def run_batch(engine: LLMEngine, num_requests: int, max_tokens: int, constrained: bool) -> tuple[int, float]:
    """Generated tokens and wall seconds of one batch; every other request constrained when asked."""
    schema = Constraint("json_schema", json.dumps(PERSON_SCHEMA))
    for i in range(num_requests):
        with_schema = constrained and i % 2 == 0
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=not with_schema,
            constraint=schema if with_schema else None,
        )
        topic = TOPICS[i % len(TOPICS)]
        engine.add_request(
            f"r{i}", ChatPrompt([{"role": "user", "content": f"Describe {topic} as JSON. ({i})"}]), params
        )
    num_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return num_tokens, time.perf_counter() - start


def throughput(args: argparse.Namespace) -> None:
    config = EngineConfig.from_kwargs(
        device="cpu",
        max_num_seqs=args.num_requests,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=False,
        num_threads=args.num_threads,
    )
    engine = LLMEngine(config)
    run_batch(engine, 2, 2, constrained=True)  # warm-up: kernels, the llguidance tokenizer, the compile cache
    best: dict[bool, tuple[float, int, float]] = {}
    for _ in range(args.rounds):
        for constrained in (False, True):
            num_tokens, wall_s = run_batch(engine, args.num_requests, args.max_tokens, constrained)
            rate = num_tokens / wall_s
            if constrained not in best or rate > best[constrained][0]:
                best[constrained] = (rate, num_tokens, wall_s)
    mask_times = engine.structured.take_stats().mask_times_s
    print(f"\n{args.num_requests} parallel requests, greedy, max {args.max_tokens} tokens, best of {args.rounds}")
    print(f"{'workload':<28}{'tokens':>8}{'wall s':>9}{'tok/s':>9}")
    for constrained, label in ((False, "unconstrained"), (True, "half JSON schema")):
        rate, num_tokens, wall_s = best[constrained]
        print(f"{label:<28}{num_tokens:>8}{wall_s:>9.2f}{rate:>9.1f}")
    print(f"throughput ratio (half constrained / unconstrained): {best[True][0] / best[False][0]:.3f}")
    if mask_times:
        print(
            f"mask fill in those steps: median {statistics.median(mask_times) * 1e3:.3f} ms "
            f"over {len(mask_times)} steps"
        )
    engine.shutdown()


def mask_times(args: argparse.Namespace, compiler: GrammarCompiler) -> None:
    vocab_size = compiler.vocab_size
    masker = TokenMasker(vocab_size)
    prefix = compiler._tokenizer.encode('{"name": "Ada", "age": 36, "colour": "')
    print(f"\nmask time per step (median of {args.mask_repeats}), rows partway into a JSON schema")
    print(f"{'batch':>6}{'fill ms':>10}{'apply ms':>10}{'total ms':>10}")
    for batch in (1, 64):
        matchers = [compiler.matcher(Constraint("json_schema", json.dumps(PERSON_SCHEMA))) for _ in range(batch)]
        for matcher in matchers:
            assert matcher.consume_tokens(prefix)
        logits = torch.randn(batch, vocab_size)
        masker.fill(matchers)  # warm-up
        fill_s, apply_s = [], []
        for _ in range(args.mask_repeats):
            start = time.perf_counter()
            bitmask = masker.fill(matchers)
            step_logits = logits.clone()  # what the runner hands the sampler
            middle = time.perf_counter()
            mask = TokenMask(list(range(batch)), bitmask, masker.bias(bitmask))
            apply_token_mask(step_logits, mask, in_place=True)  # as the engine does
            fill_s.append(middle - start)
            apply_s.append(time.perf_counter() - middle)
        fill, apply = statistics.median(fill_s) * 1e3, statistics.median(apply_s) * 1e3
        print(f"{batch:>6}{fill:>10.3f}{apply:>10.3f}{fill + apply:>10.3f}")


def compile_times(compiler: GrammarCompiler) -> None:
    compile_matcher(Constraint("regex", "[a-z]+"), compiler.ll_tokenizer)  # warm-up: llguidance's one-off set-up
    print("\ncompile time")
    print(f"{'schema':<34}{'chars':>8}{'cold ms':>10}{'cached ms':>11}")
    for label, schema in (("small (person, 5 fields)", PERSON_SCHEMA), ("large (3 x 8-way oneOf)", large_schema())):
        constraint = Constraint("json_schema", json.dumps(schema))
        start = time.perf_counter()
        compile_matcher(constraint, compiler.ll_tokenizer)
        cold_s = time.perf_counter() - start
        compiler.matcher(constraint)  # into the cache
        start = time.perf_counter()
        compiler.matcher(constraint)
        cached_s = time.perf_counter() - start
        print(f"{label:<34}{len(constraint.text):>8}{cold_s * 1e3:>10.2f}{cached_s * 1e3:>11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mask-repeats", type=int, default=50)
    parser.add_argument("--skip-throughput", action="store_true", help="the mask and compile tables only")
    parser.add_argument(
        "--num-threads", type=int, default=1, help="torch threads (1: on a shared machine, OpenMP barriers stall)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}")
    from nanoserve.engine.model.weights import default_model_path
    from nanoserve.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(default_model_path())
    start = time.perf_counter()
    grammar_tokenizer(tokenizer, tokenizer.vocab_size)
    print(f"llguidance tokenizer build (once per engine): {(time.perf_counter() - start) * 1e3:.1f} ms")
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, compile_timeout_s=60.0, max_cached=16)
    compile_times(compiler)
    mask_times(args, compiler)
    compiler.close()
    if not args.skip_throughput:
        throughput(args)


if __name__ == "__main__":
    main()
