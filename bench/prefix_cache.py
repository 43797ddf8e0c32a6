"""Prefix caching on vs off, same model, same workloads, same run.

Two chat workloads (token ids drawn with a fixed seed; greedy, ignore_eos):

* shared system prompt: ``--num-requests`` requests (256) that each send one
  ``--system-tokens`` (1,000) token system prompt and a short question
  (16-48 tokens), ``--max-tokens`` (16) new tokens each, all arriving at once;
* multi-turn: ``--num-conversations`` (8) conversations of ``--num-turns``
  turns; each turn re-sends the whole history (previous prompt + the answer
  it got + a new question), the conversations' turns in rounds.

For each, caching on and off run through ``LLM.generate`` with an event log
(SQLite in a temporary folder) so that the cost of the extra events is in
the figures: throughput (generated tokens / s and prompt tokens / s, and per
CPU second of the process, which other processes on a shared machine do not
stretch as they stretch wall time), TTFT
p50/p99 (arrival to first token; all requests of a round arrive together),
the hit rate (prefix_cache_hits / prefix_cache_queries, tokens), and the
events and log bytes per scheduler step. Ratios are on / off.

    .venv/bin/python -m bench.prefix_cache                       # the issue's workload
    .venv/bin/python -m bench.prefix_cache --num-requests 64      # quicker
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.allocator.log import read_events
from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.engine.core.outputs import RequestOutput


@dataclass
class Result:
    seconds: float
    cpu_seconds: float  # the process's CPU time (every thread): what the work cost, whatever else ran
    num_prompt_tokens: int
    num_generated: int
    ttfts_s: list[float]
    hit_rate: float
    num_steps: int
    num_events: int
    log_bytes: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.seconds

    def ttft_percentile(self, q: float) -> float:
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def random_tokens(rng: random.Random, num: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(num)]


def shared_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = random_tokens(rng, args.system_tokens, vocab_size)
    return [system + random_tokens(rng, rng.randint(16, 48), vocab_size) for _ in range(args.num_requests)]


def make_llm(args: argparse.Namespace, enable_prefix_caching: bool, log_url: str) -> LLM:
    return LLM(
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=enable_prefix_caching,
        event_log_url=log_url,
        batch_invariant=args.batch_invariant,
    )


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([TokensPrompt(p) for p in prompts], params)


def run(args: argparse.Namespace, enable_prefix_caching: bool, folder: Path, workload: str) -> Result:
    """One workload through a fresh engine; its log is read back for the event figures."""
    url = f"sqlite:///{folder / f'{workload}-{enable_prefix_caching}.db'}"
    llm = make_llm(args, enable_prefix_caching, url)
    vocab_size = llm.engine.vocab_size
    generate(llm, [[5, 6, 7]], 2)  # warm-up
    llm.engine.scheduler.prefix_cache_queries = llm.engine.scheduler.prefix_cache_hits = 0
    outputs: list[RequestOutput] = []
    num_prompt_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    if workload == "shared":
        prompts = shared_prompts(args, vocab_size)
        num_prompt_tokens = sum(map(len, prompts))
        outputs = generate(llm, prompts, args.max_tokens)
    else:
        rng = random.Random(args.seed + 1)
        histories = [random_tokens(rng, rng.randint(200, 400), vocab_size) for _ in range(args.num_conversations)]
        for _ in range(args.num_turns):
            num_prompt_tokens += sum(map(len, histories))
            answers = generate(llm, histories, args.max_tokens)
            outputs += answers
            histories = [
                h + a.token_ids + random_tokens(rng, rng.randint(16, 48), vocab_size)
                for h, a in zip(histories, answers, strict=True)
            ]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    status = llm.engine.pool_status()
    llm.shutdown()
    events = read_events(url)
    steps = max(event.step for event in events if event.step is not None)  # the warm-up's included
    log_bytes = Path(url.removeprefix("sqlite:///")).stat().st_size
    ttfts = [o.metrics.ttft_s for o in outputs if o.metrics is not None and o.metrics.ttft_s is not None]
    return Result(
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        num_prompt_tokens=num_prompt_tokens,
        num_generated=sum(len(o.token_ids) for o in outputs),
        ttfts_s=ttfts,
        hit_rate=status.prefix_cache_hits / status.prefix_cache_queries if status.prefix_cache_queries else 0.0,
        num_steps=steps,
        num_events=len(events),
        log_bytes=log_bytes,
        outputs=[o.token_ids for o in outputs],
    )


def report(name: str, on: Result, off: Result) -> None:
    print(f"\n{name}: {len(on.ttfts_s)} requests, {on.num_prompt_tokens} prompt tokens, {on.num_generated} generated")
    print(f"{'':<24}{'caching on':>14}{'caching off':>14}{'on/off':>10}")
    rows = [
        ("seconds", on.seconds, off.seconds),
        ("CPU seconds", on.cpu_seconds, off.cpu_seconds),
        ("generated tok / CPU s", on.num_generated / on.cpu_seconds, off.num_generated / off.cpu_seconds),
        ("generated tok/s", on.tokens_per_s, off.tokens_per_s),
        ("prompt tok/s", on.num_prompt_tokens / on.seconds, off.num_prompt_tokens / off.seconds),
        ("TTFT p50 (s)", on.ttft_percentile(0.5), off.ttft_percentile(0.5)),
        ("TTFT p99 (s)", on.ttft_percentile(0.99), off.ttft_percentile(0.99)),
        ("hit rate (tokens)", on.hit_rate, off.hit_rate),
        ("scheduler steps", on.num_steps, off.num_steps),
        ("events per step", on.num_events / on.num_steps, off.num_events / off.num_steps),
        ("log KiB per step", on.log_bytes / 1024 / on.num_steps, off.log_bytes / 1024 / off.num_steps),
    ]
    for label, a, b in rows:
        ratio = f"{a / b:>10.2f}" if b else f"{'':>10}"
        print(f"{label:<24}{a:>14.3f}{b:>14.3f}{ratio}")
    same = on.outputs == off.outputs
    print(f"outputs identical on vs off: {same}")
    print(
        f"targets: TTFT p50 off/on {off.ttft_percentile(0.5) / on.ttft_percentile(0.5):.1f}x (>= 5x), "
        f"throughput on/off {on.tokens_per_s / off.tokens_per_s:.1f}x wall, "
        f"{off.cpu_seconds / on.cpu_seconds:.1f}x per CPU second (>= 2x); "
        f"load average {os.getloadavg()[0]:.1f} (other processes stretch wall times, not CPU seconds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes of KV cache")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--only", choices=("shared", "multi-turn"), default=None)
    parser.add_argument(
        "--batch-invariant",
        choices=("auto", "on", "off"),
        default="auto",
        help="nanoserve's --batch-invariant (auto: on where the CPU has AVX-512 VNNI)",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch threads {torch.get_num_threads()}, dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, "
        f"batch_invariant {args.batch_invariant}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for workload, name in (("shared", "shared system prompt"), ("multi-turn", "multi-turn conversations")):
            if args.only not in (None, workload):
                continue
            on = run(args, True, Path(folder), workload)
            off = run(args, False, Path(folder), workload)
            report(name, on, off)


if __name__ == "__main__":
    main()
