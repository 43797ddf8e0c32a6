"""Structured-output fixtures: the real model's tokenizer (a fraction of a second to load) and a compiler on it."""

from __future__ import annotations

import pytest

from nanoserve.engine.structured.grammar_compiler import GrammarCompiler


@pytest.fixture(scope="session")
def real_tokenizer():
    from nanoserve.engine.model.weights import default_model_path
    from nanoserve.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_path(default_model_path())


@pytest.fixture
def compiler(real_tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(real_tokenizer, real_tokenizer.vocab_size, compile_timeout_s=10.0, max_cached=4)
    yield compiler
    compiler.close()
