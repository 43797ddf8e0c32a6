"""Issue 32 through smg: the `openai` client's seeded chat request, three times, gives one answer.

smg in front of one `--batch-invariant on` replica of the real model. The first call is
computed from scratch; the second finds its prompt in the prefix cache and prefills only
the tail; the third runs batched with three other requests and finds the cache too. With
batch invariance a row's logits depend only on its prefix and position, so a seeded
sample (temperature 1, top-p 0.9, seed 7) is the same token for token all three times,
where with batch invariance off the third call's answer differs (checked when this test was written).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ..conftest import engine_config
from .test_gateway import smg_in_front_of

openai = pytest.importorskip("openai", reason="the openai client comes with nanoserve[dev]")

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="module")]

# 52 prompt tokens once templated: the repeats find 48 in the cache and prefill a 4-token tail, which
# without batch invariance takes the decode body where the first call took the large-step one
MESSAGES = [
    {
        "role": "user",
        "content": "Write one sentence about a lighthouse keeper and the sea, "
        "in the voice of an old sailor telling a story.",
    }
]


async def test_three_identical_seeded_calls_through_smg_give_one_answer(tmp_path: Path) -> None:
    from nanoserve.service.config import ServerConfig
    from nanoserve.service.grpc.server import NanoServer, start_engine

    engine = await start_engine(engine_config(f"sqlite:///{tmp_path / 'events.db'}", batch_invariant="on"))
    server = NanoServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5))
    await server.start()
    try:
        async with smg_in_front_of(server.port, tmp_path) as (client, model):

            def seeded() -> object:
                return client.chat.completions.create(
                    model=model, messages=MESSAGES, max_tokens=24, temperature=1.0, top_p=0.9, seed=7
                )

            first = await seeded()  # computed from scratch
            second = await seeded()  # its prompt's full blocks from the prefix cache
            others = [
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Tell me about the number {n}."}], max_tokens=24
                )
                for n in range(3)
            ]
            third, *_ = await asyncio.gather(seeded(), *others)  # batched with three others, cached too
    finally:
        await server.stop(0.5)
    answers = [call.choices[0].message.content for call in (first, second, third)]  # type: ignore[attr-defined]
    assert answers[0]
    assert answers == [answers[0]] * 3
    assert [call.usage.completion_tokens for call in (first, second, third)] == [first.usage.completion_tokens] * 3  # type: ignore[attr-defined]
