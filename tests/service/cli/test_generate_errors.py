"""``nanoserve generate``'s mistakes and failures, as a new user meets them: a number out of range is
refused before any connection (argparse, exit 2, naming the flag and the limit); a refused connection and
a missing token say what to do; the --logprobs note is said only once the server took the request."""

from __future__ import annotations

import grpc
import pytest

from nanoserve.service.cli.client import status_hint
from nanoserve.service.cli.main import main

from ...faults import free_port


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-tokens", "0", "must be >= 1, got 0"),
        ("--max-tokens", "99999999999", "must be at most 2147483647 (the API's int32), got 99999999999"),
        ("--max-tokens", "many", "must be an integer >= 1, got 'many'"),
        ("--min-tokens", "-1", "must be >= 0, got -1"),
        ("--temperature", "-0.5", "must be >= 0, got -0.5"),
        ("--temperature", "nan", "must be a finite number >= 0, got nan"),
        ("--temperature", "inf", "must be a finite number >= 0, got inf"),
        ("--cache-salt", "", "must be 1..256 characters, got 0"),
        ("--cache-salt", "s" * 257, "must be 1..256 characters, got 257"),
        ("--top-p", "0", "must be in (0, 1], got 0"),
        ("--top-k", "-1", "must be >= 0, got -1"),
        ("--min-p", "1.5", "must be in [0, 1], got 1.5"),
        ("--seed", str(2**63), f"must be in [{-(2**63)}, {2**63 - 1}], got {2**63}"),
        ("--repetition-penalty", "0", "must be > 0, got 0"),
        ("--presence-penalty", "3", "must be in [-2, 2], got 3"),
        ("--frequency-penalty", "-2.5", "must be in [-2, 2], got -2.5"),
        ("--logprobs", "21", "must be in [0, 20], got 21"),
        ("--prompt-logprobs", "-1", "must be in [0, 20], got -1"),
        ("--n", "0", "must be >= 1, got 0"),
        ("--best-of", "0", "must be >= 1, got 0"),
        ("--truncate-prompt-tokens", "0", "must be -1 or >= 1, got 0"),
        ("--stop-token-id", "-3", "must be >= 0, got -3"),
        ("--logit-bias", "5=300", "must be ID=BIAS with ID >= 0 and BIAS in [-100, 100], got '5=300'"),
        ("--timeout", "0", "must be > 0, got 0"),
        ("--wait-ready", "-1", "must be >= 0, got -1"),
    ],
)
def test_a_number_out_of_range_is_refused_before_connecting(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a new user's --max-tokens 0 went to the server (exit 1); nothing listens at port 1 here: no call is made
    with pytest.raises(SystemExit) as info:
        main(["generate", "--server", "127.0.0.1:1", f"{flag}={value}", "hi"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"nanoserve generate: error: argument {flag}: {message}"


def test_a_refused_connection_says_no_server_runs_there_and_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = f"127.0.0.1:{free_port()}"
    assert main(["generate", "--server", server, "--timeout", "10", "--logprobs", "2", "hi"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: UNAVAILABLE: ")
    assert err[1:] == [
        f"hint: nothing listens at {server}: `nanoserve serve` is not running there "
        "(--server or NANOSERVE_SERVER names the address)"
    ]  # and no --logprobs note: the request was never taken


def test_health_of_a_refused_connection_gives_the_same_hint(capsys: pytest.CaptureFixture[str]) -> None:
    server = f"127.0.0.1:{free_port()}"
    assert main(["health", "--server", server]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"hint: nothing listens at {server}: `nanoserve serve` is not running there "
        "(--server or NANOSERVE_SERVER names the address)"
    )


def test_unauthenticated_names_the_token_flag_and_variable() -> None:
    code = grpc.StatusCode.UNAUTHENTICATED
    assert status_hint(code, "missing bearer token", "h:1") == (
        "the server requires a token: pass --token TOKEN or set NANOSERVE_AUTH_TOKEN"
    )
    assert status_hint(code, "unknown token", "h:1", token_given=True) == (
        "the server does not accept the token given (--token or NANOSERVE_AUTH_TOKEN)"
    )
    assert status_hint(grpc.StatusCode.INVALID_ARGUMENT, "sampling.n: ...", "h:1") is None


@pytest.mark.parametrize("command", ["generate", "health"])
@pytest.mark.parametrize(
    ("server", "message"),
    [
        ("http://localhost:50051", "must be HOST:PORT (no scheme; e.g. localhost:50051), got 'http://localhost:50051'"),
        ("localhost", "must be HOST:PORT with a port in 1..65535 (e.g. localhost:50051), got 'localhost'"),
        ("localhost:0", "must be HOST:PORT with a port in 1..65535 (e.g. localhost:50051), got 'localhost:0'"),
    ],
)
def test_a_server_address_that_is_not_host_port_is_refused_before_connecting(
    command: str, server: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--server http://...` dialed a misformatted name, a bare `localhost` port 443: each failed with a
    'went away' hint."""
    args = [command, "--server", server] + (["hi"] if command == "generate" else [])
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"nanoserve {command}: error: argument --server: {message}"


def test_wait_ready_that_runs_out_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --wait-ready 3` against a wrong port said only 'not SERVING after 3.0 s'."""
    server = f"127.0.0.1:{free_port()}"
    assert main(["generate", "--server", server, "--wait-ready", "0.5", "hi"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {server} not SERVING after 0.5 s",
        f"hint: nothing listens at {server}: `nanoserve serve` is not running there "
        "(--server or NANOSERVE_SERVER names the address)",
    ]


def test_the_hints_tell_a_server_that_answered_from_one_that_is_not_there() -> None:
    unavailable = grpc.StatusCode.UNAVAILABLE
    # a draining server's own message says what to do: no 'went away or cannot be reached'
    assert status_hint(unavailable, "the server is shutting down: new calls are refused; retry", "h:1") is None
    details = "failed to connect to all addresses; ... SSL_ERROR_SSL: error:0A00010B:SSL routines::wrong version number"
    assert status_hint(unavailable, details.replace("wrong version number", "WRONG_VERSION_NUMBER"), "h:1") == (
        "the server at h:1 does not speak TLS: drop --tls (and --ca-cert)"
    )
    assert status_hint(unavailable, "Tls handshake failed (TSI_PROTOCOL_FAILURE)", "h:1") == (
        "the TLS handshake with h:1 failed: --ca-cert must name the CA that signed the server's certificate "
        "(and the certificate must name the address in --server)"
    )


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"nanoserve {version('nanoserve')}\n"
