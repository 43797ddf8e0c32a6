"""Benchmark the sampler's cost per decode step: counter-based inverse CDF vs the exponential race.

    .venv/bin/python -m bench.sampler [--batch-sizes 1,16,64,256] [--vocab-size 49152] [--repeats 7] [--threads 1]

One call of the sampler on a [batch, vocab_size] float32 logits batch, as the
engine makes once per decode step; milliseconds, best of ``--repeats`` calls,
old and new interleaved in the same process.

- new: ``nanoserve.engine.sampling.sampler.Sampler``: one uniform per row from
  (seed, output position), inverse CDF over the row's probabilities.
- old (the peer): the sampler as it was before (commit 92b4361): the same
  temperature / top-k / top-p / min-p, then the exponential race
  ``argmax(p / q)``, ``q ~ Exp(1)`` for every vocabulary entry, drawn from one
  shared generator for unseeded rows and from a per-request
  ``torch.Generator`` (a Python loop over rows) for seeded ones. Every request
  is seeded now (a random seed when the client gave none), so "old seeded" is
  the like-for-like peer and "old unseeded" the old fast path.

Scenarios: temperature 1.0 alone, and temperature 0.8 with top_p 0.95 (the
sort of the nucleus dominates both).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler, truncate_min_p, truncate_top_k_top_p


@dataclass
class Row:
    sampling_params: SamplingParams
    seed: int
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=lambda: [4, 5])
    num_prior_output_tokens: int = 0
    min_tokens_banned_ids: list[int] = field(default_factory=list)


class ExponentialRaceSampler:
    """The previous sampler's draw (no penalties or min_tokens in these scenarios, so none here)."""

    def __init__(self, rows: Sequence[Row], seeded: bool) -> None:
        self.shared = torch.Generator().manual_seed(0)
        self.generators = [torch.Generator().manual_seed(row.seed) if seeded else None for row in rows]

    def __call__(self, logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
        params = [row.sampling_params for row in rows]
        token_ids = torch.argmax(logits, dim=-1)
        probs = self._probs(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=self.shared)
        for i, generator in enumerate(self.generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        drawn = torch.argmax(probs / noise.clamp_(min=1e-20), dim=-1)
        greedy = torch.tensor([p.greedy for p in params])
        return torch.where(greedy, token_ids, drawn).tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        vocab_size = logits.shape[1]
        top_k = [p.top_k if p.top_k is not None else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            logits = truncate_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0.0 for p in params):
            logits = truncate_min_p(logits, [p.min_p for p in params])
        return torch.softmax(logits, dim=-1)


def realistic_logits(batch: int, vocab_size: int) -> torch.Tensor:
    """[batch, vocab_size]: a bulk with std 3 and a few tokens 12-20 ahead, like a language model's."""
    generator = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab_size, generator=generator) * 3
    top = torch.randint(0, vocab_size, (batch, 5), generator=generator)
    logits.scatter_add_(1, top, torch.tensor([20.0, 18.0, 17.5, 15.0, 12.0]).expand(batch, 5))
    return logits


def best_ms(call: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return times


def measure(params: SamplingParams, batch: int, vocab_size: int, repeats: int) -> tuple[float, float, float]:
    """(old unseeded, old seeded, new) ms per call, best of ``repeats``, interleaved."""
    logits = realistic_logits(batch, vocab_size)
    rows = [Row(params, seed=i) for i in range(batch)]
    new, old_unseeded, old_seeded = Sampler(), ExponentialRaceSampler(rows, False), ExponentialRaceSampler(rows, True)
    calls = {
        "old_unseeded": lambda: old_unseeded(logits, rows),
        "old_seeded": lambda: old_seeded(logits, rows),
        "new": lambda: new(logits, rows),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            times[name] += best_ms(call, 1)
    return min(times["old_unseeded"]), min(times["old_seeded"]), min(times["new"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--vocab-size", type=int, default=49152, help="SmolLM2's")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per cell; the best counts")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (the engine's shared-core advice)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scenarios = {
        "T=1.0": SamplingParams(temperature=1.0),
        "T=0.8 top_p=0.95": SamplingParams(temperature=0.8, top_p=0.95),
    }
    print(f"sampler per decode step, vocab {args.vocab_size}, {args.threads} thread(s), best of {args.repeats}, ms")
    header = f"{'scenario':<17} {'batch':>5} {'old unseeded':>13} {'old seeded':>11} {'new':>9}"
    print(f"{header} {'new/old unseeded':>17} {'new/old seeded':>15}")
    for name, params in scenarios.items():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            old_unseeded, old_seeded, new = measure(params, batch, args.vocab_size, args.repeats)
            print(
                f"{name:<17} {batch:>5} {old_unseeded:>13.2f} {old_seeded:>11.2f} {new:>9.2f}"
                f" {new / old_unseeded:>17.2f} {new / old_seeded:>15.2f}"
            )


if __name__ == "__main__":
    main()
