"""The docs name only what exists: paths, bench modules, anchors and CLI flags.

README.md, ARCHITECTURE.md and docs/*.md are read as text. Checked:

- a repository path (``engine/...``, ``service/...``, ``allocator/...``, ``bench/...``,
  ``scripts/...``, ``tests/...``, ``docs/...``, ``protos/...``, ``migrations/...``) in a code
  span or a code block exists (a ``*`` in it must match at least one file);
- a link to a local file exists, relative to the page, and its ``#anchor`` is a heading there;
- ``python -m bench.X`` / ``python -m nanoserve.X`` names a module that exists;
- a ``--flag`` shown after ``nanoserve serve|generate|health|gateway|db ...|log ...`` (in one
  code span, one command line, or one row of a table whose first cell is that command) is a
  flag of that command's argparse parser; after a lone ``--`` on a ``gateway`` line, of ``serve``;
- the settings table in docs/configuration.md is the one the generator writes now.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from nanoserve.service.cli import config_docs
from nanoserve.service.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
ROOMS = ("engine", "service", "allocator", "bench", "scripts", "tests", "docs", "protos", "migrations")
PATH_RE = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOMS) + r")/[\w./*-]*[\w*])")
MODULE_RE = re.compile(r"python -m ((?:bench|nanoserve)(?:\.\w+)+)")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
SPAN_RE = re.compile(r"`([^`\n]+)`")
COMMAND_RE = re.compile(r"\bnanoserve(?:\.service\.cli\.main)? (serve|generate|health|gateway|db|log)\b(?: ([a-z]+))?")
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _code_blocks(text: str) -> list[str]:
    """Lines of fenced (```) and indented (4 spaces after a blank line) code, continuations joined."""
    lines: list[str] = []
    fenced = False
    previous_blank = True
    in_indented = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            lines.append(line)
        elif line.startswith("    ") and (previous_blank or in_indented) and line.strip():
            in_indented = True
            lines.append(line.strip())
        else:
            in_indented = False
        previous_blank = not line.strip()
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    return joined


def _without_comment(line: str) -> str:
    return re.split(r"\s#\s", line, maxsplit=1)[0]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    headings = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"^#{1,6} ", line):
            headings.append(_slug(line.lstrip("#")))
    return set(headings)


def _repo_path_exists(path: str) -> bool:
    path = path.split("::", 1)[0].rstrip(".")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOC_FILES, ids=_ids(DOC_FILES))
def test_repo_paths_named_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    snippets = SPAN_RE.findall(text) + _code_blocks(text)
    missing = sorted(
        {
            path
            for snippet in snippets
            for path in PATH_RE.findall(snippet)
            if "..." not in path and "{" not in path and not _repo_path_exists(path)
        }
    )
    assert missing == [], f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOC_FILES, ids=_ids(DOC_FILES))
def test_links_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK_RE.findall(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target} (no file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor})")
    assert broken == [], f"{doc.relative_to(ROOT)} has broken links: {broken}"


@pytest.mark.parametrize("doc", DOC_FILES, ids=_ids(DOC_FILES))
def test_python_modules_named_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = []
    for module in sorted(set(MODULE_RE.findall(text))):
        parts = module.split(".")
        if parts[0] == "nanoserve":
            parts = parts[1:]
        base = ROOT.joinpath(*parts)
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
            missing.append(module)
    assert missing == [], f"{doc.relative_to(ROOT)} names modules that do not exist: {missing}"


def _flags_by_command() -> dict[str, set[str]]:
    """``serve`` / ``log audit`` / ``db upgrade`` ... -> its option strings (a command with sub-commands: its own)."""

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {option for action in parser._actions for option in action.option_strings}

    flags: dict[str, set[str]] = {}
    for name, parser in subcommands(build_parser()).items():
        flags[name] = options(parser)
        for sub_name, sub_parser in subcommands(parser).items():
            flags[f"{name} {sub_name}"] = options(sub_parser) | flags[name]
    return flags


def _command_segments(text: str) -> list[tuple[str, str]]:
    """(command as in _flags_by_command, the text whose flags are that command's)."""
    segments: list[tuple[str, str]] = []
    rows = [line for line in text.splitlines() if line.startswith("| `nanoserve ")]
    lines = SPAN_RE.findall("\n".join(line for line in text.splitlines() if line not in rows))
    lines += [_without_comment(line) for line in _code_blocks(text)]
    for line in lines:
        for match in COMMAND_RE.finditer(line):
            rest = line[match.end() :]
            following = COMMAND_RE.search(rest)
            segments.append((_command_key(match), rest[: following.start()] if following else rest))
    for row in rows:
        cells = row.split(" | ")
        match = COMMAND_RE.search(cells[0])
        if match is not None:
            segments.append((_command_key(match), " ".join(SPAN_RE.findall(row))))
    return segments


def _command_key(match: re.Match[str]) -> str:
    command, sub = match.group(1), match.group(2)
    return f"{command} {sub}" if command in ("log", "db") and sub else command


@pytest.mark.parametrize("doc", DOC_FILES, ids=_ids(DOC_FILES))
def test_cli_flags_named_exist(doc: Path) -> None:
    flags = _flags_by_command()
    unknown = []
    for command, segment in _command_segments(doc.read_text(encoding="utf-8")):
        own, _, forwarded = segment.partition(" -- ") if command == "gateway" else (segment, "", "")
        for flag in FLAG_RE.findall(own):
            if flag not in flags.get(command, set()):
                unknown.append(f"nanoserve {command} {flag}")
        for flag in FLAG_RE.findall(forwarded):
            if flag not in flags["serve"]:
                unknown.append(f"nanoserve gateway -- {flag} (a serve flag)")
    assert sorted(set(unknown)) == [], f"{doc.relative_to(ROOT)} names flags that do not exist: {sorted(set(unknown))}"


def test_flag_checker_sees_a_wrong_flag() -> None:
    """The checker itself: a made-up flag in a code span and in a code block are both found."""
    text = (
        "Run `nanoserve log audit --no-such-flag`.\n\n```bash\nnanoserve serve --port 1 --bogus  # --in-comment\n```\n"
    )
    segments = _command_segments(text)
    found = sorted(flag for command, segment in segments for flag in FLAG_RE.findall(segment))
    assert "log audit" in dict(segments)
    assert found == ["--bogus", "--no-such-flag", "--port"]
    serve_flags = _flags_by_command()["serve"]
    assert "--port" in serve_flags
    assert "--bogus" not in serve_flags


def test_configuration_table_is_generated_from_the_settings() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert config_docs.render(page) == page, (
        "docs/configuration.md's settings table is stale: run python -m nanoserve.service.cli.config_docs"
    )


def test_configuration_table_has_one_row_per_setting() -> None:
    table = config_docs.settings_table()
    assert table.count("\n") == 2 + len(config_docs.SETTINGS)
    assert "| `--dtype` | `NANOSERVE_DTYPE` | `auto` |" in table
    assert "| `--journal` / `--no-journal` | `NANOSERVE_JOURNAL` | on |" in table


def test_render_refuses_a_page_without_markers() -> None:
    with pytest.raises(config_docs.MarkersMissing):
        config_docs.render("# Configuration\n\nno table here\n")
