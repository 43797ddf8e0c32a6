"""EventStream: committed events reach an asyncio consumer without polling."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nanoserve.allocator import BlockAllocator
from nanoserve.allocator.log import EventLog, EventStream, EventStreamLagged
from nanoserve.migrations import upgrade


def url_in(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'stream.db'}"
    upgrade(url)
    return url


async def test_stream_yields_events_until_pool_close(tmp_path: Path) -> None:
    log = EventLog.open(url_in(tmp_path), num_blocks=4, block_size=16)
    stream = EventStream(log)

    def drive() -> None:
        pool = BlockAllocator(4, 16)
        pool.allocate_for(20, "A")
        log.append_batch(1, pool.take_events())
        pool.free_all([0, 1])
        log.append_batch(2, pool.take_events())
        log.close()

    driver = asyncio.get_running_loop().run_in_executor(None, drive)
    received = [(event.seq, event.kind, event.block_ids) async for event in stream]
    await driver
    assert received == [(2, "allocate_for", (0, 1)), (3, "free_all", (0, 1)), (4, "pool_close", ())]


async def test_close_ends_a_waiting_stream(tmp_path: Path) -> None:
    log = EventLog.open(url_in(tmp_path), num_blocks=4, block_size=16)
    stream = EventStream(log)
    asyncio.get_running_loop().call_later(0.05, stream.close)
    assert [event async for event in stream] == []
    log.close()


async def test_lagging_consumer_is_cut_off_with_the_seq_to_resume_from(tmp_path: Path) -> None:
    log = EventLog.open(url_in(tmp_path), num_blocks=8, block_size=16, sync=True)
    stream = EventStream(log, max_queued_events=2)
    pool = BlockAllocator(8, 16)
    for step in range(3):
        pool.allocate("A")
        log.append_batch(step, pool.take_events())  # sync: committed and handed to the loop before returning
    await asyncio.sleep(0.05)
    with pytest.raises(EventStreamLagged) as info:
        await stream.__anext__()
    assert info.value.next_seq == 2
    log.close()
