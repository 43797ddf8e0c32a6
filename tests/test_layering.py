"""Imports point one way: service -> engine -> allocator.log -> allocator; migrations -> the two schemas.

The migrations are imported only by the entry points: the service (``nanoserve
db upgrade``, the gateway's replicas) and the engine's one entry helper,
``engine/core/log_setup.py``, which checks, migrates and opens the log and hands
it to ``LLMEngine``; the engine's core never migrates.

The pure allocator is bookkeeping only (no torch, no engine, no database, no
logging library, nothing of its own event log); the event log builds on it and
never on the engine, the service or the migrations, and holds nothing of the
request journal (the engine's, stored through the log's companion protocol);
the migrations need only the log's schema and the journal's; the engine never
sees protobuf or the service. Checked on the
source, so a stray import anywhere in a package fails here before it fails in
production, and on a real interpreter for the allocator's import cost.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the engine's one importer of nanoserve.migrations: the entry points' way to an engine with its log
ENGINE_ENTRY_HELPER = ROOT / "engine" / "core" / "log_setup.py"

# layer -> (its source files, the import names it must never use)
LAYERS = {
    "allocator": (
        sorted((ROOT / "allocator").glob("*.py")),  # the pure part: not allocator/log/
        (
            "nanoserve.allocator.log",
            "sqlalchemy",
            "alembic",
            "structlog",
            "torch",
            "nanoserve.engine",
            "nanoserve.service",
            "nanoserve.migrations",
            "nanoserve.v1",
            "grpc",
            "smg_grpc_proto",
            "matplotlib",
        ),
    ),
    "allocator.log": (
        sorted((ROOT / "allocator" / "log").rglob("*.py")),
        (
            "torch",
            "nanoserve.engine",
            "nanoserve.service",
            "nanoserve.migrations",
            "nanoserve.v1",
            "grpc",
            "smg_grpc_proto",
            "matplotlib",
        ),
    ),
    "engine": (
        sorted(path for path in (ROOT / "engine").rglob("*.py") if path != ENGINE_ENTRY_HELPER),
        ("nanoserve.service", "nanoserve.v1", "grpc", "google.protobuf", "smg_grpc_proto", "nanoserve.migrations"),
    ),
    "engine entry helper": (
        [ENGINE_ENTRY_HELPER],
        ("nanoserve.service", "nanoserve.v1", "grpc", "google.protobuf", "smg_grpc_proto"),
    ),
}
# the only nanoserve modules the migrations may import (besides their own package)
MIGRATIONS_MAY_IMPORT = ("nanoserve.allocator.log.schema", "nanoserve.engine.journal.schema")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # `from nanoserve.allocator import log` imports the module nanoserve.allocator.log
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(layer: str) -> list[str]:
    files, banned_names = LAYERS[layer]
    found = []
    for path in files:
        for name in _imports(path):
            found.extend(
                f"{path.relative_to(ROOT)} imports {name}" for banned in banned_names if _matches(name, banned)
            )
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_package_imports_point_one_way(layer: str) -> None:
    assert _violations(layer) == []


def test_the_log_holds_no_journal() -> None:
    """The request journal is the engine's: no module of the log is named after it or mentions its
    table, and none imports it (``nanoserve.engine`` is banned above, its old home here is gone)."""
    log_files = sorted((ROOT / "allocator" / "log").rglob("*.py"))
    assert [path.name for path in log_files if "journal" in path.stem] == []
    assert [str(path.relative_to(ROOT)) for path in log_files if "request_journal" in path.read_text()] == []
    assert [
        f"{path.relative_to(ROOT)} imports {name}" for path in log_files for name in _imports(path) if "journal" in name
    ] == []


def test_migrations_import_only_the_schemas() -> None:
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "migrations").rglob("*.py"))
        for name in _imports(path)
        if _matches(name, "nanoserve")
        and not _matches(name, "nanoserve.migrations")
        and not any(_matches(name, allowed) or allowed.startswith(name + ".") for allowed in MIGRATIONS_MAY_IMPORT)
    ]
    assert found == []


@pytest.mark.parametrize("module", ["llm_engine.py", "async_llm_engine.py"])
def test_the_engine_core_is_handed_its_log_and_never_migrates(module: str) -> None:
    path = ROOT / "engine" / "core" / module
    assert [name for name in _imports(path) if _matches(name, "nanoserve.migrations")] == []
    assert not any(_matches(name, "nanoserve.engine.core.log_setup") for name in _imports(path))


def test_the_entry_helper_is_what_imports_the_migrations() -> None:
    assert "nanoserve.migrations" in _imports(ENGINE_ENTRY_HELPER)


def test_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom nanoserve.engine import LLM\nfrom nanoserve.allocator import log\n")
    assert _imports(bad) == [
        "torch",
        "nanoserve.engine",
        "nanoserve.engine.LLM",
        "nanoserve.allocator",
        "nanoserve.allocator.log",
    ]


def _modules_imported_by(statement: str) -> list[str]:
    """Every module a fresh interpreter imports to run ``statement`` (``python -X importtime``)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, check=True, cwd=ROOT
    )
    # stderr lines: "import time: <self us> | <cumulative us> | <indent><module>"
    return [
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and not line.endswith("imported package")
    ]


def test_importing_the_allocator_pulls_in_no_database_logging_or_torch() -> None:
    modules = _modules_imported_by("from nanoserve.allocator import BlockAllocator")
    assert "nanoserve.allocator.block_allocator" in modules
    heavy = ("sqlalchemy", "alembic", "structlog", "torch", "nanoserve.allocator.log", "nanoserve.engine")
    assert [module for module in modules if any(_matches(module, name) for name in heavy)] == []


def test_import_checker_sees_what_the_log_pulls_in() -> None:
    modules = _modules_imported_by("from nanoserve.allocator.log import EventLog")
    assert {"sqlalchemy", "structlog", "nanoserve.allocator.log.event_log"} <= set(modules)
    assert not any(_matches(module, "nanoserve.migrations") for module in modules)
