"""Seeded sampling through the engine (issues 9 and 11), on the tiny random model.

A request's token at output position n is a function of its logits, settings,
seed and n: the same whatever shares the batch, after preemption and recompute,
and after a restart that re-admits it with the tokens it had generated. Every
request has an effective seed (the client's or a random one), and distinct seeds
draw differently.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.engine.errors import InvalidRequestError

SEEDED = SamplingParams(temperature=1.0, seed=20240607, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def make_llm(tiny_model_dir: Path) -> Callable[..., LLM]:
    def make(**kwargs: object) -> LLM:
        settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "block_size": 4}
        settings.update(kwargs)
        return LLM(model=str(tiny_model_dir), **settings)

    return make


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


def _prompts(num: int, seed: int, low: int = 3, high: int = 40) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [TokensPrompt([rng.randrange(3, 49152) for _ in range(rng.randint(low, high))]) for _ in range(num)]


def test_seeds_that_torch_folded_together_draw_different_tokens(llm: LLM) -> None:
    # Issue 9: 2**63 - 1, -1 and 2**32 - 1 drew identical tokens, as did -2**63 and 0.
    prompt = _prompts(1, seed=1)[0]
    seeds = [2**63 - 1, -1, 2**32 - 1, -(2**63), 0]
    outputs = llm.generate([prompt] * len(seeds), [dataclasses.replace(SEEDED, seed=s) for s in seeds])
    tokens = [o.token_ids for o in outputs]
    for a, b in itertools.combinations(range(len(seeds)), 2):
        assert tokens[a] != tokens[b], (seeds[a], seeds[b])


def test_seeded_request_draws_the_same_alone_or_in_any_batch(llm: LLM) -> None:
    prompts = _prompts(6, seed=2)
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in range(5, 10)]
    alone = llm.generate([prompts[0]], SEEDED)[0].token_ids
    first = llm.generate(prompts, [SEEDED, *others])[0].token_ids
    last = llm.generate(prompts[::-1], [*others[::-1], SEEDED])[-1].token_ids
    assert alone == first == last


def test_preempted_and_recomputed_requests_draw_the_uninterrupted_tokens(make_llm: Callable[..., LLM]) -> None:
    prompts = _prompts(12, seed=3, low=8, high=30)
    params = [dataclasses.replace(SEEDED, seed=i, max_tokens=24) for i in range(12)]
    expected = [o.token_ids for o in make_llm().generate(prompts, params)]
    small = make_llm(num_kv_blocks=24)  # 96 slots; one request needs up to 54
    outputs = small.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("num_prior", [1, 7, 19])
def test_restart_from_prompt_and_first_k_tokens_continues_exactly(llm: LLM, num_prior: int) -> None:
    # What a crash-resumable stream does: re-admit prompt + the k tokens already sent, same seed.
    prompt = _prompts(1, seed=4)[0].prompt_token_ids
    params = dataclasses.replace(SEEDED, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    full = llm.generate([TokensPrompt(prompt)], params)[0].token_ids
    resumed_prompt = TokensPrompt(prompt + full[:num_prior], num_prior_output_tokens=num_prior)
    rest = dataclasses.replace(params, max_tokens=params.max_tokens - num_prior)
    busy = _prompts(3, seed=5)  # re-admitted into a batch with other work
    outputs = llm.generate([*busy, resumed_prompt], [SamplingParams(temperature=0.7, ignore_eos=True)] * 3 + [rest])
    assert outputs[-1].token_ids == full[num_prior:]
    # Without the offset the draws restart at position 0: another continuation.
    restarted = llm.generate([TokensPrompt(prompt + full[:num_prior])], rest)[0].token_ids
    assert restarted != full[num_prior:]


def test_unseeded_request_gets_an_int64_seed_that_reproduces_it(llm: LLM) -> None:
    engine = llm.engine
    prompt = _prompts(1, seed=6)[0]
    unseeded = dataclasses.replace(SEEDED, seed=None)
    first = engine.process_request("u1", prompt, unseeded)
    second = engine.process_request("u2", prompt, unseeded)
    assert isinstance(first.seed, int)
    assert -(2**63) <= first.seed < 2**63
    assert first.seed != second.seed
    engine.add_processed(first)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.delta_token_ids
    replay = llm.generate([prompt], dataclasses.replace(SEEDED, seed=first.seed))[0].token_ids
    assert tokens == replay


@pytest.mark.parametrize("num_prior", [-1, 5, True])
def test_prior_output_tokens_must_leave_a_prompt_token(llm: LLM, num_prior: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.process_request("p", TokensPrompt([5, 6, 7, 8, 9], num_prior_output_tokens=num_prior), SEEDED)
    assert str(info.value) == (
        f"num_prior_output_tokens: must be an integer in [0, 5) (fewer than the prompt's tokens), got {num_prior!r}"
    )
