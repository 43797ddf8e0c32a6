"""What batch invariance costs: nanoserve with ``--batch-invariant on`` against ``off``, in one process.

    .venv/bin/python -m bench.batch_invariance [--num-requests 64] [--rounds 2] [--threads 1]

Two engines on the default model (SmolLM2-135M-Instruct Q4_1 on nanoserve's GGUF kernels,
float16 KV cache), one with ``batch_invariant`` on (the int16 panels and the decode kernel
for prefill attention), one off (bf16 or float32 panels, SDPA prefill), take turns round by
round on the same work: a single stream (greedy, ``--single-tokens`` new tokens) and a batch
(``--num-requests`` mixed chats of ``bench.workload``, all at once; each round its own
prompts, so the prefix cache measures nothing). Each run is timed by the process's CPU time
(``time.process_time``: on a machine shared with other processes, wall time measures them
too) and by the wall clock; the table gives CPU ms per generated token and tokens per wall
second, and the ratios on/off. ``--threads`` fixes torch's thread count (1: CPU time is then
the work itself, no spinning workers).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from bench.peer_llamacpp import _ChatTokens
from bench.workload import WorkloadRequest, build_workload
from nanoserve.engine import LLM, SamplingParams, TokensPrompt


def timed(run: Callable[[], int]) -> tuple[float, float]:
    """(CPU ms per generated token, generated tokens per wall second) of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run()
    return (time.process_time() - cpu) * 1e3 / tokens, tokens / (time.perf_counter() - wall)


def batch(llm: LLM, workload: list[WorkloadRequest]) -> int:
    prompts = [TokensPrompt(r.prompt_token_ids) for r in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    return sum(len(o.token_ids) for o in llm.generate(prompts, params))


def single(llm: LLM, request: WorkloadRequest, num_tokens: int) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return len(llm.generate([TokensPrompt(request.prompt_token_ids)], params)[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engines = {
        mode: LLM(
            batch_invariant=mode,
            num_threads=args.threads,
            max_num_seqs=args.num_requests,
            event_log_url=None,
            kv_cache_memory=1 << 29,
        )
        for mode in ("on", "off")
    }
    chat = _ChatTokens(engines["on"])
    workloads = [
        build_workload(chat, args.num_requests, min_max_tokens=16, max_max_tokens=160, seed=args.seed + i)
        for i in range(args.rounds + 1)
    ]
    for llm in engines.values():  # warm up
        batch(llm, workloads[-1][:8])
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_id in range(args.rounds):
        for mode, llm in engines.items():
            torch.set_num_threads(args.threads)
            workload = workloads[round_id]
            results.setdefault(("single", mode), []).append(
                timed(partial(single, llm, workload[0], args.single_tokens))
            )
            results.setdefault(("batch", mode), []).append(timed(partial(batch, llm, workload)))
            print(f"# round {round_id} {mode}: {results[('batch', mode)][-1]}", flush=True)
    print(f"threads {args.threads}; {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print("| workload | CPU ms/token on | off | on/off | tok/s (wall) on | off |\n|---|---|---|---|---|---|")
    for workload in ("single", "batch"):
        on, off = results[(workload, "on")], results[(workload, "off")]
        cpu_on, cpu_off = min(c for c, _ in on), min(c for c, _ in off)
        print(
            f"| {workload} | {cpu_on:.2f} | {cpu_off:.2f} | {cpu_on / cpu_off:.3f} | "
            f"{max(w for _, w in on):.1f} | {max(w for _, w in off):.1f} |"
        )
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
