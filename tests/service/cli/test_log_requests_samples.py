"""``nanoserve log requests`` of parallel-sampling requests: its samples' tokens are not journaled, as it says;
each sample's finish reason is; an id admitted twice in an epoch is two rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.engine import LLM, SamplingParams, TokensPrompt
from nanoserve.engine.journal.records import JournalEntry, JournalKind
from nanoserve.service.cli.commands.log_requests import request_rows
from nanoserve.service.cli.main import main


def test_a_request_with_two_samples_is_listed_as_not_journaled_not_as_zero_tokens(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=24, block_size=4, event_log_url=url
    )
    try:
        llm.generate(TokensPrompt([101, 102, 103]), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        llm.generate(
            TokensPrompt([104, 105, 106, 107]),
            SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2, seed=7),
        )
    finally:
        llm.shutdown()
    capsys.readouterr()
    assert main(["log", "requests", "--url", url]) == 0
    rows = [
        [cell.strip() for cell in line.split("  ") if cell.strip()] for line in capsys.readouterr().out.splitlines()[2:]
    ]
    # a new user read "0" output tokens for an n=2 request that streamed 6
    assert [row[2:] for row in rows] == [
        ["admitted", "3", "3", "finished (length)"],
        ["admitted", "4", "- (2 samples, not journaled)", "finished (length)"],
    ]


def _entry(in_epoch: int, journal_seq: int, request_id: str, kind: JournalKind, **data: object) -> JournalEntry:
    return JournalEntry(in_epoch, journal_seq, request_id, kind.value, journal_seq, 0, data)


def test_an_id_admitted_twice_in_an_epoch_is_listed_once_per_admission() -> None:
    """A recovered parallel request that ``generate`` aborted and sent again under its id (a new user's
    trial listed only the second)."""
    sampling = {"n": 2, "seed": 3}
    entries = [
        _entry(2, 1, "", JournalKind.RECOVER, epoch=1, recovered=["r"]),
        _entry(2, 2, "r", JournalKind.ADMIT, recovered_from=1, prompt_token_ids=[1, 2], sampling=sampling),
        _entry(2, 3, "r", JournalKind.FINISH, start=0, finish_reason="abort", abort_cause="abort_rpc"),
        _entry(2, 4, "r", JournalKind.ADMIT, prompt_token_ids=[1, 2], sampling=sampling),
        _entry(2, 5, "r", JournalKind.FINISH, start=0, finish_reason="length"),
    ]
    assert request_rows(entries) == [
        ["2", "r", "recovered from epoch 1", "2", "- (2 samples, not journaled)", "aborted (abort_rpc)"],
        ["2", "r", "admitted", "2", "- (2 samples, not journaled)", "finished (length)"],
    ]


def test_samples_that_ended_differently_each_show_their_reason(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The journal's FINISH of a parallel request names each sample's reason; ``log requests`` shows them
    (a new user saw only sample 0's)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=24, block_size=4, event_log_url=url
    )
    prompt = TokensPrompt([104, 105, 106, 107])
    try:
        free = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=2, seed=7))
        first, second = (sample.token_ids for sample in free[0].outputs)
        # a token sample 0 draws at position 1 and sample 1 never: sample 0 stops there, sample 1 runs to its length
        stop = first[1]
        assert stop not in second, (first, second)  # seed 7 draws such a pair; another seed may need another token
        ended = llm.generate(
            prompt,
            SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=2, seed=7, stop_token_ids=[stop]),
        )
    finally:
        llm.shutdown()
    assert [sample.finish_reason for sample in ended[0].outputs] == ["stop", "length"]
    capsys.readouterr()
    assert main(["log", "requests", "--url", url]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split("  ")[-1].strip() == "finished (#0 stop, #1 length)"
