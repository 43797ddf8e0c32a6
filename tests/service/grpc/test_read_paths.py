"""Abort and Resume floods: unknown ids cost the engine thread nothing, and each peer is rate-limited."""

from __future__ import annotations

import asyncio
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
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in limited.Resume(pb.ResumeRequest(request_id="nobody")):
            pass
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than 2 Abort/Resume calls per second" in (info.value.details() or "")
    assert "--max-read-calls-per-s" in (info.value.details() or "")
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert [detail.Unpack(retry) for detail in status.details] == [True]
    assert 0 < retry.retry_delay.ToNanoseconds() <= 500_000_000  # one token comes back within 1/2 s
    await asyncio.sleep(0.6)  # the bucket refills
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await limited.Abort(pb.AbortRequest(request_id="nobody"))
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


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
