"""An ended request's id may be sent again; Resume then streams the newest request of that id.

Issue 29, item 7d: what generation.proto says of GenerateRequest.request_id and Resume.
"""

from __future__ import annotations

import pytest

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import Served

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _request(prompt_ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="reused-after-it-ended",
        prompt_token_ids=pb.TokenIds(ids=prompt_ids),
        sampling=pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def test_reusing_an_ended_request_id_starts_a_new_request_and_resume_streams_the_newest(
    tiny_served: Served,
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(tiny_served.channel)
    first = [r async for r in stub.Generate(_request([101, 202, 303], max_tokens=2))]
    second = [r async for r in stub.Generate(_request([404, 505], max_tokens=5))]
    second_ids = [t for r in second for t in r.token_ids]
    assert (sum(len(r.token_ids) for r in first), len(second_ids)) == (2, 5)
    assert second[-1].finish.usage.prompt_tokens == 2
    resumed = [r async for r in stub.Resume(pb.ResumeRequest(request_id="reused-after-it-ended"))]
    assert [t for r in resumed for t in r.token_ids] == second_ids
    assert resumed[-1].finish.usage.prompt_tokens == 2
