"""SavedTokenizer: a GGUF's converted tokenizer read back without transformers answers as transformers does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nanoserve.engine.text.saved_tokenizer import SavedTokenizer, load_saved_tokenizer
from nanoserve.engine.text.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "  runs   of  spaces\n\n\ttabs\r\n",
    "Le café coûte 3 € à Zürich ; 東京は日本の首都です。",
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens written in the text
    "emoji 🤖🎉 then <|endoftext|>x<|endoftext|>",
    "def f(x):\n    return x**2  # 1e-3",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "東京? <|im_end|>"},
    ],
]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory, real_hf_tokenizer):
    """transformers' conversion of the default GGUF's tokenizer, saved as nanoserve's cache saves it."""
    folder = tmp_path_factory.mktemp("saved-tokenizer")
    real_hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(saved_folder) -> SavedTokenizer:
    tok = load_saved_tokenizer(saved_folder)
    assert tok is not None
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_and_tokens_equal_transformers(saved, real_hf_tokenizer, text):
    for add_special_tokens in (False, True):
        ids = saved.encode(text, add_special_tokens=add_special_tokens)
        assert ids == real_hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert saved.convert_ids_to_tokens(ids) == real_hf_tokenizer.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert saved.decode(ids, skip_special_tokens=skip) == real_hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_ids_equal_transformers(saved, real_hf_tokenizer, messages, add_generation_prompt):
    ours = saved.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    theirs = real_hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours == list(theirs)


def test_vocabulary_and_special_tokens_equal_transformers(saved, real_hf_tokenizer):
    assert len(saved) == len(real_hf_tokenizer) == 49152
    assert saved.get_vocab() == real_hf_tokenizer.get_vocab()
    assert {i: (t.content, t.special) for i, t in saved.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in real_hf_tokenizer.added_tokens_decoder.items()
    }
    assert (saved.bos_token_id, saved.eos_token_id) == (real_hf_tokenizer.bos_token_id, real_hf_tokenizer.eos_token_id)
    assert (saved.bos_token_id, saved.eos_token_id) == (1, 2)
    assert saved.chat_template == real_hf_tokenizer.chat_template


def test_the_engine_tokenizer_over_it_equals_the_one_over_transformers(saved, real_hf_tokenizer):
    ours, theirs = Tokenizer(saved, {2}, "smollm2"), Tokenizer(real_hf_tokenizer, {2}, "smollm2")
    assert ours.max_token_bytes == theirs.max_token_bytes
    assert (ours.vocab_size, ours.bos_token_id, ours.has_chat_template) == (
        theirs.vocab_size,
        theirs.bos_token_id,
        theirs.has_chat_template,
    )
    assert ours.export_files() == theirs.export_files()


def test_reading_and_encoding_import_no_transformers_until_a_chat(saved_folder):
    script = (
        "import sys; from pathlib import Path; from nanoserve.engine.text.saved_tokenizer import load_saved_tokenizer; "
        f"tok = load_saved_tokenizer(Path({str(saved_folder)!r})); "
        "tok.decode(tok.encode('Hi')); "
        "print('transformers' in sys.modules); "
        "tok.prepare_chat_template(); "
        "print('transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    "change",
    [
        {"clean_up_tokenization_spaces": True},  # transformers would clean the decoded text
        {"add_bos_token": True},  # transformers would rebuild the post-processor
        {"tokenizer_class": "LlamaTokenizer"},  # a class of its own
        {"bos_token": {"content": "<|im_start|>", "lstrip": True}},  # an AddedToken with flags
        {"bos_token": "<not-a-special-token>"},  # transformers would add it to the vocabulary
    ],
)
def test_a_config_it_does_not_know_is_left_to_transformers(saved_folder, tmp_path, change):
    for path in saved_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((saved_folder / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert load_saved_tokenizer(tmp_path) is None


def test_a_damaged_tokenizer_json_is_a_value_error(saved_folder, tmp_path):
    for path in saved_folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_saved_tokenizer(tmp_path)
