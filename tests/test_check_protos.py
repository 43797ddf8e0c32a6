"""scripts/check_protos.sh: buf lint, and buf breaking against the previous commit unless a
``Proto-Breaking:`` trailer declares the break.

Each test builds a small git repository holding the script and a copy of the contract, so
the commits (compatible, breaking, declared, shallow) are the test's own. buf is the one
``npm ci`` installs (scripts/check_protos.sh does, and CI runs it before the tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / "node_modules" / ".bin" / "buf"
GENERATION_PROTO = "protos/nanoserve/v1/generation.proto"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

pytestmark = pytest.mark.skipif(
    not BUF.exists() or shutil.which("git") is None, reason="needs buf (`npm ci`, or bash scripts/check_protos.sh)"
)


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, check=True, capture_output=True, text=True
    )
    return result.stdout


def _check(repo: Path) -> tuple[int, str]:
    result = subprocess.run(
        ["bash", "scripts/check_protos.sh"],
        cwd=repo,
        env={**os.environ, **GIT_ENV, "BUF": str(BUF)},
        capture_output=True,
        text=True,
    )
    return result.returncode, result.stdout + result.stderr


def _edit(repo: Path, old: str, new: str) -> None:
    path = repo / GENERATION_PROTO
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _commit(repo: Path, *message: str) -> None:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", *(part for line in message for part in ("-m", line)))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose first commit holds the script and this checkout's contract."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "check_protos.sh", repo / "scripts")
    shutil.copytree(ROOT / "protos", repo / "protos", ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, "contract")
    return repo


def test_root_commit_is_linted_and_has_nothing_to_break(repo: Path) -> None:
    code, output = _check(repo)
    assert code == 0, output
    assert "HEAD is a root commit; no previous contract to break" in output


def test_added_field_passes(repo: Path) -> None:
    _edit(repo, "  int32 completion_tokens = 2;\n", "  int32 completion_tokens = 2;\n  int32 reasoning_tokens = 99;\n")
    _commit(repo, "usage: reasoning_tokens")
    assert _check(repo)[0] == 0


def test_undeclared_break_fails_naming_the_change(repo: Path) -> None:
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field")
    code, output = _check(repo)
    assert code == 1
    assert 'Field "2" on message "Usage" changed name from "completion_tokens" to "generated_tokens"' in output
    assert "Proto-Breaking: <what breaks, and what clients must change>" in output


def test_break_declared_by_a_trailer_passes(repo: Path) -> None:
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field", "Proto-Breaking: Usage.completion_tokens is now generated_tokens")
    code, output = _check(repo)
    assert code == 0, output
    assert "accepted, declared by Proto-Breaking:\n  Usage.completion_tokens is now generated_tokens" in output


def test_trailer_of_an_earlier_commit_does_not_cover_a_later_break(repo: Path) -> None:
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field", "Proto-Breaking: Usage.completion_tokens is now generated_tokens")
    _edit(repo, "int32 prompt_tokens = 1;", "int64 prompt_tokens = 1;")
    _commit(repo, "widen prompt_tokens")
    assert _check(repo)[0] == 1


def test_merge_passes_when_a_merged_commit_declares_the_break(repo: Path) -> None:
    _git(repo, "checkout", "-q", "-b", "rework")
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field", "Proto-Breaking: Usage.completion_tokens is now generated_tokens")
    _git(repo, "checkout", "-q", "main")
    (repo / "NOTES").write_text("unrelated\n")
    _commit(repo, "notes")
    _git(repo, "merge", "-q", "--no-ff", "-m", "Merge branch 'rework'", "rework")
    code, output = _check(repo)
    assert code == 0, output
    assert "Usage.completion_tokens is now generated_tokens" in output


def test_uncommitted_break_is_checked_against_head(repo: Path) -> None:
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field", "Proto-Breaking: Usage.completion_tokens is now generated_tokens")
    _edit(repo, "int32 prompt_tokens = 1;", "int64 prompt_tokens = 1;")  # not committed: HEAD's trailer is no cover
    code, output = _check(repo)
    assert code == 1
    assert "against HEAD " in output


def test_lint_finding_fails(repo: Path) -> None:
    _edit(repo, "service GenerationService {", "service Generation {")
    _commit(repo, "drop the suffix", "Proto-Breaking: renamed")
    code, output = _check(repo)
    assert code == 1
    assert 'Service name "Generation" should be suffixed with "Service".' in output


def test_shallow_clone_fetches_the_previous_commit(repo: Path, tmp_path: Path) -> None:
    _edit(repo, "int32 completion_tokens = 2;", "int32 generated_tokens = 2;")
    _commit(repo, "rename a field")
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", str(clone))
    code, output = _check(clone)
    assert code == 1  # the undeclared break is found, not skipped
    assert "shallow clone without HEAD~1; fetching one more commit" in output
    assert 'changed name from "completion_tokens" to "generated_tokens"' in output
