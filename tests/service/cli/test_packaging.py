"""docker-compose.yml and the Dockerfile hold what the set-up promises.

No Docker engine runs here, so the compose file is validated against the
Compose Specification's JSON schema (vendored in check-jsonschema as
``vendor.compose-spec``), and its wiring is checked on the parsed YAML.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _require_check_jsonschema() -> None:
    # in the dev extra (scripts/install.sh installs it); a venv made before it was added skips
    pytest.importorskip("check_jsonschema", reason="pip install -e '.[dev]' (check-jsonschema)")


def test_compose_file_matches_the_compose_spec_schema() -> None:
    _require_check_jsonschema()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(ROOT / "docker-compose.yml"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    _require_check_jsonschema()
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  nanoserve:\n    ports: 50051\n    healthcheck: {interval: 10}\n")
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1


def test_server_uses_postgres_log_after_migrations() -> None:
    services = _compose()["services"]
    url = "postgresql+psycopg://nanoserve:nanoserve@postgres:5432/nanoserve"
    assert services["migrate"]["command"] == ["db", "upgrade", url]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["nanoserve"]["environment"]["NANOSERVE_EVENT_LOG_URL"] == url
    assert services["nanoserve"]["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    assert services["nanoserve"]["command"] == ["serve"]


def test_healthcheck_goes_through_grpc_health() -> None:
    services = _compose()["services"]
    assert services["nanoserve"]["healthcheck"]["test"] == ["CMD", "nanoserve", "health", "--server", "localhost:50051"]
    assert 'CMD ["nanoserve", "health", "--server", "localhost:50051"]' in (ROOT / "Dockerfile").read_text()


def test_database_lives_on_a_volume() -> None:
    compose = _compose()
    assert compose["services"]["postgres"]["volumes"] == ["pgdata:/var/lib/postgresql/data"]
    assert "pgdata" in compose["volumes"]


def test_dockerfile_copies_every_package_folder() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for folder in ("allocator", "engine", "service", "migrations", "protos"):
        assert f"COPY {folder}/ {folder}/" in text


def test_pyproject_metadata_applies_without_setuptools_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # the readme and package dirs are relative to the project
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert distribution.metadata.license_expression == "Apache-2.0"
    assert [str(w.message) for w in caught] == []


def test_gateway_profile_puts_smg_in_front_of_two_replicas_sharing_the_postgres_log() -> None:
    services = _compose()["services"]
    url = "postgresql+psycopg://nanoserve:nanoserve@postgres:5432/nanoserve"
    replicas = ("replica-0", "replica-1")
    for name in replicas:
        replica = services[name]
        assert replica["profiles"] == ["gateway"]
        assert replica["command"] == ["serve"]
        assert replica["environment"]["NANOSERVE_EVENT_LOG_URL"] == url
        assert replica["environment"]["NANOSERVE_POOL_ID"] == name  # its own pool in the shared log
        assert replica["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    smg = services["smg"]
    assert smg["profiles"] == ["gateway"]
    assert smg["entrypoint"] == ["smg"]
    command = smg["command"]
    assert command[:3] == ["launch", "--backend", "vllm"]
    workers = command[command.index("--worker-urls") + 1 : command.index("--policy")]
    assert workers == [f"grpc://{name}:50051" for name in replicas]
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert smg["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas}
    assert "profiles" not in services["nanoserve"]  # `docker compose up` still starts the one server alone


def test_the_image_carries_the_gateway() -> None:
    assert 'RUN pip install ".[gateway]"' in (ROOT / "Dockerfile").read_text()
