"""Fixtures shared by every test package.

``make_tiny_model_dir(model_type)`` writes a Hugging Face folder (config.json +
model.safetensors + the real SmolLM2 tokenizer + generation_config.json) holding a
2-layer Llama (or Qwen2 / Qwen3) with random weights and the real vocabulary size,
written by transformers itself so that loading it exercises our safetensors path.

PostgreSQL tests take ``pg_url``: a database of their own, created for the test
session on the server named by NANOSERVE_TEST_PG_URL (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``) and dropped after it, so
that concurrent test runs and the schema a run leaves behind (its Alembic
revision) never meet. Where the role may not create databases, the named
database itself is used. Where the server cannot be reached the tests skip,
unless NANOSERVE_REQUIRE_PG=1 (set by CI), where they fail.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    import sqlalchemy as sa

    url = os.environ.get("NANOSERVE_TEST_PG_URL", DEFAULT_PG_URL)
    try:
        admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text("select 1"))
    except Exception as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("NANOSERVE_REQUIRE_PG") == "1":
            pytest.fail(f"PostgreSQL at {url} is required but unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {url} unreachable: {exc}")
    name = f"nanoserve_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.SQLAlchemyError:  # pragma: no cover - a role without CREATEDB: share the named database
        admin.dispose()
        yield url
        return
    yield sa.engine.make_url(url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}


@pytest.fixture
def one_row_per_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log stores one row per event, as logs written before migration 0008 do (no packed rows):
    for tests that damage one event's row by its seq."""
    from nanoserve.allocator.log import packed_rows

    monkeypatch.setattr(packed_rows, "MIN_EVENTS_PER_PACKED_ROW", sys.maxsize)
    monkeypatch.setattr(packed_rows, "MIN_KEYED_EVENTS_PER_PACKED_ROW", sys.maxsize)


@pytest.fixture(scope="session")
def real_hf_tokenizer():
    """transformers' tokenizer rebuilt from the default GGUF (slow: build once)."""
    from transformers import AutoTokenizer

    from nanoserve.engine.model.weights import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="session")
def make_tiny_model_dir(tmp_path_factory, real_hf_tokenizer) -> Callable[..., Path]:
    """``make(model_type="llama", tie_word_embeddings=False, **overrides) -> folder``, cached per arguments."""
    import torch
    import transformers

    built: dict[tuple, Path] = {}
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }

    def make(model_type: str = "llama", tie_word_embeddings: bool = False, **overrides) -> Path:
        key = (model_type, tie_word_embeddings, json.dumps(overrides, sort_keys=True))
        if key in built:
            return built[key]
        config_class, model_class = classes[model_type]
        dims = {**TINY_DIMS, **overrides}
        config = config_class(
            vocab_size=len(real_hf_tokenizer),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            **dims,
        )
        torch.manual_seed(0)
        model = model_class(config).eval()
        with torch.no_grad():  # norms start at 1; perturb them so a dropped weight shows
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.copy_(
                        1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param)
                    )
        folder = tmp_path_factory.mktemp(f"tiny-{model_type}")
        model.save_pretrained(folder)
        real_hf_tokenizer.save_pretrained(folder)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
        built[key] = folder
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model_dir) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads, head_dim 16) with SmolLM2's tokenizer."""
    return make_tiny_model_dir("llama")


@pytest.fixture(scope="session")
def pg_cluster():
    """A throwaway PostgreSQL cluster of the session's own (tests/faults.py), for tests that stop and
    start it; each such test leaves it running. Skips where initdb/pg_ctl are missing, unless
    NANOSERVE_REQUIRE_PG=1."""
    from .faults import PgCluster

    if not PgCluster.available():
        if os.environ.get("NANOSERVE_REQUIRE_PG") == "1":
            pytest.fail(
                "a throwaway PostgreSQL cluster is required but initdb/pg_ctl (or the postgres user) are missing"
            )
        pytest.skip("needs initdb and pg_ctl (and the postgres user when run as root)")
    with PgCluster() as cluster:
        yield cluster
