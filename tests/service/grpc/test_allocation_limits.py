"""Numbers out of the log's range never reach its database (issue 9, fault 5).

``WatchEvents(from_seq)`` and ``Audit(epoch)`` take int64s; the log's columns hold less (seq: a
signed 64-bit integer, epoch: 32-bit). Each is checked first: INVALID_ARGUMENT naming the field,
or the empty result it means.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import allocation_pb2_grpc

from ..conftest import Served

on_the_server = pytest.mark.asyncio(loop_scope="module")

MAX_INT64 = 2**63 - 1


async def _status(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if isinstance(call, grpc.aio.UnaryStreamCall):
            async for _ in call:
                pass
        else:
            await call  # type: ignore[misc]
    return info.value.code(), info.value.details() or ""


@on_the_server
async def test_watch_from_the_largest_seq_is_out_of_range_naming_the_last_seq(tiny_served: Served) -> None:
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    last_seq = (await stub.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq
    call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=MAX_INT64), timeout=5.0)
    assert await _status(call) == (
        grpc.StatusCode.OUT_OF_RANGE,
        f"from_seq: {MAX_INT64} is past the epoch's next event (last seq {last_seq}); ask for at most {last_seq + 1}",
    )


@on_the_server
async def test_watch_from_two_past_the_last_seq_is_out_of_range_not_a_silent_gap(tiny_served: Served) -> None:
    """Issue 29, item 7c: the seq between would never reach the client."""
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    last_seq = (await stub.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq
    call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=last_seq + 2), timeout=5.0)
    code, message = await _status(call)
    assert (code, message.split(";")[0]) == (
        grpc.StatusCode.OUT_OF_RANGE,
        f"from_seq: {last_seq + 2} is past the epoch's next event (last seq {last_seq})",
    )


@on_the_server
async def test_watch_from_the_next_seq_waits_for_events_still_to_come(tiny_served: Served) -> None:
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    last_seq = (await stub.GetPoolStatus(apb.GetPoolStatusRequest())).last_seq
    call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=last_seq + 1), timeout=1.0)
    assert await _status(call) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


@on_the_server
async def test_watch_from_a_negative_seq_is_invalid(tiny_served: Served) -> None:
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    call = stub.WatchEvents(apb.WatchEventsRequest(from_seq=-1), timeout=5.0)
    assert await _status(call) == (grpc.StatusCode.INVALID_ARGUMENT, "from_seq: must be >= 0, got -1")


@pytest.mark.parametrize("epoch", [MAX_INT64, 2**31, 0, -1])
@on_the_server
async def test_audit_of_an_epoch_out_of_range_is_invalid(tiny_served: Served, epoch: int) -> None:
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    assert await _status(stub.Audit(apb.AuditRequest(epoch=epoch), timeout=5.0)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"epoch: must be in [1, 2147483647], got {epoch}",
    )


@on_the_server
async def test_audit_of_the_largest_epoch_is_not_found(tiny_served: Served) -> None:
    stub = allocation_pb2_grpc.AllocationServiceStub(tiny_served.channel)
    code, message = await _status(stub.Audit(apb.AuditRequest(epoch=2**31 - 1), timeout=5.0))
    assert (code, message) == (grpc.StatusCode.NOT_FOUND, "pool 'default' has no epoch 2147483647; epochs: [1]")


def test_read_events_past_the_largest_seq_is_empty(tmp_path: Path) -> None:
    from nanoserve.allocator.log import EventLog, read_events, replay
    from nanoserve.migrations import upgrade

    url = f"sqlite:///{tmp_path / 'log.db'}"
    upgrade(url)
    EventLog.open(url, num_blocks=4, block_size=16).close()
    assert read_events(url, from_seq=MAX_INT64) == []
    assert read_events(url, from_seq=2**70) == []
    assert [event.seq for event in read_events(url, from_seq=-(2**70), until_seq=2**70)] == [1, 2]
    assert replay(url, until_seq=2**70).last_seq == 2
