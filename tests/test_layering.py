"""Imports point one way: service -> engine -> allocator.

The allocator is pure bookkeeping (no torch, no engine); the engine never sees
protobuf or the service. Checked on the source, so a stray import anywhere in a
package fails here before it fails in production.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package folder -> top-level import names it must never use
FORBIDDEN = {
    "allocator": ("torch", "nanoserve.engine", "nanoserve.service", "nanoserve.v1", "grpc", "smg_grpc_proto"),
    "engine": ("nanoserve.service", "nanoserve.v1", "grpc", "google.protobuf", "smg_grpc_proto"),
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _violations(folder: str) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imports(path):
            for banned in FORBIDDEN[folder]:
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_package_imports_point_one_way(folder: str) -> None:
    assert _violations(folder) == []


def test_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom nanoserve.engine import LLM\n")
    assert _imports(bad) == ["torch", "nanoserve.engine"]
