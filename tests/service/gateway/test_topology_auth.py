"""Auth in front of and behind the gateway, without starting a process.

smg 1.13 reaches its gRPC workers in plaintext and sends them no credentials
(its ``--api-key`` is not passed on: a worker that demands a token answers its
HealthCheck UNAUTHENTICATED and is never registered), so ``nanoserve gateway``
keeps the replicas open on 127.0.0.1 and refuses, at once and by name, every
serve flag or inherited environment variable that would make them demand
credentials: before, such a topology waited ``--startup-timeout-s`` (300 s) for
a gateway that never routes. Keys go to the gateway instead
(``--tenant-api-key TENANT:KEY``); ``test_gateway.py`` runs its module's
gateway with two of them.
"""

from __future__ import annotations

import pytest

from nanoserve.service.cli.main import main
from nanoserve.service.gateway.replicas import Topology, TopologyConfig, replica_auth_flags, serve_flag_of

AUTH_FLAGS = ("--auth-token", "--auth-tokens", "--auth-tokens-file", "--tls-cert", "--tls-key", "--tls-client-ca")
AUTH_ENV = (
    "NANOSERVE_AUTH_TOKEN",
    "NANOSERVE_AUTH_TOKENS",
    "NANOSERVE_AUTH_TOKENS_FILE",
    "NANOSERVE_TLS_CERT",
    "NANOSERVE_TLS_KEY",
    "NANOSERVE_TLS_CLIENT_CA",
)


def test_the_auth_flags_are_the_serve_settings_that_demand_credentials_or_tls() -> None:
    assert sorted(replica_auth_flags()) == sorted(AUTH_FLAGS)


@pytest.mark.parametrize("flag", AUTH_FLAGS)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_a_replica_auth_flag_is_refused_by_name(flag: str, form: str) -> None:
    serve_args = (flag, "value") if form == "separate" else (f"{flag}=value",)
    with pytest.raises(ValueError, match=f"serve_args must not set {flag}: smg reaches the replicas in plaintext"):
        TopologyConfig(serve_args=("--max-num-seqs", "4", *serve_args))


@pytest.mark.parametrize(
    ("written", "flag"),
    [
        ("--auth-tokens-f", "--auth-tokens-file"),
        ("--auth-tokens-fi=F", "--auth-tokens-file"),
        ("--tls-client", "--tls-client-ca"),
        ("--tls-ce", "--tls-cert"),
        ("--auth-to", None),  # --auth-token, --auth-tokens and --auth-tokens-file: serve refuses it as ambiguous
    ],
)
def test_an_abbreviation_argparse_would_expand_to_an_auth_flag_is_refused_too(written: str, flag: str | None) -> None:
    # the replica's argparse expands a unique prefix: a new user's --auth-tokens-f reached the replica
    # and the gateway waited its whole start-up timeout
    assert serve_flag_of(written) == flag
    if flag is not None:
        with pytest.raises(ValueError, match=f"must not set {flag} \\(written {written.split('=')[0]}\\)"):
            TopologyConfig(serve_args=(written, "value"))
    else:
        TopologyConfig(serve_args=(written, "value"))


def test_other_serve_flags_and_values_pass() -> None:
    assert serve_flag_of("--max-num-se") == "--max-num-seqs"
    assert serve_flag_of("--max-num") is None  # ambiguous: serve says so itself
    assert serve_flag_of("--no-journal") == "--no-journal"
    assert serve_flag_of("--auth-token-please") is None
    assert serve_flag_of("auth-token") is None
    TopologyConfig(serve_args=("--max-num-seqs", "4", "--model", "/models/auth-token", "--journal"))


@pytest.mark.parametrize("name", AUTH_ENV)
def test_an_inherited_auth_variable_stops_the_start_before_any_replica_is_spawned(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for other in AUTH_ENV:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "x")
    topology = Topology(TopologyConfig(event_log_url="none"))
    with pytest.raises(RuntimeError, match=f"^{name} set in the environment: every replica would inherit it"):
        topology.start()
    assert topology.replicas == []
    assert topology.gateway is None


def test_an_empty_auth_variable_is_not_set() -> None:
    from nanoserve.service.gateway.replicas import replica_auth_in_environment

    assert replica_auth_in_environment({"NANOSERVE_AUTH_TOKEN": "", "NANOSERVE_TLS_CERT": "c"}) == [
        "NANOSERVE_TLS_CERT"
    ]


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (("no-colon-secret",), "entry 1 is not TENANT:KEY"),
        (("acme:k1", "bad tenant:k2"), "entry 2 is not TENANT:KEY"),
        (("acme:",), "entry 1 is not TENANT:KEY"),
        (("acme:has space",), "entry 1 is not TENANT:KEY"),
        (("a" * 65 + ":k",), "entry 1 is not TENANT:KEY"),
        (("acme:k1", "acme:k2"), "tenant 'acme' is named twice"),
    ],
)
def test_a_malformed_tenant_api_key_is_refused_without_quoting_the_key(pairs: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        TopologyConfig(tenant_api_keys=pairs)
    for secret in ("secret", "k1", "k2", "has space"):
        assert secret not in str(refused.value)


def test_the_command_line_refuses_an_auth_flag_for_the_replicas_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--port", "0", "--", "--auth-token", "s3cret"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("nanoserve gateway: error: serve_args must not set --auth-token")
    assert "--tenant-api-key TENANT:KEY" in error
    assert "s3cret" not in error


def test_the_command_line_refuses_a_malformed_tenant_key_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANOSERVE_GATEWAY_TENANT_API_KEYS", "acme:k1; blue")
    assert main(["gateway", "--port", "0"]) == 2
    assert "tenant_api_keys: entry 2 is not TENANT:KEY" in capsys.readouterr().err
