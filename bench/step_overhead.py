"""Where a decode step's time goes outside the model: per-piece microseconds at batch 1 and 64.

Builds an ``LLMEngine`` as the server does (default model: SmolLM2-135M GGUF),
admits ``batch`` greedy requests with ``--prompt-len``-token prompts, steps until
every one decodes, then times ``--steps`` decode steps. Each piece is timed by
wrapping it in place with ``time.perf_counter``:

    schedule   scheduler.schedule()
    build      ForwardBatch.build (the step's tensors)
    prepare    attention.prepare (per-step attention metadata)
    model      the model's forward (every layer and the LM head)
    runner     the rest of ModelRunner.forward (thread tuner, inference mode, .float())
    sampler    Sampler.__call__
    engine     the rest of LLMEngine.step: SeqSlices, append_token (stop checks,
               detokenizer), register_computed, outputs, event persistence
    outside    step - model: everything outside the model's forward (what a cold
               cache after the forward costs lands on whichever piece runs
               first, so compare this sum more than the pieces)
    step       the whole LLMEngine.step

``--baseline REV``: the engine's side of a step as it is at git revision REV
(llm_engine, scheduler, forward_batch and sampler modules) takes turns with the
working tree's, step by step on the same engine, requests and pool; each gets
its own row. The model runner, attention and model are the working tree's in both.

    .venv/bin/python -m bench.step_overhead                        # profile
    .venv/bin/python -m bench.step_overhead --baseline main        # A/B against main
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core import llm_engine as llm_engine_module
from nanoserve.engine.core.llm_engine import LLMEngine
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.core.scheduler import Scheduler
from nanoserve.engine.model.forward_batch import ForwardBatch
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.sampling.sampler import Sampler
from nanoserve.engine.text.prompts import TokensPrompt
from nanoserve.service.logs import configure_logging

PIECES = ("schedule", "build", "prepare", "model", "runner", "sampler", "engine", "outside", "step")
REPO = Path(__file__).resolve().parent.parent


class Timings:
    """variant -> piece -> seconds of each call in the current window."""

    def __init__(self) -> None:
        self.variant = "working tree"
        self.samples: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.samples[self.variant][name].append(time.perf_counter() - started)

        return timed


@dataclass
class Variant:
    """One code version of the engine's side of a step: engine, scheduler, ForwardBatch, sampler.

    The engine and scheduler objects stay the same; ``use`` swaps their classes,
    so both versions step the same requests in the same pool.
    """

    name: str
    engine_module: types.ModuleType  # its llm_engine module: the ForwardBatch it builds is set there
    engine_class: type
    scheduler_class: type
    forward_batch: type  # a subclass whose build is timed
    sampler: Callable[..., Any]  # timed


def instrument(engine: LLMEngine, timings: Timings) -> Variant:
    """Wraps the engine's pieces in place (instance attributes); returns the working tree's variant."""
    runner = engine.runner
    scheduler = engine.scheduler
    # through the class of the moment, which ``use`` swaps
    scheduler.schedule = timings.wrap("schedule", lambda: type(scheduler).schedule(scheduler))  # type: ignore[method-assign]
    runner.attention.prepare = timings.wrap("prepare", runner.attention.prepare)  # type: ignore[method-assign]
    runner.model = timings.wrap("model", runner.model)  # type: ignore[assignment]
    runner.forward = timings.wrap("runner_total", runner.forward)  # type: ignore[method-assign]
    return make_variant("working tree", timings, llm_engine_module, Scheduler, ForwardBatch, Sampler())


def baseline_variant(rev: str, timings: Timings) -> Variant:
    """The variant of git revision ``rev`` (its llm_engine, scheduler, forward_batch and sampler modules)."""
    modules = {name: load_baseline(rev, name) for name in ("sampler", "forward_batch", "scheduler", "llm_engine")}
    return make_variant(
        rev,
        timings,
        modules["llm_engine"],
        modules["scheduler"].Scheduler,
        modules["forward_batch"].ForwardBatch,
        modules["sampler"].Sampler(),
    )


def make_variant(
    name: str,
    timings: Timings,
    engine_module: types.ModuleType,
    scheduler_class: type,
    forward_batch: type,
    sampler: Callable[..., Any],
) -> Variant:
    timed_build = timings.wrap("build", forward_batch.build.__func__)  # type: ignore[attr-defined]
    timed_class = type(forward_batch.__name__, (forward_batch,), {"build": classmethod(timed_build)})
    return Variant(
        name, engine_module, engine_module.LLMEngine, scheduler_class, timed_class, timings.wrap("sampler", sampler)
    )


def use(engine: LLMEngine, timings: Timings, variant: Variant) -> None:
    timings.variant = variant.name
    engine.__class__ = variant.engine_class
    engine.scheduler.__class__ = variant.scheduler_class
    variant.engine_module.ForwardBatch = variant.forward_batch
    engine.sampler = variant.sampler  # type: ignore[assignment]


def load_baseline(rev: str, name: str) -> types.ModuleType:
    """engine/<name>.py as it is at git revision ``rev``, loaded as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:engine/{name}.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    module_name = f"_baseline_{name}"
    spec = importlib.util.spec_from_loader(module_name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:engine/{name}.py", "exec"), module.__dict__)
    return module


def start_decoding(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Admits ``batch`` greedy requests and steps until every one of them decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        # distinct prompts, so prefix caching shares nothing
        prompt = [(7 * i + 13 * j) % 4000 + 100 for j in range(prompt_len)]
        engine.add_request(f"bench-{i}", TokensPrompt(prompt), params)
    while any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode of the last admitted: every request decodes from here on


def profile(engine: LLMEngine, timings: Timings, variants: list[Variant], steps: int) -> dict[str, dict[str, float]]:
    """variant -> piece -> median microseconds over ``steps`` decode steps, the variants taking turns."""
    timings.samples.clear()
    for index in range(steps):
        variant = variants[index % len(variants)]
        use(engine, timings, variant)
        started = time.perf_counter()
        engine.step()
        timings.samples[variant.name]["step"].append(time.perf_counter() - started)
    use(engine, timings, variants[0])
    result = {}
    for name, s in timings.samples.items():
        n = len(s["step"])
        for piece in ("schedule", "build", "prepare", "model", "runner_total", "sampler"):
            assert len(s[piece]) == n, f"{piece}: {len(s[piece])} calls in {n} steps"
        s["runner"] = [t - p - m for t, p, m in zip(s["runner_total"], s["prepare"], s["model"], strict=True)]
        s["engine"] = [
            st - sc - b - r - sa
            for st, sc, b, r, sa in zip(
                s["step"], s["schedule"], s["build"], s["runner_total"], s["sampler"], strict=True
            )
        ]
        s["outside"] = [st - m for st, m in zip(s["step"], s["model"], strict=True)]
        result[name] = {piece: statistics.median(s[piece]) * 1e6 for piece in PIECES}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder; default SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="decode steps profiled per batch size")
    parser.add_argument("--threads", type=int, default=1, help="the engine's num_threads; 0: tuned, as the server")
    parser.add_argument(
        "--event-log-url",
        default=None,
        help="the allocator's event log and request journal, as the server keeps them (it defaults to "
        "sqlite:///nanoserve-log.db); default none",
    )
    parser.add_argument("--baseline", default=None, help="git revision whose sampler and ForwardBatch take turns")
    args = parser.parse_args()
    configure_logging(log_level="info")  # as the server: debug lines filtered out
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_tokens = args.steps + 16
    engine = build_engine(
        EngineConfig.from_kwargs(
            model=args.model,
            num_threads=args.threads or None,
            event_log_url=args.event_log_url,
            max_num_seqs=max(batch_sizes),
            num_kv_blocks=max(batch_sizes) * (-(-(args.prompt_len + max_tokens) // 16) + 1),
        )
    )
    timings = Timings()
    variants = [instrument(engine, timings)]
    if args.baseline:
        variants.append(baseline_variant(args.baseline, timings))
    print(
        f"torch {torch.__version__}, {args.threads} threads, prompt {args.prompt_len}, {args.steps} decode steps, "
        f"event log {args.event_log_url}"
    )
    print(f"{'batch':>5} {'variant':<14} " + " ".join(f"{p:>9}" for p in PIECES) + "   (median µs per step)")
    for batch in batch_sizes:
        start_decoding(engine, batch, args.prompt_len, max_tokens)
        for name, figures in profile(engine, timings, variants, args.steps).items():
            print(f"{batch:>5} {name:<14} " + " ".join(f"{figures[p]:>9.1f}" for p in PIECES), flush=True)
        for request_id in [r.request_id for r in engine.scheduler.running]:
            engine.abort(request_id, AbortCause.CALLER)
        engine.step()
    engine.shutdown()


if __name__ == "__main__":
    main()
