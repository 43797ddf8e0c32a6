"""Protobuf <-> engine types: every field crosses, unset optionals keep the engine defaults."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from nanoserve.allocator import EventKind, FreeReason, PoolState, Violation
from nanoserve.allocator.log import AuditReport, Event
from nanoserve.engine.core.outputs import AbortCause, CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoserve.engine.sampling.params import SamplingParams
from nanoserve.engine.text.prompts import ChatPrompt, TokensPrompt
from nanoserve.service.grpc import allocation_convert, convert
from nanoserve.v1 import allocation_pb2 as apb
from nanoserve.v1 import generation_pb2 as pb

ALLOCATOR_DIR = Path(__file__).resolve().parents[3] / "allocator"


def _output(
    finished: bool,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(
                index=0, text="Hello world", token_ids=[10, 11], finish_reason=finish_reason, stop_reason=stop_reason
            )
        ],
        finished=finished,
        delta_text=" world",
        delta_token_ids=[11],
        delta_logprobs=logprobs,
        metrics=RequestMetrics(
            arrival_time=100.0,
            first_scheduled_time=100.25,
            first_token_time=100.5,
            finished_time=102.0,
            num_preemptions=1,
        ),
    )


def test_text_prompt() -> None:
    assert convert.to_prompt(pb.GenerateRequest(prompt="Hi")) == "Hi"


def test_token_prompt() -> None:
    assert convert.to_prompt(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]))) == TokensPrompt(
        prompt_token_ids=[5, 6]
    )


def test_chat_prompt() -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role=pb.CHAT_ROLE_SYSTEM, content="Be brief."),
                pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="Hi"),
                pb.ChatMessage(role=pb.CHAT_ROLE_ASSISTANT, content="Hello."),
            ]
        )
    )
    assert convert.to_prompt(request) == ChatPrompt(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ]
    )


def test_unset_sampling_fields_keep_engine_defaults() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters()) == SamplingParams()


def test_every_sampling_field_crosses() -> None:
    params = pb.SamplingParameters(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        seed=3,
        stop=["\n"],
        stop_token_ids=[9],
        ignore_eos=True,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
    )
    assert convert.to_sampling_params(params) == SamplingParams(
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.125,
        seed=3,
        stop=["\n"],
        stop_token_ids=[9],
        ignore_eos=True,
        repetition_penalty=1.25,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=2,
    )


def test_greedy_temperature_zero_is_kept() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters(temperature=0.0)).temperature == 0.0


def test_top_k_zero_means_off() -> None:
    assert convert.to_sampling_params(pb.SamplingParameters(top_k=0)).top_k is None


def test_running_output_is_a_delta_without_finish() -> None:
    response = convert.to_response(_output(finished=False))
    assert (response.request_id, response.text, list(response.token_ids)) == ("r1", " world", [11])
    assert not response.HasField("finish")


def test_last_output_carries_finish_usage_and_timings() -> None:
    finish = convert.to_response(_output(finished=True, finish_reason="stop", stop_reason="\n\n")).finish
    assert finish.reason == pb.FINISH_REASON_STOP
    assert finish.stop_string == "\n\n"
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens) == (3, 2)
    assert (finish.timings.queue_time, finish.timings.ttft, finish.timings.total_time) == (
        Duration(nanos=250_000_000),
        Duration(nanos=500_000_000),
        Duration(seconds=2),
    )
    assert finish.num_preemptions == 1


def test_an_aborted_finish_carries_its_cause_and_another_none() -> None:
    aborted = dataclasses.replace(_output(finished=True, finish_reason="abort"), abort_cause=AbortCause.SHUTDOWN)
    assert convert.to_response(aborted).finish.abort_cause == pb.ABORT_CAUSE_SHUTDOWN
    stopped = convert.to_response(_output(finished=True, finish_reason="stop")).finish
    assert stopped.abort_cause == pb.ABORT_CAUSE_UNSPECIFIED


def test_timings_a_request_never_reached_stay_unset() -> None:
    output = _output(finished=True, finish_reason="abort")
    assert output.metrics is not None
    output.metrics.first_scheduled_time = None
    output.metrics.first_token_time = None
    timings = convert.to_response(output).finish.timings
    assert (timings.HasField("queue_time"), timings.HasField("ttft"), timings.total_time) == (
        False,
        False,
        Duration(seconds=2),
    )


def test_stop_token_id_is_reported() -> None:
    finish = convert.to_response(_output(finished=True, finish_reason="stop", stop_reason=2)).finish
    assert finish.WhichOneof("stop_reason") == "stop_token_id"
    assert finish.stop_token_id == 2


def test_logprobs_with_top_alternatives() -> None:
    logprobs = [TokenLogprob(token_id=11, logprob=-0.25, top_logprobs={11: -0.25, 12: -1.5})]
    response = convert.to_response(_output(finished=False, logprobs=logprobs))
    assert [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in response.logprobs] == [
        (11, -0.25, [(11, -0.25), (12, -1.5)])
    ]


def test_finished_request_tpot() -> None:
    summary = convert.finished_request(_output(finished=True, finish_reason="length"))
    assert summary.tpot_s == 1.5  # (2.0 - 0.5) s over the 1 token after the first


def _event(kind: str, reason: str | None = None) -> Event:
    return Event(
        pool_id="default",
        epoch=3,
        seq=7,
        batch_seq=8,
        kind=kind,
        block_ids=(4, 2),
        owner="r1",
        step=5,
        reason=reason,
        wall_time_ns=1_700_000_000_123_456_789,
        monotonic_ns=42_000_000_001,
        data=None,
        hash=bytes.fromhex("ab01"),
    )


def test_event_crosses_with_enums_and_exact_times() -> None:
    assert allocation_convert.to_event(_event("free_all", "preempted")) == apb.AllocationEvent(
        seq=7,
        pool_id="default",
        epoch=3,
        kind=apb.EVENT_KIND_FREE_ALL,
        block_ids=[4, 2],
        owner="r1",
        step=5,
        free_reason=apb.FREE_REASON_PREEMPTED,
        wall_time=Timestamp(seconds=1_700_000_000, nanos=123_456_789),
        monotonic_time=Duration(seconds=42, nanos=1),
        hash="ab01",
    )


def test_event_without_a_reason_has_no_free_reason() -> None:
    assert allocation_convert.to_event(_event("allocate")).free_reason == apb.FREE_REASON_UNSPECIFIED


def test_event_kind_from_a_newer_log_is_unspecified() -> None:
    assert allocation_convert.to_event(_event("adapter_load")).kind == apb.EVENT_KIND_UNSPECIFIED


@pytest.mark.parametrize(
    ("names", "enum", "prefix"),
    [
        (convert.FINISH_REASONS, pb.FinishReason, "FINISH_REASON_"),
        ({cause.value: value for cause, value in convert.ABORT_CAUSES.items()}, pb.AbortCause, "ABORT_CAUSE_"),
        ({name: value for value, name in convert.CHAT_ROLES.items()}, pb.ChatRole, "CHAT_ROLE_"),
        (allocation_convert.EVENT_KINDS, apb.EventKind, "EVENT_KIND_"),
        (allocation_convert.FREE_REASONS, apb.FreeReason, "FREE_REASON_"),
        (allocation_convert.AUDIT_RULES, apb.AuditRule, "AUDIT_RULE_"),
    ],
    ids=["finish-reason", "abort-cause", "chat-role", "event-kind", "free-reason", "audit-rule"],
)
def test_each_table_maps_every_enum_value_but_unspecified_by_its_own_name(
    names: dict[str, int], enum: Any, prefix: str
) -> None:
    assert {name: enum.Name(value) for name, value in names.items()} == {
        name.removeprefix(prefix).lower(): name
        for name in enum.DESCRIPTOR.values_by_name
        if name != f"{prefix}UNSPECIFIED"
    }


def test_abort_causes_cover_the_engines() -> None:
    assert set(convert.ABORT_CAUSES) == set(AbortCause)


def test_event_kinds_and_free_reasons_cover_the_allocators() -> None:
    assert set(allocation_convert.EVENT_KINDS) == {kind.value for kind in EventKind}
    assert set(allocation_convert.FREE_REASONS) == {reason.value for reason in FreeReason}


# the calls that name a broken rule -> which argument: Replayer.violate(seq, rule, ...), transition's report(rule, ...)
RULE_ARGUMENT = {"violate": 1, "report": 0}


def _rules_the_allocator_reports() -> set[str]:
    """Every rule name the allocator and its log pass to ``violate(seq, rule, ...)`` or ``report(rule, ...)``,
    read from their source: string literals given as the argument, or assigned to the variable given."""
    rules: set[str] = set()
    for path in ALLOCATOR_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assigned = {
            node.targets[0].id: node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        }
        for node in ast.walk(tree):
            func = getattr(node, "func", None)
            name = getattr(func, "attr", getattr(func, "id", None))
            if not isinstance(node, ast.Call) or name not in RULE_ARGUMENT or len(node.args) <= RULE_ARGUMENT[name]:
                continue
            rule = node.args[RULE_ARGUMENT[name]]
            if isinstance(rule, ast.Name):
                rule = assigned[rule.id]
            constants = [n.value for n in ast.walk(rule) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            assert constants, f"{path.name}:{node.lineno}: rule is not a string literal"
            rules.update(constants)
    return rules


def test_audit_rules_cover_every_rule_the_allocator_reports() -> None:
    assert set(allocation_convert.AUDIT_RULES) == _rules_the_allocator_reports()


def _report(violations: list[Violation], closed: bool) -> AuditReport:
    state = PoolState(num_blocks=4, block_size=16, free_block_ids=[3, 2], owners={0: "r1", 1: "r2"}, last_seq=9)
    return AuditReport(
        pool_id="default",
        epoch=2,
        num_events=9,
        last_seq=9,
        closed=closed,
        state=state,
        violations=violations,
        leaked={1: "r2"} if closed else {},
    )


def test_audit_response_names_the_rule_of_each_violation() -> None:
    violations = [
        Violation(seq=4, rule="free_of_free_block", message="block is not allocated", block_id=2, owner="r1"),
        Violation(seq=9, rule="leaked_block", message="block still allocated at POOL_CLOSE", block_id=1, owner="r2"),
    ]
    response = allocation_convert.to_audit_response(_report(violations, closed=True))
    assert list(response.violations) == [
        apb.Violation(
            seq=4, block_id=2, owner="r1", message="block is not allocated", rule=apb.AUDIT_RULE_FREE_OF_FREE_BLOCK
        ),
        apb.Violation(
            seq=9,
            block_id=1,
            owner="r2",
            message="block still allocated at POOL_CLOSE",
            rule=apb.AUDIT_RULE_LEAKED_BLOCK,
        ),
    ]
    assert (response.clean, response.closed) == (False, True)
    assert list(response.held_blocks) == [apb.BlockOwner(block_id=1, owner="r2")]


def test_audit_rule_this_server_cannot_name_keeps_its_name_in_the_message() -> None:
    violation = Violation(seq=3, rule="refcount_underflow", message="block 2 freed by a non-holder")
    [entry] = allocation_convert.to_audit_response(_report([violation], closed=False)).violations
    assert (entry.rule, entry.message) == (
        apb.AUDIT_RULE_UNSPECIFIED,
        "refcount_underflow: block 2 freed by a non-holder",
    )


@pytest.mark.parametrize(
    ("live_epoch", "status"),
    [
        (None, "open (running, or crashed)"),
        (2, "open (live: this server's epoch)"),
        (3, "crashed; epoch 3 (this server's) opened the pool after it"),
    ],
)
def test_audit_response_says_an_older_open_epoch_crashed(live_epoch: int | None, status: str) -> None:
    """The server opened its epoch after any older open one of its pool: that one's server is gone."""
    response = allocation_convert.to_audit_response(_report([], closed=False), live_epoch=live_epoch)
    assert response.summary.splitlines()[0].endswith(f"last seq 9, {status}")
