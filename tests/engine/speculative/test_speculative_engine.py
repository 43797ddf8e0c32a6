"""Speculative decoding in the engine: the same tokens as plain decoding, fewer steps, a clean log."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from nanoserve.allocator.log import audit, read_events
from nanoserve.allocator.log.reader import connect
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.core.llm_engine import LLMEngine
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.core.outputs import AbortCause, RequestOutput
from nanoserve.engine.core.scheduler import SchedulerOutput
from nanoserve.engine.journal.store import read_request_history
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import TokensPrompt

# a repeated 6-token phrase: lookups find it (the tiny random model also falls into loops of its own)
COPY_PROMPT = TokensPrompt([5, 17, 300, 42, 9, 77] * 5)
PLAIN_PROMPT = TokensPrompt([5, 17, 300, 42, 9, 77, 1000, 23, 8, 61])
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=3, seed=11, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def make_llm(make_tiny_llm: Callable[..., LLM]) -> Callable[..., LLM]:
    """The tiny model's LLMs, on one thread."""
    return functools.partial(make_tiny_llm, num_threads=1)


@pytest.fixture(scope="module")
def plain(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm()


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def _completion(output: RequestOutput) -> tuple[object, ...]:
    """Everything a client sees; logprobs rounded (the verify pass computes attention by SDPA where a decode
    uses the paged kernel: the last float32 bits of a logit may differ)."""
    c = output.outputs[0]
    logprobs = None
    if c.logprobs is not None:
        logprobs = [
            (entry.token_id, round(entry.logprob, 4), {t: round(v, 4) for t, v in entry.top_logprobs.items()})
            for entry in c.logprobs
        ]
    return (c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("prompt", [COPY_PROMPT, PLAIN_PROMPT], ids=["copy-heavy", "ordinary"])
def test_greedy_output_equals_plain_decoding_token_for_token(
    make_llm: Callable[..., LLM], plain: LLM, prompt: TokensPrompt, k: int
) -> None:
    [expected] = plain.generate(prompt, GREEDY)
    llm = make_llm(speculative="ngram", num_speculative_tokens=k)
    [got] = llm.generate(prompt, GREEDY)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(got.outputs[0].token_ids) == 40
    status = llm.engine.pool_status()
    assert status.num_accepted_draft_tokens > 0  # drafts were accepted: the test is not passing trivially
    assert status.num_draft_tokens >= status.num_accepted_draft_tokens
    assert llm.engine.allocator.num_free == 64


def test_accepted_drafts_save_steps(make_llm: Callable[..., LLM], plain: LLM) -> None:
    [expected] = plain.generate(COPY_PROMPT, GREEDY)
    llm = make_llm(speculative="ngram", num_speculative_tokens=4)
    steps_before = llm.engine._step
    [got] = llm.generate(COPY_PROMPT, GREEDY)
    num_steps = llm.engine._step - steps_before
    status = llm.engine.pool_status()
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    # one prefill step, then each step emits 1 + the drafts it accepted
    assert num_steps == 1 + 39 - status.num_accepted_draft_tokens


def test_speculating_and_plain_requests_share_steps(make_llm: Callable[..., LLM], plain: LLM) -> None:
    prompts = [COPY_PROMPT, PLAIN_PROMPT, PLAIN_PROMPT, COPY_PROMPT]
    params = [
        GREEDY,
        SAMPLED,
        dataclasses.replace(GREEDY, n=2, max_tokens=12),  # parallel sampling: never speculates
        dataclasses.replace(GREEDY, prompt_logprobs=1, max_tokens=20),  # prompt logprobs: never speculates
    ]
    expected = plain.generate(prompts, params)
    llm = make_llm(speculative="ngram", num_speculative_tokens=3)
    mixed_steps = []
    schedule = llm.engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        scheduled = schedule()
        drafted = {bool(chunk.draft_token_ids) for chunk in scheduled.chunks}
        mixed_steps.append(drafted == {True, False})
        return scheduled

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    got = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert got[3].prompt_logprobs == expected[3].prompt_logprobs
    assert any(mixed_steps)  # a step verified drafts beside plain decodes
    assert llm.engine.allocator.num_free == 64


def test_a_seeded_request_gives_the_same_tokens_every_run_and_as_without_speculation(
    make_llm: Callable[..., LLM], plain: LLM
) -> None:
    [expected] = plain.generate(COPY_PROMPT, SAMPLED)
    # 1-grams: the tiny model's sampled output repeats no 3-gram, and the test needs drafts to verify
    llm = make_llm(speculative="ngram", num_speculative_tokens=4, speculative_ngram_min=1)
    runs = [llm.generate(COPY_PROMPT, SAMPLED)[0] for _ in range(2)]
    assert _tokens(runs) == _tokens([expected, expected])
    assert llm.engine.pool_status().num_accepted_draft_tokens > 0


@pytest.mark.parametrize(
    ("change", "finish_reason"),
    [
        ({"max_tokens": 7}, "length"),  # reached mid-draft
        ({"logprobs": 2}, "length"),  # logprobs of accepted tokens only
        ({"stop_token_ids": 12}, "stop"),  # a stop token inside a draft (12: its index in the greedy output)
        ({"stop_token_ids": 11, "min_tokens": 14}, "stop"),  # a looping stop token, banned until min_tokens
        ({"stop": "ref"}, "stop"),  # a stop string from the middle of the greedy output
    ],
    ids=["max_tokens", "logprobs", "stop_token", "min_tokens", "stop_string"],
)
def test_finish_checks_and_logprobs_are_those_of_plain_decoding(
    make_llm: Callable[..., LLM], plain: LLM, change: dict[str, object], finish_reason: str
) -> None:
    [reference] = plain.generate(COPY_PROMPT, GREEDY)
    ref = reference.outputs[0]
    if isinstance(change.get("stop_token_ids"), int):
        change = {**change, "stop_token_ids": [ref.token_ids[change["stop_token_ids"]]]}  # type: ignore[index]
    if change.get("stop") == "ref":
        change = {**change, "stop": [ref.text[len(ref.text) // 2 :][:3]]}
    params = dataclasses.replace(GREEDY, **change)  # type: ignore[arg-type]
    [expected] = plain.generate(COPY_PROMPT, params)
    llm = make_llm(speculative="ngram", num_speculative_tokens=8)
    [got] = llm.generate(COPY_PROMPT, params)
    assert _completion(got) == _completion(expected)
    assert got.outputs[0].finish_reason == finish_reason
    assert llm.engine.pool_status().num_accepted_draft_tokens > 0
    assert llm.engine.allocator.num_free == 64


def test_the_log_of_a_speculating_run_flags_rolled_back_drafts_and_audits_clean(
    make_llm: Callable[..., LLM], plain: LLM, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = make_llm(speculative="ngram", num_speculative_tokens=8, event_log_url=url)
    got = llm.generate([COPY_PROMPT, PLAIN_PROMPT], GREEDY)
    assert _tokens(got) == _tokens(plain.generate([COPY_PROMPT, PLAIN_PROMPT], GREEDY))
    llm.engine.shutdown()
    events = read_events(url)
    rolled_back = [event for event in events if event.reason == "rejected_draft"]
    assert rolled_back  # blocks only rejected drafts needed went back in the step that rejected them
    assert {event.kind for event in rolled_back} == {"free_all"}  # never registered, never shared
    drafted = {(event.owner, event.step): set(event.block_ids) for event in events if event.reason == "draft"}
    assert {event.kind for event in events if event.reason == "draft"} == {"allocate_for"}
    for event in rolled_back:  # each rollback gives back blocks its owner's drafts took in that very step
        assert set(event.block_ids) <= drafted[event.owner, event.step], f"seq {event.seq}"
    registered: set[int] = set()  # blocks registered since they were last taken off the free stack
    for event in events:
        if event.kind in ("allocate", "allocate_for"):
            registered -= set(event.block_ids)
        elif event.kind == "register":
            registered |= set(event.block_ids)
        elif event.reason == "rejected_draft":
            assert not registered & set(event.block_ids), f"seq {event.seq} frees a registered block"
    report = audit(url)
    assert report.clean, report.render()
    with connect(url) as conn:  # the journal holds the emitted (accepted) tokens, nothing of a rejected draft
        histories = [read_request_history(conn, "default", f"llm-{i}") for i in range(2)]
    assert [history.token_ids if history else None for history in histories] == _tokens(got)


def test_preemption_under_a_small_pool_changes_no_token_and_audits_clean(
    make_llm: Callable[..., LLM], plain: LLM, tmp_path: Path
) -> None:
    prompts = [COPY_PROMPT, PLAIN_PROMPT, COPY_PROMPT, PLAIN_PROMPT]
    params = [GREEDY, GREEDY, SAMPLED, SAMPLED]
    expected = plain.generate(prompts, params)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    tight = make_llm(speculative="ngram", num_speculative_tokens=4, num_kv_blocks=24, event_log_url=url)
    got = tight.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert tight.engine.allocator.num_free == 24
    assert tight.engine.pool_status().num_accepted_draft_tokens > 0
    tight.engine.shutdown()
    reasons = {event.reason for event in read_events(url)}
    assert {"preempted", "rejected_draft"} <= reasons
    report = audit(url)
    assert report.clean, report.render()


def test_an_abort_while_speculating_frees_every_block(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(speculative="ngram", num_speculative_tokens=8)
    engine = llm.engine
    engine.add_request("spec", COPY_PROMPT, dataclasses.replace(GREEDY, max_tokens=200))
    for _ in range(6):
        engine.step()
    assert engine.pool_status().num_draft_tokens > 0
    engine.abort("spec", AbortCause.CANCELLED)
    [final] = engine.step()
    assert (final.finished, final.outputs[0].finish_reason) == (True, "abort")
    assert engine.allocator.num_free == 64


def _finish_all(engine: LLMEngine) -> list[RequestOutput]:
    finals: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finals += [output for output in engine.step() if output.finished]
    return finals


def test_a_speculating_request_resumes_after_a_crash_with_its_accepted_tokens_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    config = EngineConfig.from_kwargs(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=64,
        block_size=4,
        num_threads=1,
        event_log_url=url,
        speculative="ngram",
        num_speculative_tokens=8,
    )
    engine = build_engine(config)
    runner = engine.runner
    engine.add_request("undisturbed", COPY_PROMPT, GREEDY)
    [undisturbed] = _finish_all(engine)
    engine.add_request("k", COPY_PROMPT, GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.pool_status().num_accepted_draft_tokens > 0
    log = engine.event_log
    assert log is not None
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL: the epoch stays open, the request unfinished in the journal
    log._release()
    recovered = build_engine(config, runner=runner)
    [request] = recovered.recovered_requests
    assert 0 < request.num_output_tokens < 40  # the tokens released before the crash, nothing of a draft
    assert request.output_token_ids == undisturbed.outputs[0].token_ids[: request.num_output_tokens]
    [final] = _finish_all(recovered)
    recovered.shutdown()
    assert final.outputs[0].token_ids == undisturbed.outputs[0].token_ids
    report = audit(url)
    assert report.clean, report.render()


def test_a_parallel_request_whose_prompt_is_cached_but_one_token_does_not_speculate(
    make_llm: Callable[..., LLM], plain: LLM
) -> None:
    prompt = TokensPrompt([5, 17, 300, 42] * 2 + [5])  # 2 full blocks cached, then a 1-token chunk that could draft
    params = dataclasses.replace(GREEDY, n=2, max_tokens=8)
    expected = plain.generate(prompt, params)
    llm = make_llm(speculative="ngram", num_speculative_tokens=4)
    llm.generate(prompt, GREEDY)  # caches the prompt's full blocks
    llm.engine.add_request("parallel", prompt, params)
    finals = []
    for _ in range(20):  # bounded: a parent that drafted instead of forking never finished
        finals += [output for output in llm.engine.step() if output.finished]
    [got] = finals
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in expected[0].outputs]
    assert llm.engine.allocator.num_free == 64
