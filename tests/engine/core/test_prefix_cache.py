"""Prefix caching in the engine: hits compute only the tail, outputs never change, the log audits clean."""

from __future__ import annotations

import dataclasses
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nanoserve.allocator import block_key
from nanoserve.allocator.log import audit, read_events
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.model.forward_batch import ForwardBatch
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import TokensPrompt

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def make_llm(tiny_model_dir: Path) -> Callable[..., LLM]:
    def make(**kwargs: object) -> LLM:
        settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4}
        settings.update(kwargs)
        return LLM(model=str(tiny_model_dir), **settings)

    return make


@pytest.fixture
def computed(make_llm: Callable[..., LLM]) -> Iterator[tuple[LLM, list[int]]]:
    """An LLM with caching on, and the list of tokens each forward pass computed."""
    llm = make_llm()
    num_tokens: list[int] = []
    forward = llm.engine.runner.forward

    def counting(batch: ForwardBatch) -> object:
        num_tokens.append(batch.num_tokens)
        return forward(batch)

    llm.engine.runner.forward = counting  # type: ignore[method-assign]
    yield llm, num_tokens
    llm.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def generate_one(llm: LLM, tokens: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    return llm.generate(TokensPrompt(tokens), params)[0]


def test_same_prompt_twice_computes_only_the_tail_and_gives_the_same_tokens(
    computed: tuple[LLM, list[int]],
) -> None:
    llm, num_tokens = computed
    tokens = prompt(1, 22)  # 5 full blocks and 2 tokens
    first = generate_one(llm, tokens)
    assert first.metrics is not None
    assert first.metrics.num_cached_tokens == 0
    assert num_tokens[0] == 22
    num_tokens.clear()
    second = generate_one(llm, tokens)
    assert second.token_ids == first.token_ids
    assert second.metrics is not None
    assert second.metrics.num_cached_tokens == 20
    assert num_tokens[0] == 2  # the prefill computes the 2 uncached tokens only
    status = llm.engine.pool_status()
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (44, 20)


def test_a_prompt_of_whole_blocks_still_computes_its_last_block(computed: tuple[LLM, list[int]]) -> None:
    llm, num_tokens = computed
    tokens = prompt(2, 2 * BLOCK_SIZE)
    first = generate_one(llm, tokens)
    num_tokens.clear()
    second = generate_one(llm, tokens)
    assert second.token_ids == first.token_ids
    assert second.metrics is not None
    assert second.metrics.num_cached_tokens == BLOCK_SIZE
    assert num_tokens[0] == BLOCK_SIZE  # the block with the last token is computed, for its logits


def test_a_stale_key_is_a_miss_once_its_blocks_went_to_another_request(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(num_kv_blocks=8)
    a = prompt(3, 13)
    first = generate_one(llm, a, dataclasses.replace(GREEDY, max_tokens=3))
    a_keys = {key.key for key in block_key.extend_block_keys([], a, BLOCK_SIZE)}
    assert a_keys <= set(llm.engine.allocator.state().key_blocks)
    generate_one(llm, prompt(4, 28), dataclasses.replace(GREEDY, max_tokens=3))  # 8 blocks: every A block evicted
    assert a_keys.isdisjoint(llm.engine.allocator.state().key_blocks)
    again = generate_one(llm, a, dataclasses.replace(GREEDY, max_tokens=3))
    assert again.metrics is not None
    assert again.metrics.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    llm.shutdown()


def test_forced_hash_collisions_change_no_output(make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    system = prompt(5, 9)
    prompts = [system + prompt(10 + i, 3 + i) for i in range(4)] + [prompt(20 + i, 10) for i in range(3)]
    plain = make_llm(enable_prefix_caching=False)
    expected = [generate_one(plain, tokens).token_ids for tokens in prompts]
    plain.shutdown()
    monkeypatch.setattr(block_key, "digest", lambda payload: "c0" * 32)
    llm = make_llm()
    got = [generate_one(llm, tokens) for tokens in prompts]
    assert [output.token_ids for output in got] == expected
    # every key is the same: only a first block with the same tokens may hit, the system prompt's
    assert [output.metrics.num_cached_tokens for output in got if output.metrics] == [0, 4, 4, 4, 0, 0, 0]
    llm.shutdown()


def test_salts_pair_hits_only_within_one_salt(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    tokens = prompt(6, 17)
    salted = {salt: dataclasses.replace(GREEDY, cache_salt=salt) for salt in ("tenant-a", "tenant-b")}
    a1 = generate_one(llm, tokens, salted["tenant-a"])
    b1 = generate_one(llm, tokens, salted["tenant-b"])
    a2 = generate_one(llm, tokens, salted["tenant-a"])
    plain = generate_one(llm, tokens)
    llm.shutdown()
    cached = [o.metrics.num_cached_tokens for o in (a1, b1, a2, plain) if o.metrics]
    assert cached == [0, 0, 16, 0]  # the same salt hits; another salt, or none, never does
    assert a1.token_ids == b1.token_ids == a2.token_ids == plain.token_ids


def test_preemption_and_abort_of_a_sharer_leave_the_other_holders_outputs_unchanged(
    make_llm: Callable[..., LLM],
) -> None:
    system = prompt(7, 16)
    prompts = [system + prompt(30 + i, 5) for i in range(5)]
    params = dataclasses.replace(GREEDY, max_tokens=20)
    alone = make_llm(enable_prefix_caching=False)
    expected = [generate_one(alone, tokens, params).token_ids for tokens in prompts]
    alone.shutdown()

    llm = make_llm(num_kv_blocks=24)  # 5 x 11 blocks at the end: preemptions while the system prompt is shared
    generate_one(llm, [*system, 1], dataclasses.replace(GREEDY, max_tokens=1))  # caches the system prompt
    outputs = llm.generate([TokensPrompt(tokens) for tokens in prompts], params)
    assert [output.token_ids for output in outputs] == expected
    assert sum(output.metrics.num_preemptions for output in outputs if output.metrics) > 0
    assert all(output.metrics.num_cached_tokens == 16 for output in outputs if output.metrics)

    engine = llm.engine
    for i, tokens in enumerate(prompts[:3]):
        engine.add_request(f"s{i}", TokensPrompt(tokens), params)
    engine.step()
    engine.step()
    assert engine.allocator.num_shared >= 4  # the system prompt's 4 blocks, held by three requests
    engine.abort("s1", AbortCause.ABORT_RPC)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests() or engine.has_pending_outputs:
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
    assert (done["s0"], done["s2"]) == (expected[0], expected[2])
    assert engine.allocator.num_allocated == 0
    llm.shutdown()


def test_the_log_of_a_shared_workload_audits_clean_and_replays_the_cache(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = make_llm(num_kv_blocks=24, event_log_url=url, num_events_per_snapshot=15)
    system = prompt(8, 12)
    llm.generate(
        [TokensPrompt(system + prompt(40 + i, 6)) for i in range(6)], dataclasses.replace(GREEDY, max_tokens=16)
    )
    live = llm.engine.allocator.state()
    llm.shutdown()
    report = audit(url)
    assert report.clean, report.render()
    assert report.closed
    assert report.leaked == {}
    assert report.state == live
    kinds = {event.kind for event in read_events(url)}
    assert {"register", "share", "release"} <= kinds


# Admits three requests sharing a prefix, steps until the prefix's blocks are shared, then waits to be killed.
DRIVER = """
import sys, time
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.text.prompts import TokensPrompt
from nanoserve.engine.sampling.params import SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", num_kv_blocks=32, block_size=4,
          event_log_url=sys.argv[2], event_log_sync=True)
system = list(range(100, 112))
params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
llm.engine.add_request("first", TokensPrompt(system + [7]), SamplingParams(temperature=0.0, max_tokens=1))
while llm.engine.has_unfinished_requests():
    llm.engine.step()
for name in ("a", "b"):
    llm.engine.add_request(name, TokensPrompt(system + [len(name) + 1, 9]), params)
llm.engine.step()
llm.engine.step()
print("shared", llm.engine.allocator.num_shared, flush=True)
time.sleep(60)
"""


def test_sigkill_with_shared_blocks_audits_who_shared_what(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    process = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tiny_model_dir), url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        while line and not line.startswith("shared"):  # structlog's lines come first
            line = process.stdout.readline()
        assert line.strip() == "shared 3", line
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    started = time.monotonic()
    report = audit(url)
    assert time.monotonic() - started < 30
    assert report.clean
    assert report.crashed
    state = report.state
    assert state.shared_blocks() == {0: ["a", "b"], 1: ["a", "b"], 2: ["a", "b"]}
    assert "a" in report.render()
    assert "b" in report.render()
