"""Importing nanoserve changes no environment variable: process-wide settings belong to the entry points.

The CLI's ``main`` sets the thread wait policy before torch loads; the
tokenizer stays offline by what it passes (``local_files_only=True``), not by
HF_HUB_OFFLINE. A library import that set either would change the behaviour of
everything else in the caller's process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Alembic's env.py runs migrations when imported: it is loaded by Alembic, never imported
NOT_IMPORTABLE = ("nanoserve.migrations.env",)

CHILD = """
import importlib, json, os, pkgutil, sys
import nanoserve
skip = set(json.loads(sys.argv[1]))
before = dict(os.environ)
imported = []
for package in ("allocator", "engine", "service", "migrations", "v1"):
    root = importlib.import_module("nanoserve." + package)
    imported.append(root.__name__)
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if info.name in skip:
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
after = dict(os.environ)
changed = {k: [before.get(k), after.get(k)] for k in set(before) | set(after) if before.get(k) != after.get(k)}
print(json.dumps({"imported": imported, "changed": changed}))
"""


def _import_everything(environ: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(NOT_IMPORTABLE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_importing_every_nanoserve_module_changes_no_environment_variable() -> None:
    environ = {
        name: value
        for name, value in os.environ.items()
        if name not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")
    }
    result = _import_everything(environ)
    imported = result["imported"]
    assert isinstance(imported, list)
    for module in (
        "nanoserve.engine.text.tokenizer",
        "nanoserve.engine.core.llm",
        "nanoserve.engine.model.threads",
        "nanoserve.service.cli.main",
        "nanoserve.service.grpc.server",
        "nanoserve.allocator.log.event_log",
    ):
        assert module in imported
    assert result["changed"] == {}
