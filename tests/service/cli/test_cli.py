"""The command line: every sub-command parses, --help explains every flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.service.cli.commands.generate import build_request
from nanoserve.service.cli.main import build_parser
from nanoserve.v1 import generation_pb2 as pb


def test_generate_chat_flags_build_the_request() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "--chat",
            "--system",
            "Be brief.",
            "Hi",
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--stop",
            "\n",
            "--stop",
            "END",
            "--seed",
            "7",
            "--n",
            "2",
            "--logit-bias",
            "5=-100",
            "--logit-bias",
            "9=2.5",
            "--prompt-logprobs",
            "1",
            "--truncate-prompt-tokens",
            "-1",
        ]
    )
    request = build_request(args)
    assert (request.sampling.n, dict(request.sampling.logit_bias)) == (2, {5: -100.0, 9: 2.5})
    assert (request.sampling.prompt_logprobs, request.sampling.truncate_prompt_tokens) == (1, -1)
    assert [(m.role, m.content) for m in request.chat.messages] == [
        (pb.CHAT_ROLE_SYSTEM, "Be brief."),
        (pb.CHAT_ROLE_USER, "Hi"),
    ]
    assert request.sampling.max_tokens == 8
    assert request.sampling.HasField("temperature")
    assert request.sampling.temperature == 0.0
    assert list(request.sampling.stop) == ["\n", "END"]
    assert request.sampling.seed == 7
    assert not request.sampling.HasField("top_p")


def test_generate_plain_prompt() -> None:
    request = build_request(build_parser().parse_args(["generate", "Once upon a time"]))
    assert request.WhichOneof("input") == "prompt"
    assert request.prompt == "Once upon a time"
    assert request.sampling == pb.SamplingParameters(max_tokens=256)


def test_generate_cache_salt_flag() -> None:
    request = build_request(build_parser().parse_args(["generate", "--cache-salt", "tenant-a", "Hi"]))
    assert request.cache_salt == "tenant-a"
    assert build_request(build_parser().parse_args(["generate", "Hi"])).cache_salt == ""  # unset: the shared default


def test_generate_finish_line_says_how_many_prompt_tokens_were_cached() -> None:
    from nanoserve.service.cli.commands.generate import _finish_line

    finish = pb.Finish(reason=pb.FINISH_REASON_LENGTH)
    finish.usage.prompt_tokens, finish.usage.cached_tokens, finish.usage.completion_tokens = 413, 400, 8
    assert _finish_line(finish).startswith("[length; 413 prompt (400 cached) + 8 completion tokens; ")


def test_generate_cli_default_max_tokens_is_256() -> None:
    assert build_request(build_parser().parse_args(["generate", "Hi"])).sampling.max_tokens == 256


def test_generate_system_implies_chat() -> None:
    request = build_request(build_parser().parse_args(["generate", "--system", "Be brief.", "Hi"]))
    assert [(m.role, m.content) for m in request.chat.messages] == [
        (pb.CHAT_ROLE_SYSTEM, "Be brief."),
        (pb.CHAT_ROLE_USER, "Hi"),
    ]


@pytest.mark.parametrize("command", ["serve", "generate", "health"])
def test_help_describes_every_flag(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    parser = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings} has no help"
        for option in action.option_strings:
            assert option in text


def test_health_cli_knows_every_service_the_server_reports() -> None:
    from nanoserve.service.cli.commands.health import KNOWN_SERVICES
    from nanoserve.service.grpc.server import health_statuses

    assert tuple(health_statuses(engine_ok=True, log_ok=True)) == KNOWN_SERVICES


@pytest.mark.parametrize("command", ["log", "db"])
def test_every_sub_action_has_a_description_and_help_on_every_flag(command: str) -> None:
    parser = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    actions = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, action_parser in actions.items():
        assert action_parser.description, f"{command} {name} has no description"
        for action in action_parser._actions:
            assert action.help, f"{command} {name} {action.option_strings} has no help"


@pytest.mark.postgres
def test_serve_refuses_a_pool_another_live_server_writes(pg_url: str, tiny_model_dir, tmp_path) -> None:
    """Replicas share one log under their own pool ids: a second server on a taken pool id exits 3, saying why."""
    import subprocess
    import sys
    import uuid

    from nanoserve.allocator.log import EventLog
    from nanoserve.migrations import upgrade

    pool_id = f"cli-{uuid.uuid4().hex[:12]}"
    upgrade(pg_url)
    with EventLog.open(pg_url, pool_id=pool_id, num_blocks=4, block_size=16):  # the live server already there
        command = [sys.executable, "-m", "nanoserve.service.cli.main", "serve", "--model", str(tiny_model_dir)]
        command += ["--event-log-url", pg_url, "--pool-id", pool_id, "--port", "0", "--metrics-port", "off"]
        command += ["--num-kv-blocks", "64", "--dtype", "float32"]
        second = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert second.returncode == 3, second.stderr[-2000:]
    last_line = second.stderr.strip().splitlines()[-1]
    assert last_line.startswith("nanoserve serve: error: event log postgresql+psycopg://")  # the store, then why
    assert f"pool {pool_id!r} is being written by another live server" in last_line
    assert "give this server another pool id (--pool-id / NANOSERVE_POOL_ID)" in last_line
    assert "Traceback" not in second.stderr


@pytest.fixture
def logging_restored():
    """``main`` configures structlog and the root logger onto this test's captured stderr, which pytest
    closes after it: later tests would log into a closed file. Put back what was configured before."""
    import logging

    import structlog

    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("logging_restored")
def test_serve_imports_with_the_collector_off_and_loads_with_it_on_and_the_imports_frozen(monkeypatch, capsys) -> None:
    """The server's imports are frozen (out of every later collection) before the model loads, collector on."""
    import gc

    from nanoserve.engine.errors import EventLogUnusableError
    from nanoserve.service import config
    from nanoserve.service.cli.main import main
    from nanoserve.service.grpc import server

    real_build_configs = config.build_configs
    parsed_with_collector: list[bool] = []
    seen: list[tuple[bool, int]] = []

    def build_configs(args: object) -> object:
        parsed_with_collector.append(gc.isenabled())
        return real_build_configs(args)

    async def start_engine(_engine_config: object, child_setup: object = None) -> None:
        seen.append((gc.isenabled(), gc.get_freeze_count()))
        raise EventLogUnusableError("sqlite:///test.db", "a test stops here")

    monkeypatch.setattr(config, "build_configs", build_configs)
    monkeypatch.setattr(server, "start_engine", start_engine)
    try:
        exit_status = main(
            ["serve", "--event-log-url", "none", "--port", "0", "--metrics-port", "off", "--log-format", "json"]
        )
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()
    assert exit_status == 3  # EXIT_LOG_UNUSABLE
    assert parsed_with_collector == [False]  # the parser's and serve's imports: collector off
    ((enabled, num_frozen),) = seen
    assert enabled
    assert num_frozen > 10_000  # torch, grpc and SQLAlchemy's objects at least
    assert "a test stops here" in capsys.readouterr().err


