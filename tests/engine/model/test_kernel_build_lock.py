"""A kernel build killed midway leaves torch's ``lock`` file; the next build removes it instead of waiting forever.

torch.utils.cpp_extension guards a build folder with a ``lock`` file that only its
own process removes; SIGKILL during the compile leaves it, and every later ``load``
sleeps on it. Our builders take turns on an flock the kernel releases with a dead
holder, so holding it proves the file stale. The compiler is replaced by a fake
``load`` here: these tests are about the guard, not the build.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.utils.cpp_extension

from nanoserve.engine.model import kernels


@pytest.fixture
def fake_compiler(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replaces cpp_extension.load with one that records its call, fails if torch's lock file is there (the real
    one would wait forever), and writes the library; loading a library is skipped."""
    calls: list[dict[str, Any]] = []

    def load(**kwargs: Any) -> None:
        folder = Path(kwargs["build_directory"])
        assert not (folder / kernels.TORCH_BUILD_LOCK).exists(), "torch's load would wait on this lock forever"
        calls.append(kwargs)
        (folder / f"{kwargs['name']}.so").write_bytes(b"built")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append({"loaded": path}))
    return calls


def test_a_stale_torch_lock_left_by_a_killed_build_is_removed_and_the_build_runs(
    tmp_path: Path, fake_compiler: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "key" / f"{kernels.LIBRARY_NAME}.so"
    target.parent.mkdir()
    (target.parent / kernels.TORCH_BUILD_LOCK).write_text("")  # what a SIGKILLed build leaves
    kernels._build(target)
    assert [call["build_directory"] for call in fake_compiler] == [str(target.parent)]
    assert target.read_bytes() == b"built"
    assert not (target.parent / kernels.TORCH_BUILD_LOCK).exists()
    assert "kernels.stale_build_lock_removed" in capsys.readouterr().out


def test_a_library_built_while_we_waited_for_the_guard_is_loaded_not_rebuilt(
    tmp_path: Path, fake_compiler: list[dict[str, Any]]
) -> None:
    target = tmp_path / "key" / f"{kernels.LIBRARY_NAME}.so"
    target.parent.mkdir()
    target.write_bytes(b"another process built it")
    kernels._build(target)
    assert fake_compiler == [{"loaded": str(target)}]


def test_a_builder_sigkilled_midway_frees_the_guard_and_its_lock_is_removed(
    tmp_path: Path, fake_compiler: list[dict[str, Any]]
) -> None:
    target = tmp_path / "key" / f"{kernels.LIBRARY_NAME}.so"
    target.parent.mkdir()
    guard, lock = target.parent / kernels.BUILD_GUARD, target.parent / kernels.TORCH_BUILD_LOCK
    builder = subprocess.Popen(  # takes the guard, writes torch's lock as a build does, then "compiles"
        [
            sys.executable,
            "-c",
            f"import fcntl, pathlib, sys, time; f = open({str(guard)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            f"pathlib.Path({str(lock)!r}).write_text(''); print('building', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    assert builder.stdout is not None
    assert builder.stdout.readline() == b"building\n"
    with guard.open("a") as probe, pytest.raises(BlockingIOError):  # while it lives, the guard is taken
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    builder.kill()
    builder.wait(30)
    assert lock.exists()
    kernels._build(target)
    assert [call.get("build_directory") for call in fake_compiler] == [str(target.parent)]
    assert not lock.exists()
