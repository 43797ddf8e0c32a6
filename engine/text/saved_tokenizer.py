"""SavedTokenizer: a tokenizer saved by transformers, read back with ``tokenizers``; chats rendered by transformers.

A GGUF's tokenizer is converted by transformers once and saved
(``save_pretrained``) in nanoserve's cache as transformers' generic fast tokenizer:
``tokenizer.json`` (the ``tokenizers`` serialization, post-processor and added
tokens included), ``tokenizer_config.json`` (the named special tokens, the class)
and the chat template. transformers would read it back by wrapping
``tokenizers.Tokenizer.from_file`` after an import of over a second of CPU (and
parsing ``tokenizer.json`` a second time, in Python); this class wraps it directly,
with the methods ``nanoserve.engine.text.tokenizer.Tokenizer`` calls, answering as
transformers does (``tests/engine/text/test_saved_tokenizer.py`` compares the two).
Chat templates are rendered by transformers' own renderer (``render_jinja_template``,
the one its ``apply_chat_template`` uses), imported on first use or ahead of it by
``prepare_chat_template`` (the server calls it on a thread once it is SERVING), so the
second of its import is not spent before the server can take a request.

A folder whose ``tokenizer_config.json`` sets anything beyond ``KNOWN_CONFIG_KEYS``
(a flag that changes how transformers encodes or decodes) is not read here:
``load_saved_tokenizer`` returns None and the caller uses transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from nanoserve.engine.text.transformers_import import transformers_exclusive, transformers_name

# transformers' generic fast tokenizer (v5 name, v4 name)
GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), passed to the chat template as variables
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys that change nothing transformers does to encode, decode or render a chat
KNOWN_CONFIG_KEYS = frozenset(
    {
        *SPECIAL_TOKEN_NAMES,
        "backend",
        "tokenizer_class",
        "is_local",
        "local_files_only",
        "model_max_length",
        "chat_template",
        "clean_up_tokenization_spaces",  # only False is read here (see load_saved_tokenizer)
    }
)


class SavedTokenizer:
    """The subset of transformers' fast tokenizer API that ``Tokenizer`` uses, over ``tokenizers.Tokenizer``.

    backend_tokenizer: the ``tokenizers.Tokenizer`` (vocabulary, merges, added tokens).
    special_tokens: named special token -> text, from ``tokenizer_config.json``.
    """

    def __init__(self, folder: Path, backend: Any, special_tokens: dict[str, str], chat_template: str | None) -> None:
        self.folder = folder
        self.backend_tokenizer = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template

    def __len__(self) -> int:
        """Vocabulary size, added tokens included."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """Token id -> ``tokenizers.AddedToken`` (``.content``, ``.special``)."""
        return dict(self.backend_tokenizer.get_added_tokens_decoder())

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (a new dict per call, as tokenizers builds it)."""
        vocab: dict[str, int] = self.backend_tokenizer.get_vocab(with_added_tokens=True)
        return vocab

    @property
    def bos_token_id(self) -> int | None:
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_token_id("eos_token")

    def _special_token_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend_tokenizer.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        """Token id -> token text; None for an id outside the vocabulary."""
        return [self.backend_tokenizer.id_to_token(int(token_id)) for token_id in token_ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
    ) -> list[int]:
        """The rendered conversation's token ids, no special tokens added around it (transformers' defaults
        aside from ``tokenize=True, return_dict=False``, the only form served here). Raises ValueError
        without a chat template."""
        assert tokenize, "SavedTokenizer.apply_chat_template returns token ids only"
        assert not return_dict, "SavedTokenizer.apply_chat_template returns token ids only"
        if not self.chat_template:
            raise ValueError(f"tokenizer in {self.folder} has no chat template")
        rendered, _ = chat_template_renderer()(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return self.encode(rendered[0], add_special_tokens=False)

    def prepare_chat_template(self) -> None:
        """Imports the chat template renderer now (about a second), so the first chat does not wait for it."""
        if self.chat_template:
            chat_template_renderer()

    def save_pretrained(self, folder: str) -> None:
        """transformers' ``save_pretrained`` of this tokenizer (imports transformers: over a second, once)."""
        with transformers_exclusive():
            fast_tokenizer = transformers_name("transformers", "PreTrainedTokenizerFast")
            fast_tokenizer.from_pretrained(str(self.folder), local_files_only=True).save_pretrained(folder)


@functools.cache
def chat_template_renderer() -> Callable[..., Any]:
    """transformers' ``render_jinja_template`` -> (rendered texts, generation indices); imports transformers once
    (about a second of CPU). Its annotation says ``str``; it returns that pair."""
    renderer: Callable[..., Any] = transformers_name("transformers.utils.chat_template_utils", "render_jinja_template")
    return renderer


def load_saved_tokenizer(folder: Path) -> SavedTokenizer | None:
    """The tokenizer in ``folder`` when it is transformers' generic fast tokenizer with nothing beyond
    ``KNOWN_CONFIG_KEYS`` set; None otherwise (the caller loads it with transformers).

    Raises OSError / ValueError for missing or unreadable files (``json.JSONDecodeError``, or the
    ``tokenizers`` error for a damaged ``tokenizer.json``, re-raised as ValueError).
    """
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("tokenizer_class") not in GENERIC_FAST_TOKENIZERS or not set(config) <= KNOWN_CONFIG_KEYS:
        return None
    if config.get("clean_up_tokenization_spaces", False) is not False:
        return None
    special_tokens = {name: config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    if not all(isinstance(text, str) for text in special_tokens.values()):
        return None  # an AddedToken written as a dict: its flags are transformers' to apply
    template_file = folder / "chat_template.jinja"
    chat_template = (
        template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    )
    if chat_template is not None and not isinstance(chat_template, str):
        return None  # several named templates: transformers picks among them
    try:
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a plain Exception for a file it cannot parse
        raise ValueError(f"{folder / 'tokenizer.json'}: {exc}") from exc
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers applies them on encode
    added = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    if not set(special_tokens.values()) <= added:
        return None  # transformers would add (or mark) the named special tokens first
    return SavedTokenizer(folder, backend, special_tokens, chat_template)