@pytest.mark.usefixtures("logging_restored")
def test_other_commands_run_with_the_collector_on() -> None:
    import gc

    from nanoserve.service.cli.main import main

    try:
        assert main(["health", "--server", "127.0.0.1:1", "--timeout", "0.2"]) == 2  # nobody listens there
        assert gc.isenabled()
    finally:
        gc.enable()


def test_generate_ctrl_c_while_streaming_cancels_the_call_without_raising() -> None:
    # a KeyboardInterrupt raised inside grpc's iterator was lost (the stream ran to its end, exit 0)
    # or broke its lock (a traceback) on a loaded machine: the handler cancels the call instead
    import signal
    import threading

    from nanoserve.service.cli.commands.generate import CancelOnInterrupt

    cancelled = threading.Event()

    class Call:
        def cancel(self) -> bool:
            cancelled.set()
            return True

    # as in a fresh `nanoserve generate` process, whatever an earlier test in this one left installed
    suite_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with CancelOnInterrupt(Call()) as interrupt:
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here
            assert cancelled.wait(timeout=5.0)
        assert interrupt.interrupted
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):  # outside a stream Ctrl-C raises as usual again
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, suite_handler)


def test_generate_structured_output_flags_build_the_constraint(tmp_path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text('{"type": "object"}')
    request = build_request(build_parser().parse_args(["generate", "Hi", "--json-schema", str(schema)]))
    assert (request.sampling.WhichOneof("constraint"), request.sampling.json_schema) == (
        "json_schema",
        '{"type": "object"}',
    )
    request = build_request(build_parser().parse_args(["generate", "Hi", "--regex", "[0-9]{3}-[0-9]{4}"]))
    assert (request.sampling.WhichOneof("constraint"), request.sampling.regex) == ("regex", "[0-9]{3}-[0-9]{4}")
    request = build_request(build_parser().parse_args(["generate", "Hi", "--choice", "yes", "--choice", "no"]))
    assert list(request.sampling.choice.choices) == ["yes", "no"]
    request = build_request(build_parser().parse_args(["generate", "Hi", "--json-object"]))
    assert (request.sampling.WhichOneof("constraint"), request.sampling.json_object) == ("json_object", True)
    assert build_request(build_parser().parse_args(["generate", "Hi"])).sampling.WhichOneof("constraint") is None


def test_generate_refuses_two_constraints_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "Hi", "--regex", "a+", "--choice", "a"])
    assert info.value.code == 2
    assert "argument --choice: not allowed with argument --regex" in capsys.readouterr().err


