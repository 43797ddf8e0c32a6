"""Resume of a request the restart after a crash could not take back: the final message, then a
status that says why (the Finish message names only the cause, ``not_recovered``)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc

from ..conftest import engine_config, serving


def _crashed_log(url: str, max_tokens: int) -> None:
    """A log whose open epoch journaled one admission, request ``long``, then the server died."""
    from nanoserve.allocator.log import EventLog
    from nanoserve.engine.journal.records import JournalKind
    from nanoserve.engine.journal.store import JournalRecord
    from nanoserve.migrations import upgrade

    upgrade(url)
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "seed": 3}
    admit = {"prompt_token_ids": [101, 202], "prompt": None, "sampling": sampling, "max_tokens": max_tokens}
    admit |= {"arrival_wall_ns": time.time_ns(), "deadline_wall_ns": None, "recovered_from": None}
    log = EventLog.open(url, pool_id="default", num_blocks=256, block_size=4)
    log.append_batch(1, [], journal=[JournalRecord(JournalKind.ADMIT, "long", admit)])
    assert log.flush(10)
    log._writer.abandon()  # SIGKILL
    log._release()


@pytest.mark.asyncio
async def test_resume_of_a_request_too_long_for_the_restarted_pool_ends_with_the_reason(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    _crashed_log(url, max_tokens=60)
    config = engine_config(url, model=str(tiny_model_dir), num_kv_blocks=8, block_size=4)
    async with serving(config, url) as served:
        call = generation_pb2_grpc.GenerationServiceStub(served.channel).Resume(pb.ResumeRequest(request_id="long"))
        messages = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for message in call:
                messages.append(message)
    [final] = messages
    assert (final.finish.reason, final.finish.abort_cause) == (pb.FINISH_REASON_ABORT, pb.ABORT_CAUSE_NOT_RECOVERED)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == (
        "request long ended at the restart after a crash, abort cause not_recovered: this server cannot run it "
        "again: max_tokens: prompt (2 tokens) + max_tokens (60) = 62 tokens needs 16 KV blocks; the whole pool "
        "holds 8 blocks (32 tokens)"
    )
