"""The model runner in a child process (``runner_process``): the same tokens, logprobs and prompt
logprobs as in the engine's own process (through the shared buffer and, past its size, the pipe);
a load error raised as the runner raised it; a child that dies is an error, never a hang; ``close``
and the engine's shutdown end the child."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable

import pytest

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core.llm import LLM
from nanoserve.engine.model import runner_process
from nanoserve.engine.model.runner_process import RunnerProcess, RunnerProcessError
from nanoserve.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)


def _outputs(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[object, ...]]:
    return [
        (c.token_ids, c.text, c.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params) for c in o.outputs
    ]


def test_a_child_process_runner_gives_the_same_tokens_logprobs_and_prompt_logprobs(
    make_tiny_llm: Callable[..., LLM],
) -> None:
    prompts = ["The lighthouse keeper", "one two three four five six", "Hello"]
    long_prompt = " ".join(["lighthouse"] * 190)  # more prompt rows than the shared buffer holds
    in_process = make_tiny_llm(num_threads=1)
    child = make_tiny_llm(num_threads=1, runner_process=True)
    runner = child.engine.runner
    assert isinstance(runner, RunnerProcess)
    assert runner.pid != os.getpid()
    max_shared_rows = runner_process.MAX_SHARED_BYTES // (4 * runner.vocab_size)
    assert len(child.engine.tokenizer.encode(long_prompt)) > max_shared_rows  # the pipe's path is taken
    for params in (GREEDY, SAMPLED):
        assert _outputs(child, prompts, params) == _outputs(in_process, prompts, params)
    with_prompt_logprobs = dataclasses.replace(GREEDY, prompt_logprobs=2, max_tokens=3)
    got = _outputs(child, [long_prompt, "Hello"], with_prompt_logprobs)
    assert got == _outputs(in_process, [long_prompt, "Hello"], with_prompt_logprobs)
    assert len(got[0][3]) == len(child.engine.tokenizer.encode(long_prompt)) - 1  # each token but the first


def test_a_load_error_in_the_child_is_raised_as_the_runner_raises_it(tiny_model_dir: object) -> None:
    config = EngineConfig.from_kwargs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", max_model_len=4096, runner_process=True
    )
    with pytest.raises(ValueError, match="max_model_len must be <= the model's context length 1024, got 4096"):
        RunnerProcess(config)


def test_a_dead_child_fails_the_step_and_close_ends_the_child(make_tiny_llm: Callable[..., LLM]) -> None:
    llm = make_tiny_llm(num_threads=1, runner_process=True)
    runner = llm.engine.runner
    assert isinstance(runner, RunnerProcess)
    [ok] = llm.generate("Hello", GREEDY)
    assert len(ok.outputs[0].token_ids) == 12
    os.kill(runner.pid, signal.SIGKILL)
    with pytest.raises(RunnerProcessError, match=rf"model runner process {runner.pid} exited \(exit code -9\)"):
        llm.generate("Hello", GREEDY)
    llm.engine.shutdown()  # the runner is gone: shutdown still ends, and close is idempotent
    runner.close()


def test_shutdown_ends_the_child_process(make_tiny_llm: Callable[..., LLM]) -> None:
    llm = make_tiny_llm(num_threads=1, runner_process=True)
    runner = llm.engine.runner
    assert isinstance(runner, RunnerProcess)
    process = runner._process
    assert process.is_alive()
    llm.engine.shutdown()
    assert not process.is_alive()
    assert process.exitcode == 0