def test_generate_names_a_schema_file_it_cannot_read(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "Hi", "--json-schema", str(tmp_path / "missing.json")])
    assert f"argument --json-schema: cannot read {tmp_path / 'missing.json'}: [Errno 2]" in capsys.readouterr().err


@pytest.mark.usefixtures("logging_restored")
@pytest.mark.parametrize("setting", ["--port", "--metrics-port"])
def test_serve_refuses_a_port_another_server_listens_on_before_the_model_loads(
    setting: str, monkeypatch, capsys
) -> None:
    """A new user started a second server on 50051: gRPC's SO_REUSEPORT let both listen, and the kernel
    split the clients between two logs. Now the port is checked before the model loads: exit 2, named."""
    import socket

    from nanoserve.service.cli.main import main
    from nanoserve.service.grpc import server

    async def start_engine(_engine_config: object, child_setup: object = None) -> None:
        raise AssertionError("the model must not load")

    monkeypatch.setattr(server, "start_engine", start_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        flags = {"--port": "0", "--metrics-port": "off", setting: str(port)}
        args = ["serve", "--event-log-url", "none", "--log-format", "json"]
        exit_status = main(args + [item for flag, value in flags.items() for item in (flag, value)])
    assert exit_status == 2  # EXIT_BAD_CONFIG
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    host = "0.0.0.0" if setting == "--port" else "127.0.0.1"
    assert last_line == (
        f"nanoserve serve: error: {setting} {port}: {host}:{port} cannot be bound (Address already in use): "
        f"another server listens there (`ss -ltnp 'sport = :{port}'` names it); stop it or choose another {setting}"
    )


@pytest.mark.usefixtures("logging_restored")
def test_serve_names_a_model_path_or_device_it_cannot_use_in_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A new user's mistyped --model ended in a 40-line asyncio traceback and exit 1 (an unexpected error)."""
    import torch

    from nanoserve.service.cli.main import main
    from nanoserve.service.grpc import server

    async def start_engine(_engine_config: object, child_setup: object = None) -> None:
        raise AssertionError("the model must not load")

    monkeypatch.setattr(server, "start_engine", start_engine)
    base = ["serve", "--event-log-url", "none", "--port", "0", "--metrics-port", "off", "--log-format", "json"]
    missing = tmp_path / "missing.gguf"
    assert main([*base, "--model", str(missing)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nanoserve serve: error: --model {str(missing)!r}: no such file or folder "
        "(a .gguf file, or a folder with config.json)"
    )
    assert main([*base, "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nanoserve serve: error: --model {str(tmp_path)!r} is neither a .gguf file nor a folder with config.json"
    )
    if not torch.cuda.is_available():
        assert main([*base, "--device", "cuda"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "nanoserve serve: error: --device cuda: device 'cuda' requested but CUDA is not available"
        )
