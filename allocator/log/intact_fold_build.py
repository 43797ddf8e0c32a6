"""The audit's C fold (intact_fold.c), compiled once on this machine and cached.

The source is compiled as a CPython extension by the system's C compiler
(sysconfig's ``CC``, else ``cc``), linked with zlib and OpenSSL's libcrypto,
into ``<cache>/intact_fold/<key>/nanoserve_intact_fold.so``, key = a hash of
the source, the flags, the Python version and the machine; ``<cache>`` is
``$NANOSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/nanoserve``, else
``~/.cache/nanoserve`` (the engine's ``file_cache.cache_dir`` rule; the
allocator imports nothing from the engine). ``scripts/install.sh`` builds it
ahead (``python -m nanoserve.allocator.log.intact_fold_build``, about 2 s);
the first full audit builds it where that did not happen. Where it cannot be
built (no compiler, no zlib or OpenSSL headers) ``load()`` returns None, says
why in ``unavailable_reason()``, and the audit runs the Python replay alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["MODULE_NAME", "build", "library_path", "load", "unavailable_reason"]

SOURCE = Path(__file__).with_name("intact_fold.c")
MODULE_NAME = "nanoserve_intact_fold"
CFLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-Wno-deprecated-declarations"]  # OpenSSL 3 deprecates SHA256_*
LIBRARIES = ["-lz", "-lcrypto"]
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_state: dict[str, ModuleType | str | None] = {}  # "module": the loaded module or None, "reason": why not


def _cache_root() -> Path:
    root = os.environ.get("NANOSERVE_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nanoserve")
    return Path(root)


def _compiler() -> list[str]:
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def build_key() -> str:
    """A hash of what the built module depends on: the source, the compiler and flags, Python, the machine."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join([*_compiler(), *CFLAGS, *LIBRARIES, sys.version, platform.machine()]).encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where the built module for this build key lives."""
    return _cache_root() / "intact_fold" / build_key() / f"{MODULE_NAME}.so"


def build(target: Path) -> None:
    """Compile SOURCE into ``target`` (written whole or not at all). Builders of one folder take turns on an
    flock. Raises RuntimeError with the compiler's last line when it fails, OSError when it cannot run."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / "build.flock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if target.exists():  # built by the process we waited for
            return
        fd, staging = tempfile.mkstemp(prefix=".staging-", suffix=".so", dir=target.parent)
        os.close(fd)
        include = sysconfig.get_paths()["include"]
        command = [*_compiler(), *CFLAGS, f"-I{include}", str(SOURCE), "-o", staging, *LIBRARIES]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines()
                errors = [line for line in lines if "error" in line] or lines or [f"exit {done.returncode}"]
                raise RuntimeError(f"{command[0]} failed: {errors[0].strip()}")
            os.replace(staging, target)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    assert spec is not None, f"an extension spec for {path}"
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(*, build_missing: bool = True) -> ModuleType | None:
    """The compiled fold, built first when this machine has none cached (``build_missing``); None, with
    the reason in ``unavailable_reason()``, when it cannot be built or loaded (never raises).
    ``NANOSERVE_AUDIT_FOLD=python`` turns it off (the audit then runs the Python replay alone)."""
    if "module" in _state:
        module = _state["module"]
        return module if isinstance(module, ModuleType) else None
    with _lock:
        if "module" not in _state:
            module, reason = None, ""
            if os.environ.get("NANOSERVE_AUDIT_FOLD", "").lower() == "python":
                reason = "NANOSERVE_AUDIT_FOLD=python"
            else:
                try:
                    target = library_path()
                    if not target.exists():
                        if not build_missing:
                            return None
                        build(target)
                    module = _import(target)
                except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:
                    reason = f"{type(exc).__name__}: {exc}"
            _state["module"], _state["reason"] = module, reason
    module = _state["module"]
    return module if isinstance(module, ModuleType) else None


def unavailable_reason() -> str:
    """Why ``load()`` returned None ('' when it did not, or was not called)."""
    reason = _state.get("reason")
    return reason if isinstance(reason, str) else ""


def main() -> int:
    """Build (or find) the fold and say where it is, or why it cannot be built (exit 1)."""
    module = load()
    if module is None:
        print(f"intact_fold: not loaded ({unavailable_reason()}); `log audit` runs the Python replay alone")
        return 1
    print(f"intact_fold: {library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
