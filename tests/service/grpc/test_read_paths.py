"""Abort and Resume floods: unknown ids cost the engine thread nothing, and each peer is rate-limited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module")
async def limited(tiny_served: Served) -> AsyncIterator[generation_pb2_grpc.GenerationServiceStub]:
    """A second server on the same engine that allows 2 Abort/Resume calls per second per peer."""
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer

    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=None, max_read_calls_per_s=2.0)
    server = NanoServer(tiny_served.engine, config, owns_engine=False)
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)
    await server.stop(0.5)


async def test_unknown_id_aborts_never_reach_the_engine_thread(tiny_served: Served) -> None:
    engine = tiny_served.engine
    submitted: list[object] = []
    submit = engine._submit
    engine._submit = lambda message: (submitted.append(message), submit(message))[1]
    try:
        stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
        codes = []
        for index in range(50):  # within the default 100 per second
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(pb.AbortRequest(request_id=f"nobody-{index}"))
            codes.append(info.value.code())
    finally:
        del engine._submit
    assert codes == [grpc.StatusCode.NOT_FOUND] * 50
    assert submitted == []


async def test_calls_past_the_rate_get_resource_exhausted_with_retry_info(
    limited: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    codes = []
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await limited.Abort(pb.AbortRequest(request_id="nobody"))
        codes.append(info.value.code())
    assert codes == [grpc.StatusCode.NOT_FOUND] * 2
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in limited.Resume(pb.ResumeRequest(request_id="nobody")):
            pass
    held_s = time.monotonic() - started
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 2 Abort/Resume calls per second" in (info.value.details() or "")
    assert "--max-read-calls-per-s" in (info.value.details() or "")
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert [detail.Unpack(retry) for detail in status.details] == [True]
    # the refusal is held 1/2 s (a token is back by then at 2 a second), so little is left to wait
    assert 0.45 < held_s < 1.5
    assert 0 <= retry.retry_delay.ToNanoseconds() <= 500_000_000
    await asyncio.sleep(0.6)  # the bucket refills
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await limited.Abort(pb.AbortRequest(request_id="nobody"))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_a_client_that_ignores_retry_info_gets_its_rate_and_one_refusal_per_call_in_flight(
    limited: generation_pb2_grpc.GenerationServiceStub,
) -> None:
    """Issue 31: 20,000 Aborts as fast as 20 callers could send them made the server answer each
    (refused ones included) and took the event loop from a running stream. Refusals are held 1/2 s
    at least, so 10 callers calling again at once for 1.5 s make a few dozen calls, not thousands."""
    await asyncio.sleep(1.0)  # the bucket refills (2 a second)
    codes: list[grpc.StatusCode] = []
    end = time.monotonic() + 1.5

    async def caller(index: int) -> None:
        while time.monotonic() < end:
            try:
                await limited.Abort(pb.AbortRequest(request_id=f"nobody-{index}"))
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())

    await asyncio.gather(*(caller(index) for index in range(10)))
    assert set(codes) == {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
    # the burst (2) and 2 a second, and one refusal per caller for each half second it is held
    assert codes.count(grpc.StatusCode.NOT_FOUND) <= 2 + 2 * 2.5
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) <= 10 * 4


async def test_the_rate_is_per_tenant_across_its_tokens(tiny_served: Served, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    """Two tokens of tenant acme share one bucket (a tenant cannot multiply its rate with tokens);
    tenant blue's calls are not slowed by acme's."""
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer

    tokens = tmp_path_factory.mktemp("rate") / "tokens"
    tokens.write_text("token acme-1 acme client\ntoken acme-2 acme client\ntoken blue-1 blue client\n")
    config = ServerConfig(
        host="127.0.0.1", port=0, metrics_port=None, max_read_calls_per_s=2.0, auth_tokens_file=str(tokens)
    )
    server = NanoServer(tiny_served.engine, config, owns_engine=False)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            async def abort(token: str) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Abort(
                        pb.AbortRequest(request_id="nobody"), metadata=(("authorization", f"Bearer {token}"),)
                    )
                return info.value.code(), info.value.details() or ""

            assert [(await abort(token))[0] for token in ("acme-1", "acme-2")] == [grpc.StatusCode.NOT_FOUND] * 2
            code, details = await abort("acme-2")  # the tenant's third call within the second, by either token
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than 2 Abort/Resume calls per second from this tenant" in details
            assert (await abort("blue-1"))[0] is grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)


async def test_callers_resuming_one_finished_request_share_its_converted_messages(
    tiny_served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.service.grpc import resume_messages

    converted: list[int] = []
    to_resume_response = resume_messages.convert.to_resume_response

    def counting(output: object) -> pb.ResumeResponse:
        converted.append(id(output))
        return to_resume_response(output)  # type: ignore[arg-type]

    monkeypatch.setattr(resume_messages.convert, "to_resume_response", counting)
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    sampling = pb.SamplingParameters(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    generated = [
        r
        async for r in stub.Generate(pb.GenerateRequest(request_id="shared-resume", prompt="a b c", sampling=sampling))
    ]
    token_ids = [t for r in generated for t in r.token_ids]
    resumed = []
    for _ in range(3):
        resumed.append([r async for r in stub.Resume(pb.ResumeRequest(request_id="shared-resume"))])
    assert [[t for r in messages for t in r.token_ids] for messages in resumed] == [token_ids] * 3
    assert all(r.request_id == "shared-resume" for messages in resumed for r in messages)
    assert [len(r.logprobs) for r in resumed[0]] == [len(r.logprobs) for r in resumed[2]]
    # the journaled outputs are converted for the first caller only: the others get copies
    assert len(converted) == len(resumed[0])
    assert len(set(converted)) == len(converted)


def _raw_stream(channel: grpc.aio.Channel, method: str, request: object) -> grpc.aio.UnaryStreamCall:
    """A call of ``method`` whose responses come back as the bytes the server sent."""
    return channel.unary_stream(method, request_serializer=lambda m: m.SerializeToString())(request)  # type: ignore[attr-defined]


async def test_callers_resuming_one_request_get_the_same_bytes_and_after_its_id_is_reused_new_ones(
    tiny_served: Served,
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    sampling = pb.SamplingParameters(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)

    async def generate(prompt: str) -> list[int]:
        request = pb.GenerateRequest(request_id="bytes-resume", prompt=prompt, sampling=sampling)
        return [t async for r in stub.Generate(request) for t in r.token_ids]

    async def resume() -> list[bytes]:
        call = _raw_stream(
            tiny_served.channel, "/nanoserve.v1.GenerationService/Resume", pb.ResumeRequest(request_id="bytes-resume")
        )
        return [raw async for raw in call]

    first_tokens = await generate("a b c")
    first = await asyncio.gather(resume(), resume())
    assert first[0] == first[1]
    messages = [pb.ResumeResponse.FromString(raw) for raw in first[0]]
    assert [t for m in messages for t in m.token_ids] == first_tokens
    assert all(m.request_id == "bytes-resume" and len(m.logprobs) == len(m.token_ids) for m in messages)
    # the bytes are the message serialized as before: parsing and serializing again gives them back
    assert [m.SerializeToString() for m in messages] == first[0]

    second_tokens = await generate("x y z w v")  # a new request takes the id: its own outputs, its own bytes
    second = await resume()
    assert [t for raw in second for t in pb.ResumeResponse.FromString(raw).token_ids] == second_tokens
    assert second != first[0]


async def test_watchers_catching_up_at_once_share_each_page_read_and_get_the_same_bytes(
    tiny_served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.allocator.log import read_events
    from nanoserve.engine.core import stored_events
    from nanoserve.service.grpc import allocation_convert
    from nanoserve.v1 import allocation_pb2 as apb
    from nanoserve.v1 import allocation_pb2_grpc

    reads_by_page: dict[int, int] = {}

    def counted_read(url: str, pool_id: str, epoch: int, from_seq: int, until_seq: int) -> object:
        reads_by_page[from_seq] = reads_by_page.get(from_seq, 0) + 1
        time.sleep(0.1)  # the first reads hold the reader threads while the rest of the crowd arrives
        return read_events(url, pool_id, epoch, from_seq, until_seq)

    monkeypatch.setattr(stored_events, "read_events", counted_read)
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    sampling = pb.SamplingParameters(max_tokens=8, temperature=0.0, ignore_eos=True)
    async for _ in stub.Generate(pb.GenerateRequest(prompt="some events", sampling=sampling)):
        pass
    status = await allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel).GetPoolStatus(
        apb.GetPoolStatusRequest()
    )

    async def watch() -> list[bytes]:
        call = _raw_stream(
            tiny_served.channel, "/nanoserve.v1.AllocationService/WatchEvents", apb.WatchEventsRequest(from_seq=1)
        )
        received = []
        async for raw in call:
            received.append(raw)
            if apb.WatchEventsResponse.FromString(raw).event.seq >= status.last_seq:
                break
        call.cancel()
        return received

    num_watchers, num_threads = 12, tiny_served.engine.log_reads.num_threads
    watched = await asyncio.gather(*(watch() for _ in range(num_watchers)))
    assert all(received == watched[0] for received in watched)
    log = tiny_served.engine.event_log
    stored = read_events(log.url, log.pool_id, log.epoch, 1, status.last_seq)
    expected = [apb.WatchEventsResponse(event=allocation_convert.to_event(e)).SerializeToString() for e in stored]
    assert watched[0] == expected  # what each watcher gets is the message serialized as before
    # the first callers find free threads and read on their own; the rest of the crowd shares one read
    assert reads_by_page
    assert all(n <= num_threads + 1 for n in reads_by_page.values()), reads_by_page


async def test_a_later_watcher_reads_only_the_events_committed_since_the_last_catch_up(
    tiny_served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.allocator.log import read_events
    from nanoserve.engine.core import stored_events
    from nanoserve.v1 import allocation_pb2 as apb
    from nanoserve.v1 import allocation_pb2_grpc

    reads_made: list[int] = []

    def counted_read(url: str, pool_id: str, epoch: int, from_seq: int, until_seq: int) -> object:
        reads_made.append(from_seq)
        return read_events(url, pool_id, epoch, from_seq, until_seq)

    monkeypatch.setattr(stored_events, "read_events", counted_read)
    generation = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    allocation = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    sampling = pb.SamplingParameters(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def generate(prompt: str) -> int:
        async for _ in generation.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling)):
            pass
        log = tiny_served.engine.event_log
        assert log is not None
        assert log.flush(timeout_s=10)
        return (await allocation.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq

    async def watch(last_seq: int) -> list[bytes]:
        call = _raw_stream(
            tiny_served.channel, "/nanoserve.v1.AllocationService/WatchEvents", apb.WatchEventsRequest(from_seq=1)
        )
        received = []
        async for raw in call:
            received.append(raw)
            if apb.WatchEventsResponse.FromString(raw).event.seq >= last_seq:
                break
        call.cancel()
        return received

    first_last = await generate("one catch-up")
    first = await watch(first_last)
    reads_made.clear()
    again = await watch(first_last)  # nothing committed since: the store is not asked
    assert (again, reads_made) == (first, [])

    second_last = await generate("more events")
    later = await watch(second_last)
    assert reads_made == [first_last + 1]  # the events committed since the last catch-up, not the page again
    assert later[: len(first)] == first
    assert len(later) == second_last
    log = tiny_served.engine.event_log
    assert [apb.WatchEventsResponse.FromString(raw).event.seq for raw in later] == [
        e.seq for e in read_events(log.url, log.pool_id, log.epoch, 1, second_last)
    ]


async def test_a_watch_from_the_first_seq_asks_the_store_nothing_before_it_reads(
    tiny_served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanoserve.service.grpc import allocation_servicer
    from nanoserve.v1 import allocation_pb2 as apb
    from nanoserve.v1 import allocation_pb2_grpc

    asked: list[int] = []
    archived_through = allocation_servicer.archived_through

    def counted(url: str, pool_id: str, epoch: int) -> int:
        asked.append(epoch)
        return archived_through(url, pool_id, epoch)

    monkeypatch.setattr(allocation_servicer, "archived_through", counted)
    sampling = pb.SamplingParameters(max_tokens=4, temperature=0.0, ignore_eos=True)
    generation = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    async for _ in generation.Generate(pb.GenerateRequest(prompt="a few events", sampling=sampling)):
        pass
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    for from_seq in (0, 1, 2):
        call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=from_seq))
        assert (await call.read()).event.seq == max(from_seq, 1)  # type: ignore[union-attr]
        call.cancel()
    # 0 and 1 start at the checkpoint after any archived part: where it ends only matters from 2 on
    assert asked == [tiny_served.engine.event_log.epoch]
