"""Real faults for the event log's tests and the soak bench: a small tmpfs that fills up or turns
read-only, a throwaway PostgreSQL cluster that is stopped and started, and a damaged SQLite file.

``Tmpfs`` mounts a tmpfs of a few MiB (root and ``mount`` needed; ``Tmpfs.available()`` says
whether this machine allows it): ``fill()`` takes every free byte with a filler file,
``free()`` gives it back, ``read_only()`` remounts it read-only. ``PgCluster`` runs ``initdb``
and ``pg_ctl`` (as the ``postgres`` user when run as root) in a temporary folder, on a free port
of its own, with fsync off; ``stop()`` / ``start()`` take it away and bring it back. Both clean
up in ``close()`` (and as context managers), whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

PG_BIN_DIRS = ("/usr/lib/postgresql/15/bin", "/usr/local/bin", "/usr/bin")


class Tmpfs:
    """A tmpfs of ``size_bytes`` mounted on a fresh folder."""

    def __init__(self, size_bytes: int = 4 << 20) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="nanoserve-tmpfs-"))
        self._filler = self.path / "filler"
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(self.path)],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError):
            self.path.rmdir()
            raise

    @staticmethod
    def available() -> bool:
        """Whether this process may mount a tmpfs (root, and a kernel and container that allow it)."""
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        try:
            Tmpfs(64 << 10).close()
        except (OSError, subprocess.CalledProcessError):
            return False
        return True

    def fill(self) -> int:
        """Take every free byte (a filler file written until ENOSPC); returns the bytes taken."""
        written = 0
        block = b"\0" * 4096
        with open(self._filler, "ab", buffering=0) as filler:
            while True:
                try:
                    count = filler.write(block)
                except OSError:
                    break
                written += count or 0
                if not count or count < len(block):
                    break
        return written

    def free(self) -> None:
        """Give back what ``fill`` took."""
        self._filler.unlink(missing_ok=True)

    def read_only(self, read_only: bool = True) -> None:
        """Remount read-only (or read-write again)."""
        mode = "remount,ro" if read_only else "remount,rw"
        subprocess.run(["mount", "-o", mode, str(self.path)], check=True, capture_output=True)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def __enter__(self) -> Tmpfs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pg_bin(name: str) -> str | None:
    for folder in PG_BIN_DIRS:
        candidate = Path(folder) / name
        if candidate.is_file():
            return str(candidate)
    return shutil.which(name)


class PgCluster:
    """A throwaway PostgreSQL cluster on 127.0.0.1:``port``, trust auth, user ``postgres``."""

    def __init__(self) -> None:
        initdb, self._pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if initdb is None or self._pg_ctl is None:
            raise FileNotFoundError("initdb and pg_ctl are needed for a throwaway PostgreSQL cluster")
        self.root = Path(tempfile.mkdtemp(prefix="nanoserve-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0  # initdb refuses to run as root
        self.running = False
        if self._as_postgres:
            shutil.chown(self.root, "postgres")
        try:
            self._run([initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            self.start()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def available() -> bool:
        if _pg_bin("initdb") is None or _pg_bin("pg_ctl") is None:
            return False
        if os.geteuid() != 0:
            return True
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return False
        return shutil.which("runuser") is not None

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run([self._pg_ctl, "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start"])
        self.running = True

    def start_if_stopped(self) -> None:
        if not self.running:
            self.start()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` ends connections cleanly, ``immediate`` as a crash would."""
        self._run([self._pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"])
        self.running = False

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.1)
        raise TimeoutError(f"PostgreSQL on port {self.port} did not come up in {timeout_s} s")

    def _run(self, command: list[str]) -> None:
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)

    def close(self) -> None:
        if self.running:
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def damage_page(database: Path, marker: bytes) -> int:
    """Overwrite the b-tree header of the SQLite page that holds ``marker``; returns the page number.

    The file must be checkpointed (every connection closed). Reading a row of that page then
    fails with ``database disk image is malformed``.
    """
    content = database.read_bytes()
    page_size = int.from_bytes(content[16:18], "big")
    offset = content.index(marker)
    page = offset // page_size
    assert page > 0, "the marker is on the file's first page, which holds the schema"
    with open(database, "r+b") as file:
        file.seek(page * page_size)
        file.write(b"\xff" * 12)
    return page + 1
