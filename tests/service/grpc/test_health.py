"""Health per service: NOT_SERVING when the engine loop died or the event log is not durable."""

from __future__ import annotations

from nanoserve.service.grpc.server import (
    ALLOCATION_SERVICE,
    GENERATION_SERVICE,
    NOT_SERVING,
    SERVING,
    VLLM_ENGINE_SERVICE,
    health_statuses,
)


def test_all_serving_when_engine_and_log_are_up() -> None:
    assert health_statuses(engine_ok=True, log_ok=True) == {
        "": SERVING,
        GENERATION_SERVICE: SERVING,
        ALLOCATION_SERVICE: SERVING,
        VLLM_ENGINE_SERVICE: SERVING,
    }


def test_dead_engine_loop_stops_every_service() -> None:
    assert health_statuses(engine_ok=False, log_ok=True) == {
        "": NOT_SERVING,
        GENERATION_SERVICE: NOT_SERVING,
        ALLOCATION_SERVICE: NOT_SERVING,
        VLLM_ENGINE_SERVICE: NOT_SERVING,
    }


def test_log_that_is_not_durable_stops_every_service() -> None:
    # issue 9: new requests are refused while the log cannot commit, so Generation says so too
    assert health_statuses(engine_ok=True, log_ok=False) == {
        "": NOT_SERVING,
        GENERATION_SERVICE: NOT_SERVING,
        ALLOCATION_SERVICE: NOT_SERVING,
        VLLM_ENGINE_SERVICE: NOT_SERVING,  # it generates too: its requests are refused the same way
    }


def test_service_names_are_the_proto_full_names() -> None:
    assert (GENERATION_SERVICE, ALLOCATION_SERVICE, VLLM_ENGINE_SERVICE) == (
        "nanoserve.v1.GenerationService",
        "nanoserve.v1.AllocationService",
        "vllm.grpc.engine.VllmEngine",
    )
