"""LLMEngine and LLM end to end on the tiny random model (float32, CPU).

Greedy tokens of the same prompt must not depend on what shares the batch,
on chunked prefill, or on preemption; blocks always come back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from nanoserve.engine import LLM, AbortCause, LLMEngine, SamplingParams, TokensPrompt
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.errors import DuplicateRequestError, InvalidRequestError, QueueFullError, RequestNotFoundError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


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


def _prompts(num: int, seed: int = 0, low: int = 3, high: int = 60) -> list[TokensPrompt]:
    rng = random.Random(seed)
    return [TokensPrompt([rng.randrange(3, 49152) for _ in range(rng.randint(low, high))]) for _ in range(num)]


def _mixed_params(num: int, seed: int = 1) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 20), ignore_eos=True) for _ in range(num)]


def test_generate_returns_outputs_in_prompt_order(llm: LLM) -> None:
    prompts = _prompts(3)
    outputs = llm.generate(prompts, [GREEDY, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), GREEDY])
    assert [len(o.token_ids) for o in outputs] == [12, 3, 12]
    assert [o.prompt_token_ids for o in outputs] == [p.prompt_token_ids for p in prompts]
    assert all(o.finish_reason == "length" and o.finished for o in outputs)
    assert (
        outputs[0].outputs[0].text
        == outputs[0].text
        == llm.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)
    )


def test_batch_invariance_alone_vs_batch_of_32(llm: LLM) -> None:
    prompts = _prompts(32)
    params = _mixed_params(32)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    for i in (0, 7, 19, 31):
        alone = llm.generate([prompts[i]], params[i])[0].token_ids
        assert alone == together[i], f"request {i} differs alone vs in a batch of 32"


def test_chunked_prefill_gives_same_tokens(make_llm: Callable[..., LLM], llm: LLM) -> None:
    prompts = _prompts(4, seed=2, low=40, high=60)
    chunked = make_llm(max_num_batched_tokens=16)
    assert [o.token_ids for o in chunked.generate(prompts, GREEDY)] == [
        o.token_ids for o in llm.generate(prompts, GREEDY)
    ]


def test_preemption_in_a_small_pool_gives_unpreempted_outputs(make_llm: Callable[..., LLM], llm: LLM) -> None:
    prompts = _prompts(12, seed=3, low=8, high=30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    small = make_llm(num_kv_blocks=24)  # 96 slots; one request needs up to 54
    outputs = small.generate(prompts, params)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert [o.token_ids for o in outputs] == expected
    status = small.engine.pool_status()
    assert (status.num_free, status.num_allocated, status.num_running, status.num_waiting) == (24, 0, 0, 0)


def test_preempted_stream_neither_repeats_nor_skips(make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(num_kv_blocks=24).engine
    prompts = _prompts(12, seed=3, low=8, high=30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    deltas: dict[str, list[int]] = {f"r{i}": [] for i in range(12)}
    texts: dict[str, str] = {f"r{i}": "" for i in range(12)}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id] += out.delta_token_ids
            texts[out.request_id] += out.delta_text
            if out.finished:
                finals[out.request_id] = out
    assert sum(o.metrics.num_preemptions for o in finals.values()) > 0
    for request_id, final in finals.items():
        assert deltas[request_id] == final.token_ids
        assert texts[request_id] == final.text


def _engine(make_llm: Callable[..., LLM], **kwargs: object) -> LLMEngine:
    return make_llm(**kwargs).engine


def test_abort_of_running_request_frees_its_blocks(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, num_kv_blocks=32)
    engine.add_request("a", TokensPrompt(list(range(3, 13))), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.pool_status().num_allocated == 3  # 10 prompt tokens in blocks of 4
    engine.abort("a", AbortCause.ABORT_RPC)
    assert engine.pool_status().num_free == 32
    (final,) = engine.step()
    assert (final.request_id, final.finished, final.finish_reason) == ("a", True, "abort")
    assert not engine.has_unfinished_requests()


def test_abort_of_waiting_request_removes_it(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, num_kv_blocks=32, max_num_seqs=1)
    engine.add_request("a", TokensPrompt([5, 6, 7]), GREEDY)
    engine.add_request("b", TokensPrompt([5, 6, 7]), GREEDY)
    engine.step()
    assert engine.pool_status().num_waiting == 1
    engine.abort("b", AbortCause.ABORT_RPC)
    status = engine.pool_status()
    assert (status.num_waiting, status.num_running, status.num_allocated) == (0, 1, 1)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("b", "abort")]


def test_abort_of_unknown_request_raises(llm: LLM) -> None:
    with pytest.raises(RequestNotFoundError):
        llm.engine.abort("nobody", AbortCause.ABORT_RPC)


def test_request_beyond_max_model_len_is_rejected_naming_both_numbers(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, max_model_len=64)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("a", TokensPrompt(list(range(3, 53))), SamplingParams(max_tokens=20))
    assert info.value.field == "max_tokens"
    assert "prompt (50 tokens) + max_tokens (20) = 70 exceeds max_model_len (64)" in str(info.value)
    assert not engine.has_unfinished_requests()


def test_request_beyond_the_whole_pool_is_rejected_naming_both_numbers(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, num_kv_blocks=8)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("a", TokensPrompt(list(range(3, 23))), SamplingParams(max_tokens=20))
    assert "= 40 tokens needs 10 KV blocks; the whole pool holds 8 blocks (32 tokens)" in str(info.value)


def test_max_tokens_none_fills_what_the_pool_and_max_model_len_allow(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, num_kv_blocks=8, max_model_len=1024)
    request = engine.process_request("a", TokensPrompt([5, 6]), SamplingParams(max_tokens=None))
    assert request.max_tokens == 30


def test_bad_token_id_in_prompt_is_rejected(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("a", TokensPrompt([5, 10**9]), GREEDY)
    assert info.value.field == "prompt_token_ids[1]"


def test_duplicate_live_request_id_is_rejected(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm)
    engine.add_request("a", TokensPrompt([5]), GREEDY)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("a", TokensPrompt([6]), GREEDY)


def test_queue_full_beyond_max_num_seqs_plus_max_num_waiting(make_llm: Callable[..., LLM]) -> None:
    engine = _engine(make_llm, max_num_seqs=1, max_num_waiting=2)
    for request_id in "abc":
        engine.add_request(request_id, TokensPrompt([5]), GREEDY)
    with pytest.raises(
        QueueFullError, match=r"^0 requests are running and 3 waiting \(max_num_seqs 1 \+ max_num_waiting 2\)$"
    ):
        engine.add_request("d", TokensPrompt([5]), GREEDY)


def test_a_burst_between_steps_fills_free_running_slots_before_it_is_refused(make_llm: Callable[..., LLM]) -> None:
    """Issue 29, item 5: 12 requests at once, 4 free slots and a queue of 2: 6 admitted, 6 refused."""
    engine = _engine(make_llm, max_num_seqs=4, max_num_waiting=2)
    admitted, refused = [], []
    for i in range(12):
        try:
            engine.add_request(f"burst{i}", TokensPrompt([5, 6, 7]), GREEDY)
            admitted.append(i)
        except QueueFullError:
            refused.append(i)
    assert (admitted, refused) == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
    engine.step()
    assert (engine.scheduler.num_running, engine.scheduler.num_waiting) == (4, 2)
    with pytest.raises(QueueFullError, match=r"^4 requests are running and 2 waiting"):
        engine.add_request("after-a-step", TokensPrompt([5]), GREEDY)
    for i in admitted:
        engine.abort(f"burst{i}", AbortCause.ABORT_RPC)
    engine.step()
    assert engine.scheduler.num_running + engine.scheduler.num_waiting == 0


def test_seeded_request_reproducible_across_batch_compositions(llm: LLM) -> None:
    prompts = _prompts(8, seed=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True) for n in range(5, 12)]
    in_batch = llm.generate(prompts, [seeded, *others])[0].token_ids
    assert alone == in_batch
    different_seed = llm.generate(
        [prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert different_seed[0].token_ids != alone


def test_stop_string_across_tokens_truncates_text(llm: LLM) -> None:
    prompt = _prompts(1, seed=5)[0]
    free_run = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    pieces = [llm.tokenizer.decode([t], skip_special_tokens=True) for t in free_run.token_ids]
    # a stop string made of the end of token 5's text and the start of token 6's
    i = next(
        i
        for i in range(4, 18)
        if len(pieces[i]) >= 2
        and len(pieces[i + 1]) >= 2
        and free_run.text.count(pieces[i][-2:] + pieces[i + 1][:2]) == 1
    )
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == free_run.text[: free_run.text.index(stop)]
    assert out.token_ids == free_run.token_ids[: i + 2]


def test_stop_string_at_the_very_start_gives_empty_text(llm: LLM) -> None:
    prompt = _prompts(1, seed=5)[0]
    free_run = llm.generate([prompt], GREEDY)[0]
    stop = free_run.text[:3]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", stop)
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]


def test_stop_token_id_ends_generation_and_is_kept_in_token_ids(llm: LLM) -> None:
    prompt = _prompts(1, seed=6)[0]
    free_run = llm.generate([prompt], GREEDY)[0]
    stop_id = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_id)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True)
    )[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(free_run.token_ids[:first], skip_special_tokens=True)


def test_min_tokens_holds_off_a_stop_token(llm: LLM) -> None:
    prompt = _prompts(1, seed=6)[0]
    stop_id = llm.generate([prompt], GREEDY)[0].token_ids[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop_token_ids=[stop_id])
    )[0]
    assert stop_id not in out.token_ids[:4]
    assert len(out.token_ids) > 4


def test_logprobs_follow_each_generated_token(llm: LLM) -> None:
    out = llm.generate(_prompts(1, seed=7), SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))[
        0
    ]
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None
    assert [lp.token_id for lp in logprobs] == out.token_ids
    for lp in logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top_logprobs) == 3
        assert next(iter(lp.top_logprobs)) == lp.token_id
        assert lp.logprob == pytest.approx(lp.top_logprobs[lp.token_id])


def test_metrics_are_ordered_in_time(llm: LLM) -> None:
    m = llm.generate(_prompts(1), GREEDY)[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_string_and_chat_prompts_are_tokenized(llm: LLM) -> None:
    from nanoserve.engine import ChatPrompt

    text = llm.generate(["Hello there"], GREEDY)[0]
    assert text.prompt_token_ids == llm.tokenizer.encode("Hello there")
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.generate([ChatPrompt(messages)], GREEDY)[0]
    assert chat.prompt_token_ids == llm.tokenizer.apply_chat_template(messages)


def test_engine_config_from_flat_names_builds_the_engine(tiny_model_dir: Path) -> None:
    config = EngineConfig.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=16, block_size=8
    )
    engine = LLMEngine(config)
    status = engine.pool_status()
    assert (status.num_blocks, status.block_size, status.num_free, status.epoch, status.last_seq) == (
        16,
        8,
        16,
        None,
        None,
    )


def test_event_log_of_a_preempting_workload_audits_clean(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    from nanoserve.allocator.log import audit, read_events

    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = make_llm(num_kv_blocks=24, event_log_url=url, enable_prefix_caching=False)
    prompts = _prompts(12, seed=3, low=8, high=30)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    status = llm.engine.pool_status()
    llm.shutdown()
    assert status.epoch == 1
    assert status.last_seq is not None
    assert status.last_seq > 24
    report = audit(url)
    assert report.clean
    assert report.closed
    assert report.leaked == {}
    assert report.state.num_blocks == 24
    assert len(report.state.free_block_ids) == 24
    events = read_events(url)
    preempted_owners = {e.owner for e in events if e.reason == "preempted"}
    assert preempted_owners == {o.request_id for o in outputs if o.metrics.num_preemptions > 0} != set()
    steps = [e.step for e in events if e.kind in ("allocate", "allocate_for", "free", "free_all")]
    assert None not in steps
    assert steps == sorted(steps)


def test_abort_is_logged_with_reason_aborted(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    from nanoserve.allocator.log import audit, read_events

    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = make_llm(num_kv_blocks=16, event_log_url=url, enable_prefix_caching=False)
    llm.engine.add_request("a", TokensPrompt([5, 6, 7, 8, 9]), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    llm.engine.abort("a", AbortCause.ABORT_RPC)
    llm.shutdown()
    frees = [(e.kind, e.block_ids, e.owner, e.reason) for e in read_events(url) if e.kind.startswith("free")]
    assert frees == [("free_all", (0, 1), "a", "aborted")]
    assert audit(url).clean


def test_each_step_is_one_batch_and_an_abort_between_steps_has_a_step_of_its_own(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    from nanoserve.allocator.log import read_events

    url = f"sqlite:///{tmp_path / 'log.db'}"
    engine = make_llm(num_kv_blocks=16, event_log_url=url, enable_prefix_caching=False).engine
    engine.add_request("a", TokensPrompt([5, 6, 7, 8, 9]), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("b", TokensPrompt([5, 6, 7]), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # step 1: both prefills
    assert engine.allocator.num_pending_events == 0
    engine.abort("b", AbortCause.ABORT_RPC)  # step 2, between scheduler steps
    engine.shutdown()  # step 3: a is aborted too
    events = read_events(url)
    assert [(e.seq, e.batch_seq, e.step, e.kind, e.block_ids, e.owner) for e in events[1:-1]] == [
        (2, 3, 1, "allocate_for", (0, 1), "a"),
        (3, 3, 1, "allocate_for", (2,), "b"),
        (4, 4, 2, "free_all", (2,), "b"),
        (5, 5, 3, "free_all", (0, 1), "a"),
    ]
    assert (events[-1].kind, events[-1].data) == ("pool_close", {"num_free": 16, "num_allocated": 0})


def test_engine_without_an_event_log_drops_the_allocator_events(make_llm: Callable[..., LLM]) -> None:
    engine = make_llm(num_kv_blocks=16).engine
    engine.add_request("a", TokensPrompt([5, 6, 7, 8, 9]), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.allocator.num_pending_events == 0


def test_engine_migrates_the_event_log_unless_told_not_to(make_llm: Callable[..., LLM], tmp_path: Path) -> None:
    from nanoserve.engine.errors import EventLogUnusableError

    url = f"sqlite:///{tmp_path / 'bare.db'}"
    with pytest.raises(EventLogUnusableError, match="holds no event log schema"):
        make_llm(event_log_url=url, event_log_migrate=False)
    llm = make_llm(event_log_url=url)
    assert llm.engine.pool_status().epoch == 1
    llm.shutdown()


def test_generate_with_one_bad_request_queues_nothing(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(_prompts(3), [GREEDY, GREEDY, SamplingParams(max_tokens=10**6)])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool_status().num_free == llm.engine.pool_status().num_blocks
