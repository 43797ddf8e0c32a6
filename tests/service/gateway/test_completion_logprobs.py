"""``/v1/completions`` logprobs through smg (issue 29, item 3): our replica sends them, smg 1.13.0 drops them.

smg in front of one in-process replica of the tiny model. The replica's vLLM-contract
responses are recorded where they are made (``vllm_convert``): a completion asking for
``logprobs=3`` gets, per generated token, its logprob and its 3 top alternatives, in
every streamed ``chunk`` and in the unstreamed ``complete`` alike, exactly as a chat
completion asking for ``top_logprobs=3`` does. smg renders the chat ones and answers
the completion with ``logprobs: null`` (README, "OpenAI API and several replicas").
When this test fails on ``logprobs is None``, smg has started passing them on: update
the README.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from ..conftest import Served
from .test_gateway import smg_in_front_of

openai = pytest.importorskip("openai", reason="the openai client comes with nanoserve[dev]")

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_TOKENS = 3
NUM_TOP = 3


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[vpb.GenerateResponse]:
    """Every GenerateResponse the replica's vLLM servicer makes, in order."""
    from nanoserve.service.grpc import vllm_convert

    responses: list[vpb.GenerateResponse] = []
    to_chunk, to_complete = vllm_convert.to_chunk, vllm_convert.to_complete

    def chunk(output: Any) -> vpb.GenerateResponse:
        responses.append(to_chunk(output))
        return responses[-1]

    def complete(output: Any, with_logprobs: bool) -> vpb.GenerateResponse:
        responses.append(to_complete(output, with_logprobs))
        return responses[-1]

    monkeypatch.setattr(vllm_convert, "to_chunk", chunk)
    monkeypatch.setattr(vllm_convert, "to_complete", complete)
    return responses


def _num_top_per_token(logprobs: vpb.OutputLogProbs) -> list[int]:
    assert list(logprobs.token_ids) == [top.token_ids[0] for top in logprobs.top_logprobs]  # greedy: the top one
    return [len(top.values) for top in logprobs.top_logprobs]


async def test_completion_logprobs_are_sent_by_the_replica_and_dropped_by_smg(
    tiny_served: Served, tmp_path: Path, sent: list[vpb.GenerateResponse]
) -> None:
    worker_port = tiny_served.server.port  # type: ignore[attr-defined]
    async with smg_in_front_of(worker_port, tmp_path) as (client, model):
        asked = {"model": model, "max_tokens": NUM_TOKENS, "temperature": 0}

        sent.clear()
        whole = await client.completions.create(prompt="The KV cache", logprobs=NUM_TOP, **asked)
        [complete] = [r.complete for r in sent]
        assert _num_top_per_token(complete.output_logprobs) == [NUM_TOP] * NUM_TOKENS
        assert whole.choices[0].logprobs is None  # smg 1.13.0 drops them

        sent.clear()
        stream = await client.completions.create(prompt="The KV cache", logprobs=NUM_TOP, stream=True, **asked)
        streamed = [chunk async for chunk in stream]
        chunks = [r.chunk for r in sent if r.HasField("chunk")]
        # per token (a chunk is one step's tokens, or several steps' for a reader that fell behind)
        assert [n for c in chunks for n in _num_top_per_token(c.output_logprobs)] == [NUM_TOP] * NUM_TOKENS
        assert [c.choices[0].logprobs for c in streamed if c.choices] == [None] * len(streamed)

        sent.clear()
        chat = await client.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=NUM_TOP, **asked
        )
        [complete] = [r.complete for r in sent]
        assert _num_top_per_token(complete.output_logprobs) == [NUM_TOP] * NUM_TOKENS
        content = chat.choices[0].logprobs.content
        assert [len(token.top_logprobs) for token in content] == [NUM_TOP] * NUM_TOKENS  # the same, rendered
        assert [token.logprob for token in content] == pytest.approx(list(complete.output_logprobs.token_logprobs))
