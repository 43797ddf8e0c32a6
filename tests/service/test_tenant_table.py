"""The tokens file (``nanoserve.service.tenants``): each token names a tenant and a role; a bad file is
refused at start with the file and line named."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.service.config import ServerConfig
from nanoserve.service.tenants import ANONYMOUS, Identity, Role, TenantsFileError, TenantTable

TOKENS = """\
# token   tenant  role
token acme-key acme client
token blue-key blue client   # a second client
token ops-key  ops  admin
"""


def test_tokens_file_maps_each_token_to_its_tenant_and_role() -> None:
    table = TenantTable.parse(TOKENS)
    assert table.num_tokens == 3
    assert table.lookup(b"acme-key") == Identity("acme", Role.CLIENT)
    assert table.lookup(b"ops-key") == Identity("ops", Role.ADMIN)
    assert table.lookup(b"acme-ke") is None
    assert TenantTable.single_token("s3cret").lookup(b"s3cret") == Identity("default", Role.ADMIN)


def test_cert_lines_map_a_client_certificates_common_name_to_its_tenant() -> None:
    table = TenantTable.parse(TOKENS + "cert billing-worker billing client\ncert ops-console ops admin\n")
    assert (table.num_tokens, table.num_certs) == (3, 2)
    assert table.lookup_cert("billing-worker") == Identity("billing", Role.CLIENT)
    assert table.lookup_cert("ops-console") == Identity("ops", Role.ADMIN)
    assert table.lookup_cert("acme-key") is None  # a token is not a certificate name
    assert table.lookup(b"billing-worker") is None  # nor a certificate name a token
    assert TenantTable.parse("cert only-one t client").num_tokens == 0


EXPECTED = "expected 'token TOKEN TENANT ROLE' or 'cert COMMON_NAME TENANT ROLE'"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("token k acme", f"tokens:1: {EXPECTED}, got 3 field(s)"),
        ("\nkey k acme client", f"tokens:2: {EXPECTED}, got 4 field(s)"),
        ("token k a/b client", "tokens:1: tenant must be 1..64 of A-Z a-z 0-9 . _ -, got 'a/b'"),
        ("token k acme root", "tokens:1: role must be 'client' or 'admin', got 'root'"),
        ("token k a client\ntoken k b admin", "tokens:2: this token is already given on an earlier line"),
        ("cert app a client\ncert app b admin", "tokens:2: this certificate name is already given on an earlier line"),
        ("# nothing\n", "tokens: no tokens or certificates (an empty table would refuse every call)"),
    ],
)
def test_tokens_file_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(TenantsFileError) as info:
        TenantTable.parse(text, "tokens")
    assert str(info.value) == message


def test_a_bad_tokens_file_is_a_bad_setting_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nanoserve.service.cli.main import main

    bad = tmp_path / "tokens"
    bad.write_text("token k acme superuser\n")
    assert main(["serve", "--auth-tokens-file", str(bad), "--event-log-url", "none"]) == 2
    assert f"{bad}:1: role must be 'client' or 'admin', got 'superuser'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot read the tokens file"):
        ServerConfig(auth_tokens_file=str(tmp_path / "missing"))


def test_no_auth_is_one_anonymous_admin_and_metrics_bind_localhost() -> None:
    config = ServerConfig()
    assert config.tenant_table() is None
    assert not config.auth_enabled
    assert ANONYMOUS.is_admin
    assert ANONYMOUS.engine_id("x") == "x"
    assert config.metrics_host == "127.0.0.1"


def test_tokens_from_the_environment_variable_are_the_files_lines_with_semicolons_too() -> None:
    from nanoserve.service.config import build_configs

    environ = {"NANOSERVE_AUTH_TOKENS": "token k1 acme client; token k2 ops admin\ncert worker billing client"}
    config, _ = build_configs(None, environ)
    table = config.tenant_table()
    assert table is not None
    assert config.auth_enabled
    assert table.lookup(b"k1") == Identity("acme", Role.CLIENT)
    assert table.lookup(b"k2") == Identity("ops", Role.ADMIN)
    assert table.lookup_cert("worker") == Identity("billing", Role.CLIENT)
    assert (table.num_tokens, table.num_certs) == (2, 1)


def test_tokens_from_the_environment_variable_name_their_line_when_bad() -> None:
    with pytest.raises(TenantsFileError) as info:
        ServerConfig(auth_tokens="token k1 acme client;token k2 ops root")
    assert str(info.value) == "--auth-tokens/NANOSERVE_AUTH_TOKENS:2: role must be 'client' or 'admin', got 'root'"


def test_the_variable_and_the_file_exclude_each_other_neither_wins(tmp_path: Path) -> None:
    from nanoserve.service.config import build_configs

    tokens = tmp_path / "tokens"
    tokens.write_text("token k1 acme client\n")
    environ = {"NANOSERVE_AUTH_TOKENS": "token k2 blue client", "NANOSERVE_AUTH_TOKENS_FILE": str(tokens)}
    with pytest.raises(ValueError, match="are exclusive") as info:  # serve exits 2 with this line
        build_configs(None, environ)
    assert str(info.value) == (
        "--auth-tokens-file (NANOSERVE_AUTH_TOKENS_FILE) and --auth-tokens (NANOSERVE_AUTH_TOKENS) are exclusive: "
        "give the tokens one way (none of them wins over another)"
    )
    with pytest.raises(ValueError, match=r"^--auth-token \(NANOSERVE_AUTH_TOKEN\) and --auth-tokens \("):
        ServerConfig(auth_token="t", auth_tokens="token k2 blue client")
