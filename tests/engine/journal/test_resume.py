"""AsyncLLMEngine.resume: the journaled tail, then the live outputs, on the tiny model."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nanoserve.engine import AsyncLLMEngine, EngineConfig, RequestOutput, SamplingParams, TokensPrompt
from nanoserve.engine.core.log_setup import build_engine
from nanoserve.engine.core.outputs import AbortCause
from nanoserve.engine.errors import InvalidRequestError, JournalDisabledError, RequestNotFoundError

PROMPT = TokensPrompt([101, 202, 303, 404, 505])


def _config(tiny_model_dir: Path, log_url: str | None, **overrides: object) -> EngineConfig:
    settings: dict[str, object] = {
        "model": str(tiny_model_dir),
        "dtype": "float32",
        "device": "cpu",
        "num_kv_blocks": 256,
        "block_size": 4,
        "event_log_url": log_url,
    }
    settings.update(overrides)
    return EngineConfig.from_kwargs(**settings)


@pytest.fixture
async def engine(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(_config(tiny_model_dir, f"sqlite:///{tmp_path / 'log.db'}"), load=build_engine)
    await engine.start()
    yield engine
    await engine.shutdown(grace_s=0.0)


async def _collect(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in outputs]


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.delta_token_ids]


async def test_resume_of_a_finished_request_streams_its_tail_and_ending_twice_alike(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=1)
    generated = await _collect(engine.generate(PROMPT, params, "done"))
    final = generated[-1]
    for _ in range(2):  # idempotent
        resumed = await _collect(engine.resume("done", 7))
        assert _tokens(resumed) == final.token_ids[7:]
        assert resumed[-1].finished
        assert (resumed[-1].finish_reason, resumed[-1].token_ids) == ("length", final.token_ids)
        logprobs = [entry for output in resumed for entry in output.delta_logprobs or []]
        assert [entry.token_id for entry in logprobs] == final.token_ids[7:]
        assert final.outputs[0].logprobs is not None
        assert logprobs == final.outputs[0].logprobs[7:]
    whole = await _collect(engine.resume("done", 0))
    assert "".join(output.delta_text for output in whole) == final.text


async def test_resume_of_a_request_with_several_samples_is_refused_naming_them(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2)
    final = (await _collect(engine.generate(PROMPT, params, "pair")))[-1]
    assert [output.index for output in final.outputs] == [0, 1]
    with pytest.raises(InvalidRequestError, match="request 'pair' has 2 samples"):
        await _collect(engine.resume("pair", 0))


async def test_resume_of_a_running_request_joins_its_live_outputs(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    stream = engine.add_request("live", PROMPT, params)
    seen: list[int] = []
    async for output in stream:
        seen += output.delta_token_ids
        if len(seen) >= 3:
            break
    resumed = await _collect(engine.resume("live", 2))
    final = await stream.finished
    assert _tokens(resumed) == final.token_ids[2:]
    assert resumed[-1].finished


async def test_resume_of_an_unknown_request_is_not_found(engine: AsyncLLMEngine) -> None:
    with pytest.raises(RequestNotFoundError, match="'nobody'"):
        await _collect(engine.resume("nobody", 0))


async def test_resume_from_a_negative_index_names_the_field(engine: AsyncLLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="after_token_index: must be >= 0, got -1"):
        await _collect(engine.resume("x", -1))


async def test_resume_without_a_journal_is_refused(tiny_model_dir: Path) -> None:
    engine = AsyncLLMEngine(_config(tiny_model_dir, None))
    await engine.start()
    try:
        with pytest.raises(JournalDisabledError, match="no request journal"):
            await _collect(engine.resume("x", 0))
    finally:
        await engine.shutdown(grace_s=0.0)


async def test_outputs_wait_for_their_journal_batch_to_be_durable(engine: AsyncLLMEngine) -> None:
    log = engine.event_log
    assert log is not None
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    num_outputs = 0
    async for _ in engine.generate(PROMPT, params, "gated"):
        num_outputs += 1
        # journal seq 1 is the ADMIT, then one OUTPUT (or the FINISH) per output: each is committed
        assert log.durable_journal_seq >= 1 + num_outputs


def test_a_journal_on_a_log_without_its_table_is_refused_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    from nanoserve.engine.errors import EventLogUnusableError
    from nanoserve.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0002")  # the schema before the request journal (0003)
    config = _config(tiny_model_dir, url, event_log_migrate=False)
    with pytest.raises(EventLogUnusableError, match="lacks the request journal's tables"):
        build_engine(config)
    build_engine(_config(tiny_model_dir, url, event_log_migrate=False, journal=False)).shutdown()


@pytest.mark.parametrize("stream_before_durable", [False, True])
async def test_a_store_that_takes_nothing_holds_tokens_back_unless_streaming_before_durable(
    tiny_model_dir: Path, tmp_path: Path, stream_before_durable: bool
) -> None:
    config = _config(tiny_model_dir, f"sqlite:///{tmp_path / 'log.db'}", stream_before_durable=stream_before_durable)
    engine = AsyncLLMEngine(config, load=build_engine)
    await engine.start()
    log = engine.event_log
    assert log is not None
    store_back = threading.Event()
    real_commit = log._writer._commit

    def stalled_commit(*args: object) -> None:
        store_back.wait()
        real_commit(*args)  # type: ignore[arg-type]

    log._writer._commit = stalled_commit  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    try:
        stream = engine.add_request("held", PROMPT, params)
        done = asyncio.ensure_future(stream.finished)
        await asyncio.wait([done], timeout=1.0)
        assert done.done() is stream_before_durable  # sampled in far less than a second either way
        assert log.durable_journal_seq == 0
        store_back.set()
        final = await asyncio.wait_for(done, 10)
        assert len(final.token_ids) == 5
    finally:
        store_back.set()
        await engine.shutdown(grace_s=0.0)


def test_a_recovered_request_this_engine_cannot_run_ends_not_recovered(tiny_model_dir: Path, tmp_path: Path) -> None:
    import time

    from nanoserve.allocator.log import EventLog
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.records import JournalKind
    from nanoserve.engine.journal.store import JournalRecord, read_request_history
    from nanoserve.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)

    def admit(request_id: str, prompt_token_ids: list[int]) -> JournalRecord:
        sampling = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "seed": 3}
        data = {"prompt_token_ids": prompt_token_ids, "prompt": None, "sampling": sampling, "max_tokens": 4}
        data |= {"arrival_wall_ns": time.time_ns(), "deadline_wall_ns": None, "recovered_from": None}
        return JournalRecord(JournalKind.ADMIT, request_id, data)

    log = EventLog.open(url, pool_id="default", num_blocks=256, block_size=4)
    log.append_batch(1, [], journal=[admit("fits", [101, 202]), admit("alien", [101, 10**7])])
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL
    log._release()
    engine = build_engine(_config(tiny_model_dir, url))
    assert [request.request_id for request in engine.recovered_requests] == ["fits"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    with connect(url) as conn:
        alien = read_request_history(conn, "default", "alien")
        fits = read_request_history(conn, "default", "fits")
    assert alien is not None
    assert alien.finish is not None
    assert alien.finish["abort_cause"] == "not_recovered"
    assert fits is not None
    assert fits.finish is not None
    assert (fits.num_tokens, fits.finish["finish_reason"]) == (4, "length")


async def test_resume_joins_journaled_chunks_and_keeps_the_text_of_uncut_ones(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    generated = await _collect(engine.generate(PROMPT, params, "joined"))
    whole = await _collect(engine.resume("joined", 0))
    assert len(whole) == 2  # 20 tokens in one output (TOKENS_PER_RESUME_OUTPUT = 256), then the ending
    assert whole[0].delta_token_ids == generated[-1].token_ids
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.store import read_request_history

    resumed = await _collect(engine.resume("joined", 7))
    # the journal's chunks, one per step (the stream may join steps a slow reader had not taken yet):
    # the chunk holding token 7 is cut, its text left out; every chunk from 7 on keeps its text
    assert engine.event_log is not None
    with connect(engine.event_log.url) as conn:
        history = read_request_history(conn, "default", "joined")
    assert history is not None
    assert history.token_ids == generated[-1].token_ids
    uncut = [chunk.text for chunk in history.chunks if chunk.start >= 7]
    assert resumed[0].delta_text == "".join(uncut)
    assert _tokens(resumed) == generated[-1].token_ids[7:]


async def test_resume_streams_every_top_20_logprob_bit_for_bit_as_the_stream_sent_it(engine: AsyncLLMEngine) -> None:
    # sampled at temperature 1.0 among 20 tops: the sampled token is sometimes no top, and its entry stored apart
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, logprobs=20)
    generated = await _collect(engine.generate(PROMPT, params, "tops"))
    resumed = await _collect(engine.resume("tops", 0))

    def bits(outputs: list[RequestOutput]) -> list[tuple[int, bytes, list[tuple[int, bytes]]]]:
        return [
            (e.token_id, struct.pack("<d", e.logprob), [(k, struct.pack("<d", v)) for k, v in e.top_logprobs.items()])
            for output in outputs
            for e in output.delta_logprobs or []
        ]

    sent = bits(generated)  # every delta's, the final output's last one included
    assert len(sent) == 10
    assert all(len(tops) == 20 for _, _, tops in sent)
    assert bits(resumed) == sent
    assert resumed[-1].outputs[0].logprobs == generated[-1].outputs[0].logprobs


async def test_concurrent_resumes_of_a_finished_request_share_one_journal_read(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    final = (await _collect(engine.generate(PROMPT, params, "shared")))[-1]
    followers = engine._followers
    reads_before = followers.num_reads
    results = await asyncio.gather(*(_collect(engine.resume("shared", 0)) for _ in range(12)))
    assert followers.num_reads == reads_before + 1
    for resumed in results:
        assert _tokens(resumed) == final.token_ids
        assert [e for o in resumed for e in o.delta_logprobs or []] == final.outputs[0].logprobs
        assert (resumed[-1].finished, resumed[-1].finish_reason) == (True, "length")
    # a new request taking the id is what a later Resume sees, not the cached one
    again = (await _collect(engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3), "shared")))[-1]
    assert _tokens(await _collect(engine.resume("shared", 0)))[-3:] == again.token_ids


async def test_a_recovered_request_the_restarted_pool_cannot_hold_ends_saying_why(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # a user restarted with --num-kv-blocks 8 and the client saw `abort (not_recovered)` with no reason,
    # while the server's log said it and counted num_ended 0
    import time

    from structlog.testing import capture_logs

    from nanoserve.allocator.log import EventLog
    from nanoserve.allocator.log.reader import connect
    from nanoserve.engine.journal.records import JournalKind
    from nanoserve.engine.journal.store import JournalRecord, read_request_history
    from nanoserve.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    sampling = {"temperature": 0.0, "max_tokens": 60, "ignore_eos": True, "seed": 3}
    admit = {"prompt_token_ids": [101, 202], "prompt": None, "sampling": sampling, "max_tokens": 60}
    admit |= {"arrival_wall_ns": time.time_ns(), "deadline_wall_ns": None, "recovered_from": None}
    log = EventLog.open(url, pool_id="default", num_blocks=256, block_size=4)
    log.append_batch(1, [], journal=[JournalRecord(JournalKind.ADMIT, "long", admit)])
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL
    log._release()
    reason = (
        "this server cannot run it again: max_tokens: prompt (2 tokens) + max_tokens (60) = 62 tokens "
        "needs 16 KV blocks; the whole pool holds 8 blocks (32 tokens)"
    )
    with capture_logs() as logs:
        engine = AsyncLLMEngine(_config(tiny_model_dir, url, num_kv_blocks=8), load=build_engine)
        await engine.start()
    try:
        [recovered] = [entry for entry in logs if entry["event"] == "requests_recovered"]
        assert (recovered["num_recovered"], recovered["num_ended"]) == (0, 1)
        [final] = await _collect(engine.resume("long", 0))
        assert (final.finished, final.abort_cause, final.abort_detail) == (True, AbortCause.NOT_RECOVERED, reason)
    finally:
        await engine.shutdown(grace_s=0.0)
    with connect(url) as conn:
        history = read_request_history(conn, "default", "long")
    assert history is not None
    assert history.finish is not None
    assert (history.finish["abort_cause"], history.finish["abort_detail"]) == ("not_recovered", reason)
