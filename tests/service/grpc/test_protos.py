"""The committed generated code is exactly what scripts/gen_protos.sh makes from the protos."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GENERATED_DIR = ROOT / "protos" / "nanoserve" / "v1"


def _generated_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def test_committed_generated_code_matches_protos(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    fresh_dir = tmp_path / "nanoserve" / "v1"
    names = _generated_names(fresh_dir)
    assert names == [
        "allocation_pb2.py",
        "allocation_pb2.pyi",
        "allocation_pb2_grpc.py",
        "generation_pb2.py",
        "generation_pb2.pyi",
        "generation_pb2_grpc.py",
    ]
    assert _generated_names(GENERATED_DIR) == names
    stale = [name for name in names if (fresh_dir / name).read_bytes() != (GENERATED_DIR / name).read_bytes()]
    assert stale == [], f"regenerate with `bash scripts/gen_protos.sh`: {stale} differ from the protos"


def test_services_expose_the_contract_methods() -> None:
    from nanoserve.v1 import allocation_pb2, generation_pb2

    generation = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    allocation = allocation_pb2.DESCRIPTOR.services_by_name["AllocationService"]
    assert (generation.full_name, allocation.full_name) == (
        "nanoserve.v1.GenerationService",
        "nanoserve.v1.AllocationService",
    )
    assert [m.name for m in generation.methods] == ["Generate", "Abort", "Tokenize", "GetModelInfo", "Resume"]
    assert generation.methods_by_name["Generate"].server_streaming
    assert [m.name for m in allocation.methods] == ["GetPoolStatus", "WatchEvents", "Audit", "ResetPrefixCache"]
    assert allocation.methods_by_name["WatchEvents"].server_streaming


def test_every_method_takes_its_request_and_returns_its_response() -> None:
    from nanoserve.v1 import allocation_pb2, generation_pb2

    for file in (generation_pb2.DESCRIPTOR, allocation_pb2.DESCRIPTOR):
        for service in file.services_by_name.values():
            for method in service.methods:
                assert (method.input_type.name, method.output_type.name) == (
                    f"{method.name}Request",
                    f"{method.name}Response",
                )


def test_every_method_documents_its_status_codes() -> None:
    """Each rpc's comment in the .proto lists the status codes it returns (or points to the service's list)."""
    for name in ("generation.proto", "allocation.proto"):
        text = (GENERATED_DIR / name).read_text()
        rpcs = [line for line in text.splitlines() if line.strip().startswith("rpc ")]
        assert rpcs
        for rpc in rpcs:
            comment = text[: text.index(rpc)].rsplit("\n\n", 1)[-1].rsplit("{\n", 1)[-1].rsplit(";\n", 1)[-1]
            assert "Status codes" in comment, f"{name}: {rpc.strip()} has no status codes in its comment"
