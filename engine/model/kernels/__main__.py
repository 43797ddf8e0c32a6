"""``python -m nanoserve.engine.model.kernels``: build (or find) the CPU kernels now; exit 1 when unavailable."""

from __future__ import annotations

import sys

from nanoserve.engine.model import kernels

if kernels.load():
    print(f"nanoserve kernels: {kernels.library_path()}")
else:
    print(f"nanoserve kernels unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
    sys.exit(1)
