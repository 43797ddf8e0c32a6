"""Parallel sampling (n, best_of): one prefill, forked block tables, each sample equal to a single request."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nanoserve.allocator import PoolState, apply
from nanoserve.allocator.log import audit, read_events
from nanoserve.allocator.log.record_codec import block_event_of
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.errors import InvalidRequestError
from nanoserve.engine.sampling.counter_rng import GAMMA, mix64, sample_seed
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import TokensPrompt

BLOCK_SIZE = 4
PROMPT = TokensPrompt([5, 17, 300, 42, 9, 77, 1000, 23, 8, 61])  # 10 tokens: blocks of 4, 4 and 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def make_llm(make_tiny_llm: Callable[..., LLM]) -> Callable[..., LLM]:
    return make_tiny_llm


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


def test_the_sample_seed_is_splitmix64s_output_i_plus_1() -> None:
    assert [sample_seed(7, i) for i in range(3)] == [7191089600892374487, 309689372594955804, -1830642326893942270]
    states = [(7 + (i + 1) * GAMMA) % 2**64 for i in range(3)]
    words = torch.tensor([state - 2**64 if state >= 2**63 else state for state in states])
    assert mix64(words).tolist() == [sample_seed(7, i) for i in range(3)]  # the counter_rng finalizer, on tensors


def test_greedy_samples_all_equal_the_single_greedy_answer(llm: LLM) -> None:
    [single] = llm.generate(PROMPT, GREEDY)
    [parallel] = llm.generate(PROMPT, dataclasses.replace(GREEDY, n=3))
    assert [output.index for output in parallel.outputs] == [0, 1, 2]
    assert [output.token_ids for output in parallel.outputs] == [single.token_ids] * 3
    assert [output.finish_reason for output in parallel.outputs] == ["length"] * 3
    assert llm.engine.allocator.num_free == 64


def test_each_sample_equals_the_single_request_with_its_derived_seed(llm: LLM) -> None:
    [parallel] = llm.generate(PROMPT, dataclasses.replace(SAMPLED, n=4))
    singles = llm.generate([PROMPT] * 4, [dataclasses.replace(SAMPLED, seed=sample_seed(7, i)) for i in range(4)])
    assert [output.token_ids for output in parallel.outputs] == [single.token_ids for single in singles]
    assert len({tuple(output.token_ids) for output in parallel.outputs}) > 1  # the samples differ


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(llm: LLM) -> None:
    [best] = llm.generate(PROMPT, dataclasses.replace(SAMPLED, n=2, best_of=4))
    [every] = llm.generate(PROMPT, dataclasses.replace(SAMPLED, n=4))
    assert [output.index for output in best.outputs] == [0, 1]
    assert {tuple(output.token_ids) for output in best.outputs} <= {tuple(o.token_ids) for o in every.outputs}
    assert llm.engine.allocator.num_free == 64


def test_the_log_holds_one_prefill_a_fork_per_sample_and_one_copy_each(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = make_llm(event_log_url=url)
    [parallel] = llm.generate(PROMPT, dataclasses.replace(GREEDY, n=8))
    request_id = "llm-0"
    llm.engine.shutdown()
    events = [event for event in read_events(url) if event.owner and event.owner.startswith(request_id)]
    kinds = Counter(event.kind for event in events)
    prefill = [event for event in events if event.owner == request_id and event.kind == "allocate_for"]
    assert [event.block_ids for event in prefill] == [(0, 1, 2)]  # the prompt's 10 tokens, computed once
    forks = [event for event in events if event.kind == "fork"]
    assert [(event.owner, event.block_ids, event.partial) for event in forks] == [
        (f"{request_id}#{i}", (0, 1, 2), True) for i in range(8)
    ]
    copies = [event for event in events if event.kind == "copy"]
    assert sorted(event.owner for event in copies) == [f"{request_id}#{i}" for i in range(8)]
    assert {event.block_ids[0] for event in copies} == {2}
    assert (kinds["fork"], kinds["copy"]) == (8, 8)
    assert len(parallel.outputs) == 8
    status = llm.engine.pool_status()
    assert (status.num_forked_blocks, status.num_copied_blocks) == (24, 8)
    pool = PoolState.fresh(64, BLOCK_SIZE)
    peak = 0
    for event in read_events(url):
        block_event = block_event_of(event)
        if block_event is not None:
            apply(pool, block_event)
            peak = max(peak, pool.num_allocated)
    assert peak <= 3 + 8 * math.ceil(6 / BLOCK_SIZE) + 8
    report = audit(url)
    assert report.clean, report.render()


def test_an_abort_ends_every_sample_and_frees_the_pool(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("abort-me", PROMPT, dataclasses.replace(GREEDY, n=4, max_tokens=50))
    streamed = []
    for _ in range(3):
        streamed += engine.step()
    assert {output.outputs[0].index for output in streamed} == {0, 1, 2, 3}
    assert not any(output.finished for output in streamed)
    engine.abort("abort-me", AbortCause.CANCELLED)
    [final] = engine.step()
    assert final.finished
    assert final.abort_cause is AbortCause.CANCELLED
    assert [output.finish_reason for output in final.outputs] == ["abort"] * 4
    assert engine.allocator.num_free == 64
    assert not engine.has_unfinished_requests()


def test_each_samples_last_streamed_output_carries_its_own_finish_time(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("timed", PROMPT, dataclasses.replace(GREEDY, n=2, max_tokens=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    *streamed, final = outputs
    ends = [output for output in streamed if output.outputs[0].finish_reason is not None]
    assert sorted(output.outputs[0].index for output in ends) == [0, 1]
    for end in ends:  # the stream's finish message of that sample: its total time is known (it was '-')
        assert end.metrics is not None
        assert end.metrics.finished_time is not None
        assert end.metrics.finished_time <= final.metrics.finished_time  # type: ignore[union-attr]
    assert not any(output.metrics.finished_time for output in streamed if output.outputs[0].finish_reason is None)  # type: ignore[union-attr]


def test_a_preempted_sample_recomputes_alone_and_every_sample_is_unchanged(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    roomy = make_llm()
    [undisturbed] = roomy.generate(PROMPT, dataclasses.replace(SAMPLED, n=4, max_tokens=12))
    url = f"sqlite:///{tmp_path / 'log.db'}"
    tight = make_llm(num_kv_blocks=12, event_log_url=url)  # prompt 3 blocks + 4 samples of 22 tokens: 19 > 12
    [squeezed] = tight.generate(PROMPT, dataclasses.replace(SAMPLED, n=4, max_tokens=12))
    assert [o.token_ids for o in squeezed.outputs] == [o.token_ids for o in undisturbed.outputs]
    assert tight.engine.allocator.num_free == 12
    tight.engine.shutdown()
    events = read_events(url)
    preempted = {event.owner for event in events if event.reason == "preempted"}
    assert preempted
    assert preempted <= {f"llm-0#{i}" for i in range(4)}  # samples only: the prompt's holder is never preempted
    forks = [event.owner for event in events if event.kind == "fork"]
    assert len(forks) > 4  # a preempted sample came back by forking the prompt again
    assert set(forks) == {f"llm-0#{i}" for i in range(4)}
    assert [e.block_ids for e in events if e.owner == "llm-0" and e.kind == "allocate_for"] == [(0, 1, 2)]  # once
    assert audit(url).clean


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"n": 0}, "n", "must be an integer >= 1, got 0"),
        ({"n": 2, "best_of": 1}, "best_of", "must be an integer >= n (2) or unset, got 1"),
    ],
)
def test_bad_sample_counts_are_refused_naming_the_field(params: dict[str, int], field: str, message: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**params)
    assert (refused.value.field, str(refused.value)) == (field, f"{field}: {message}")


def test_more_samples_than_the_limit_are_refused(make_llm: Callable[..., LLM], llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"n: must be in \[1, 16\] \(--max-parallel-samples\), got 17"):
        llm.generate(PROMPT, dataclasses.replace(GREEDY, n=17))
    with pytest.raises(InvalidRequestError, match=r"best_of: must be in \[1, 16\]"):
        llm.generate(PROMPT, dataclasses.replace(GREEDY, n=2, best_of=17))


# ---- logit_bias and truncate_prompt_tokens (beside n: the other sampling fields of issue 34) ----


def test_a_logit_bias_of_minus_100_forbids_the_greedy_first_token(llm: LLM) -> None:
    [greedy] = llm.generate(PROMPT, GREEDY)
    first = greedy.token_ids[0]
    [biased] = llm.generate(PROMPT, dataclasses.replace(GREEDY, logit_bias={first: -100.0}))
    assert biased.token_ids[0] != first
    assert first not in biased.token_ids  # banned at every position
    [forced] = llm.generate(PROMPT, dataclasses.replace(GREEDY, logit_bias={first + 1: 100.0}))
    assert forced.token_ids == [first + 1] * 6


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    [tail] = llm.generate(TokensPrompt(PROMPT.prompt_token_ids[-4:]), GREEDY)
    [truncated] = llm.generate(PROMPT, dataclasses.replace(GREEDY, truncate_prompt_tokens=4))
    assert truncated.prompt_token_ids == PROMPT.prompt_token_ids[-4:]
    assert truncated.token_ids == tail.token_ids
    [whole] = llm.generate(PROMPT, dataclasses.replace(GREEDY, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == PROMPT.prompt_token_ids


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias[5]", "must be in [-100, 100], got 100.5"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias[-1]", "token id -1 outside the vocabulary (ids are >= 0)"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias", "at most 300 entries, got 301"),
        (
            {"truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
            "must be -1 (the model's limit) or an integer >= 1, got -2",
        ),
        (
            {"truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
            "must be -1 (the model's limit) or an integer >= 1, got 0",
        ),
    ],
)
def test_bad_bias_or_truncation_is_refused_naming_the_field(
    params: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**params)  # type: ignore[arg-type]
    assert (refused.value.field, str(refused.value)) == (field, f"{field}: {message}")


def test_a_logit_bias_id_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    vocab_size = llm.engine.vocab_size
    with pytest.raises(
        InvalidRequestError,
        match=rf"logit_bias\[{vocab_size}\]: token id {vocab_size} outside the vocabulary \[0, {vocab_size}\)",
    ):
        llm.generate(PROMPT, dataclasses.replace(GREEDY, logit_bias={vocab_size: 1.0}))


def _forced_logprob(llm: LLM, prefix: list[int], token_id: int) -> float:
    """The model's logprob of ``token_id`` after ``prefix``: a one-token request forced to it (logprobs are raw)."""
    params = dataclasses.replace(GREEDY, max_tokens=1, logprobs=0, logit_bias={token_id: 100.0})
    [output] = llm.generate(TokensPrompt(prefix), params)
    logprobs = output.outputs[0].logprobs
    assert logprobs is not None
    assert logprobs[0].token_id == token_id
    return logprobs[0].logprob


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 4])  # whole, and in chunks of 4 over three steps
def test_prompt_logprobs_score_each_prompt_token_after_the_first(
    make_llm: Callable[..., LLM], max_num_batched_tokens: int
) -> None:
    llm = make_llm(max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=True)
    llm.generate(PROMPT, GREEDY)  # cached: a prompt_logprobs request computes its prompt anyway
    [output] = llm.generate(PROMPT, dataclasses.replace(GREEDY, prompt_logprobs=2))
    ids = PROMPT.prompt_token_ids
    assert output.prompt_logprobs is not None
    assert [entry.token_id for entry in output.prompt_logprobs] == ids[1:]
    assert [len(entry.top_logprobs) for entry in output.prompt_logprobs] == [2] * 9
    expected = [_forced_logprob(llm, ids[:j], ids[j]) for j in (1, 5, 9)]
    assert [output.prompt_logprobs[j - 1].logprob for j in (1, 5, 9)] == pytest.approx(expected, abs=1e-4)


def test_prompt_logprobs_come_once_on_the_stream_and_whole_at_the_end(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("scored", PROMPT, dataclasses.replace(GREEDY, prompt_logprobs=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.prompt_logprobs is not None for o in outputs] == [True] + [False] * (len(outputs) - 2) + [True]
    assert outputs[0].prompt_logprobs == outputs[-1].prompt_logprobs


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20], got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs: must be in [0, 20], got -1"),
        ({"prompt_logprobs": 1, "n": 2}, "prompt_logprobs: is not served with n or best_of above 1 (got 2 samples)"),
    ],
)
def test_bad_prompt_logprobs_are_refused(params: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**params)
    assert str(refused.value) == message
