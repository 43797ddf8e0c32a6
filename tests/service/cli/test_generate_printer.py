"""What ``nanoserve generate --json`` prints, as docs/cli.md describes it."""

from __future__ import annotations

import json

import pytest

from nanoserve.service.cli.commands.generate import StreamPrinter
from nanoserve.v1 import generation_pb2 as pb


def _finish(completion_tokens: int, cached_tokens: int) -> pb.Finish:
    usage = pb.Usage(prompt_tokens=66, completion_tokens=completion_tokens, cached_tokens=cached_tokens)
    return pb.Finish(reason=pb.FINISH_REASON_LENGTH, usage=usage)


def test_json_output_says_on_stderr_how_many_prompt_tokens_were_cached(capsys: pytest.CaptureFixture[str]) -> None:
    # a new user found stderr empty under --json, where docs/cli.md promises the cached count
    printer = StreamPrinter(as_json=True)
    printer.print(pb.GenerateResponse(request_id="r", text="Hi", token_ids=[19556]))
    printer.print(pb.GenerateResponse(request_id="r", text="!", token_ids=[17], finish=_finish(2, 64)))
    out, err = capsys.readouterr()
    assert [json.loads(line)["text"] for line in out.splitlines()] == ["Hi", "!"]
    assert err.startswith("[length; 66 prompt (64 cached) + 2 completion tokens; ttft -; total -]")


def test_json_output_of_several_samples_names_sample_0_too(capsys: pytest.CaptureFixture[str]) -> None:
    printer = StreamPrinter(as_json=True, samples=True)
    printer.print(pb.GenerateResponse(request_id="r", text="a", token_ids=[1], index=0))
    printer.print(pb.GenerateResponse(request_id="r", text="b", token_ids=[2], index=1, finish=_finish(1, 0)))
    printer.print(pb.GenerateResponse(request_id="r", text="c", token_ids=[3], index=0, finish=_finish(2, 0)))
    out, err = capsys.readouterr()
    assert [json.loads(line)["index"] for line in out.splitlines()] == [0, 1, 0]
    assert [line.split(":")[0] for line in err.splitlines()] == ["sample 1", "sample 0"]


def test_an_aborted_finish_names_its_cause_and_marks_the_printer_aborted(capsys: pytest.CaptureFixture[str]) -> None:
    # a new user's request cut by the server's shutdown printed "[abort; ...]" and exited 0
    printer = StreamPrinter(as_json=False)
    finish = pb.Finish(
        reason=pb.FINISH_REASON_ABORT, abort_cause=pb.ABORT_CAUSE_SHUTDOWN, usage=pb.Usage(prompt_tokens=3)
    )
    printer.print(pb.GenerateResponse(text="Once", token_ids=[7]))
    assert not printer.aborted
    printer.print(pb.GenerateResponse(finish=finish))
    assert printer.aborted
    assert capsys.readouterr() == (
        "Once\n",
        "[abort (shutdown); 3 prompt (0 cached) + 0 completion tokens; ttft -; total -]\n",
    )


def test_the_note_is_said_with_the_first_message_only(capsys: pytest.CaptureFixture[str]) -> None:
    printer = StreamPrinter(as_json=False, note="note: said once")
    assert capsys.readouterr().err == ""  # nothing before the server answered
    printer.print(pb.GenerateResponse(text="a", token_ids=[1]))
    printer.print(pb.GenerateResponse(text="b", token_ids=[2]))
    assert capsys.readouterr() == ("ab", "note: said once\n")


def test_plain_output_notes_each_kind_of_logprobs_it_leaves_out() -> None:
    """--prompt-logprobs without --json printed the text alone, with no word (--logprobs had a note)."""
    from nanoserve.service.cli.commands.generate import LOGPROBS_NOTE, PROMPT_LOGPROBS_NOTE, _logprobs_note
    from nanoserve.v1 import generation_pb2 as pb

    assert _logprobs_note(pb.SamplingParameters(prompt_logprobs=2), as_json=False) == PROMPT_LOGPROBS_NOTE
    both = pb.SamplingParameters(logprobs=0, prompt_logprobs=0)
    assert _logprobs_note(both, as_json=False) == f"{LOGPROBS_NOTE}\n{PROMPT_LOGPROBS_NOTE}"
    assert _logprobs_note(both, as_json=True) is None
    assert _logprobs_note(pb.SamplingParameters(max_tokens=3), as_json=False) is None
