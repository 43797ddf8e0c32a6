"""The wheel holds every nanoserve package: pyproject.toml lists each source folder that is one.

An editable install (the tests', the README's) imports any folder through the package-dir
mapping, listed or not; ``pip install .`` (the Docker image's) ships only the listed ones,
so a new package missing from the list breaks the image alone. This test reads the list.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"allocator": "nanoserve.allocator", "engine": "nanoserve.engine", "service": "nanoserve.service"}
SOURCE_ROOTS["migrations"] = "nanoserve.migrations"


def _listed_packages() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^packages = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None, "pyproject.toml has no [tool.setuptools] packages list"
    return set(re.findall(r'"([^"]+)"', block.group(1)))


def _source_packages() -> set[str]:
    found = set()
    for folder, package in SOURCE_ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    return found


def test_every_source_package_is_listed_for_the_wheel() -> None:
    assert _source_packages() - _listed_packages() == set()


def test_every_listed_package_is_a_source_folder() -> None:
    assert _listed_packages() - _source_packages() - {"nanoserve.v1"} == set()
