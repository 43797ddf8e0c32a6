"""``nanoserve generate`` against a ``nanoserve serve`` that goes away under it (a new user's trial):

- a parallel request (``--n``) cut by a crash cannot be resumed (the journal keeps no tokens of
  parallel samples), so ``--wait-ready`` aborts the server's recovered copy and sends the request
  again, saying so in one line; seeded, the samples are the uninterrupted run's;
- a request the server aborts (its shutdown) prints the cause on the finish line and exits 1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.service.cli.main import main

from ...faults import free_port
from .test_journal_crash import PROMPTS, Server, read_rest, serve_command
from .test_serve_log_faults import clean_env

MAX_TOKENS = 400


def _generate(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "nanoserve.service.cli.main", "generate", PROMPTS[1], "--server", f"127.0.0.1:{port}"),
        *("--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", *flags),
    ]


def _samples(lines: list[str]) -> dict[int, list[int]]:
    """Sample index -> the token ids its messages carried, in order."""
    samples: dict[int, list[int]] = {}
    for message in (json.loads(line) for line in lines if line.strip()):
        samples.setdefault(message["index"], []).extend(message.get("token_ids", []))
    return samples


def test_a_parallel_request_cut_by_a_crash_is_aborted_and_sent_again_with_its_seed(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    command = serve_command(url, tiny_model_dir, "par", port)
    sampling = ("--n", "2", "--seed", "11", "--temperature", "0.9")
    server = Server(command)
    cli = subprocess.Popen(
        _generate(port, *sampling, "--request-id", "par-1", "--wait-ready", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert cli.stdout is not None
    before = [cli.stdout.readline() for _ in range(3)]  # both samples are streaming
    server.kill()
    server = Server(command)
    out, err = read_rest(cli, 120)
    uninterrupted = subprocess.run(
        _generate(port, *sampling), capture_output=True, text=True, env=clean_env(), timeout=120, check=True
    )
    server.stop()
    # on main: Resume refused the request (INVALID_ARGUMENT: 2 samples), exit 1
    assert cli.returncode == 0, err
    assert (
        "request par-1 has 2 samples, which Resume cannot continue (the journal keeps no tokens of parallel "
        "samples): aborted it on the server and sent it again from its prompt (seed 11: the same samples)"
    ) in err.splitlines()
    reference = _samples(uninterrupted.stdout.splitlines())
    streamed = _samples(before + out.splitlines())  # what came before the crash, then the whole samples again
    assert sorted(streamed) == sorted(reference) == [0, 1]
    for index, tokens in reference.items():
        assert len(tokens) == MAX_TOKENS
        cut = len(streamed[index]) - MAX_TOKENS
        assert streamed[index][cut:] == tokens
        assert streamed[index][:cut] == tokens[:cut]  # the same seed: the part before the crash was the same
    capsys.readouterr()
    assert main(["log", "requests", "--url", url, "--epoch", "2"]) == 0
    rows = [line.split("  ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [[cell.strip() for cell in row if cell.strip()][1:] for row in rows][:2] == [
        ["par-1", "recovered from epoch 1", "6", "- (2 samples, not journaled)", "aborted (abort_rpc)"],
        ["par-1", "admitted", "6", "- (2 samples, not journaled)", "finished (length)"],
    ]


def test_a_request_the_server_aborts_names_the_cause_and_exits_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    server = Server(serve_command(url, tiny_model_dir, "abort", port, "--grace-s", "0.2"))
    cli = subprocess.Popen(
        _generate(port, "--temperature", "0", "--max-tokens", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert cli.stdout is not None
    cli.stdout.readline()  # streaming
    server.process.send_signal(signal.SIGTERM)  # the grace runs out under the stream: aborted, cause shutdown
    _, err = read_rest(cli, 60)
    server.process.wait(timeout=60)
    # on main: "[abort; ...]" and exit 0
    assert cli.returncode == 1, err
    assert err.splitlines()[-1].startswith("[abort (shutdown); ")


def test_a_stream_a_crash_cuts_without_wait_ready_names_the_request_and_how_to_resume_it(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's stream cut by a crash said only 'went away or cannot be reached ... --tls for a TLS server',
    though the restarted server recovered the request (its id server-assigned, printed nowhere)."""
    url = f"sqlite:///{tmp_path / 'log.db'}"
    port = free_port()
    command = serve_command(url, tiny_model_dir, "cut", port)
    server = Server(command)
    cli = subprocess.Popen(
        _generate(port, "--temperature", "0", "--max-tokens", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert cli.stdout is not None
    lines = [cli.stdout.readline() for _ in range(3)]
    if not all(lines):
        raise AssertionError(f"generate ended early: {read_rest(cli, 30)}")
    before = [json.loads(line) for line in lines]
    server.kill()
    out, err = read_rest(cli, 60)
    received = sum(len(m.get("token_ids", [])) for m in before) + sum(
        len(json.loads(line).get("token_ids", [])) for line in out.splitlines() if line.strip()
    )
    request_id = before[0]["request_id"]
    assert cli.returncode == 1, err
    assert err.splitlines()[-1] == (
        f"hint: the server journals request {request_id}: once it is back, `nanoserve resume {request_id} "
        f"--after-token {received}` prints the rest (generate --wait-ready SECONDS resumes by itself)"
    )
    assert err.splitlines()[-2].startswith("error: UNAVAILABLE: ")
    server = Server(command)  # the request is recovered: the hint's command gives the rest
    resumed = subprocess.run(
        [
            sys.executable,
            *("-m", "nanoserve.service.cli.main", "resume", request_id, "--server", f"127.0.0.1:{port}"),
            *("--after-token", str(received), "--json"),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    server.stop()
    assert resumed.returncode == 0, resumed.stderr
    rest = sum(len(json.loads(line).get("token_ids", [])) for line in resumed.stdout.splitlines())
    assert received + rest == 1000
