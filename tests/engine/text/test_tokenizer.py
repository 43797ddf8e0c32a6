"""Tokenizer: SmolLM2's vocabulary and chat template, loaded offline from a model folder."""

from __future__ import annotations

import json

import pytest

from nanoserve.engine.text.saved_tokenizer import SavedTokenizer
from nanoserve.engine.text.tokenizer import Tokenizer

# transformers' rendering of SmolLM2's template for this conversation (default system prompt).
CAPITAL_OF_FRANCE_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_path(tiny_model_dir)


def test_chat_template_renders_smollm2_ids(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert ids == CAPITAL_OF_FRANCE_IDS


def test_chat_template_without_generation_prompt_ends_at_im_end(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == ["<|im_end|>", "Ċ"]


def test_chat_message_without_content_is_rejected(tokenizer):
    with pytest.raises(ValueError, match=r"messages\[1\] must have 'role' and 'content'"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant"}])


def test_non_ascii_text_round_trips(tokenizer):
    text = "Le café coûte 3 € à Zürich ; 東京は日本の首都です。"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_encode_adds_no_bos_by_default(tokenizer):
    assert tokenizer.encode("Hello world") == [19556, 905]


def test_decode_skips_special_tokens_on_request(tokenizer):
    assert tokenizer.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"
    assert tokenizer.decode([1, 19556, 2]) == "<|im_start|>Hello<|im_end|>"


def test_eos_ids_come_from_generation_config_and_tokenizer(tokenizer):
    assert tokenizer.eos_token_ids == {0, 2}


def test_vocab_size_and_name(tokenizer, tiny_model_dir):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.has_chat_template
    assert tokenizer.name == tiny_model_dir.name


@pytest.mark.real_model
def test_gguf_tokenizer_stops_at_im_end(real_runner):
    assert real_runner.tokenizer.eos_token_ids == {2}
    assert real_runner.tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_bos_token_id_is_the_tokenizers(tokenizer):
    assert tokenizer.bos_token_id == 1


def _write(files: dict[str, bytes], folder):
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def test_exported_files_rebuild_the_same_tokenizer(tokenizer, tmp_path):
    files = tokenizer.export_files()
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(files)
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [0, 2], "bos_token_id": 1}
    rebuilt = Tokenizer.from_path(_write(files, tmp_path))
    text = "Le café coûte 3 € à Zürich ; 東京は日本の首都です。"
    assert rebuilt.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert rebuilt.apply_chat_template(messages) == CAPITAL_OF_FRANCE_IDS
    assert rebuilt.eos_token_ids == tokenizer.eos_token_ids


@pytest.mark.real_model
def test_a_gguf_tokenizer_exports_its_chat_template(real_runner, tmp_path):
    """The GGUF carries the template in its metadata; the exported files carry it on."""
    files = real_runner.tokenizer.export_files()
    template = files.get("chat_template.jinja", b"") + files["tokenizer_config.json"]
    assert b"<|im_start|>" in template
    rebuilt = Tokenizer.from_path(_write(files, tmp_path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert rebuilt.apply_chat_template(messages) == real_runner.tokenizer.apply_chat_template(messages)
    assert rebuilt.eos_token_ids == {2}


@pytest.mark.real_model
def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from nanoserve.engine.model.weights import default_model_path
    from nanoserve.engine.text.tokenizer import tokenizer_cache_dir

    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    converted = Tokenizer.from_path(path, {2})
    entries = list(tokenizer_cache_dir().iterdir())
    assert len(entries) == 1
    assert (entries[0] / "tokenizer.json").is_file()
    cached = Tokenizer.from_path(path, {2})
    assert list(tokenizer_cache_dir().iterdir()) == entries
    assert cached.apply_chat_template(chat) == converted.apply_chat_template(chat)
    assert cached.encode("Le café coûte 3 € ; 東京") == converted.encode("Le café coûte 3 € ; 東京")
    assert cached.vocab_size == converted.vocab_size == 49152
    assert isinstance(cached._tok, SavedTokenizer)  # read back without transformers
    assert cached.decode(converted.encode("<|im_start|>hi")) == "<|im_start|>hi"
    assert cached.eos_token_ids == converted.eos_token_ids
