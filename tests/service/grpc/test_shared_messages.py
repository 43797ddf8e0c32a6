"""EventMessages and ResumeMessages: a message many callers get is serialized once, and each gets its bytes."""

from __future__ import annotations

import gc

import pytest

from nanoserve.allocator import EventKind
from nanoserve.allocator.log import Event
from nanoserve.service.grpc import allocation_convert, resume_messages
from nanoserve.service.grpc.event_messages import EventMessages
from nanoserve.service.grpc.resume_messages import ResumeMessages
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import generation_pb2 as pb


def _event(seq: int) -> Event:
    return Event(
        pool_id="pool",
        epoch=1,
        seq=seq,
        batch_seq=seq,
        kind=EventKind.ALLOCATE.value,
        block_ids=(seq, seq + 1),
        owner=f"req-{seq}",
        step=seq,
        reason=None,
        wall_time_ns=1_000 + seq,
        monotonic_ns=2_000 + seq,
        data=None,
        hash=bytes([seq]) * 32,
    )


def test_an_event_is_serialized_once_and_every_watcher_gets_the_same_bytes() -> None:
    messages = EventMessages()
    event = _event(7)
    first = messages.message(event)
    assert first == apb.WatchEventsResponse(event=allocation_convert.to_event(event)).SerializeToString()
    assert messages.message(event) is first


def test_the_least_recently_sent_event_is_dropped_past_the_bound() -> None:
    messages = EventMessages(max_events=2)
    one, two, three = _event(1), _event(2), _event(3)
    kept_one = messages.message(one)
    kept_two = messages.message(two)
    assert messages.message(one) is kept_one  # sent again: now the most recent
    messages.message(three)  # drops two, the least recently sent
    assert messages.message(one) is kept_one
    again = messages.message(two)
    assert again == kept_two
    assert again is not kept_two


def test_a_batch_is_the_message_of_its_events_joined_from_the_kept_bytes() -> None:
    messages = EventMessages()
    events = [_event(seq) for seq in (3, 4, 200)]  # 200: a longer varint in the event's own fields
    kept = messages.message(events[0])
    batch = messages.batch(events)
    expected = apb.WatchEventsResponse(events=[allocation_convert.to_event(event) for event in events])
    assert batch == expected.SerializeToString()
    assert apb.WatchEventsResponse.FromString(batch) == expected
    assert messages.message(events[0]) is kept  # each event still converted once
    assert messages.batch([]) == b""


def test_an_event_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_events must be >= 1, got 0"):
        EventMessages(max_events=0)


class _Output:
    """Stands in for a RequestOutput: ResumeMessages keys by the object and converts it through convert."""


def test_callers_of_one_output_get_the_same_bytes_until_the_output_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    converted: list[object] = []

    def to_resume_response(output: object) -> pb.ResumeResponse:
        converted.append(output)
        return pb.ResumeResponse(token_ids=[5, 6, 7], text="abc", request_id="engine-scoped-id")

    monkeypatch.setattr(resume_messages.convert, "to_resume_response", to_resume_response)
    messages = ResumeMessages()
    output = _Output()
    first = messages.message(output, "order-1")  # type: ignore[arg-type]
    assert first == pb.ResumeResponse(token_ids=[5, 6, 7], text="abc", request_id="order-1").SerializeToString()
    assert messages.message(output, "order-1") is first  # type: ignore[arg-type]
    assert len(converted) == 1
    del output, converted[:]
    gc.collect()
    assert messages._messages == {}  # a new output (a new request taking the id) is never served the old bytes
