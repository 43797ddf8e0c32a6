"""``nanoserve log requests`` of a parallel-sampling request: its samples' tokens are not journaled, as it says."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.engine import LLM, SamplingParams, TokensPrompt
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
