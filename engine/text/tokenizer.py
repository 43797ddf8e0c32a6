"""Text <-> token ids, and chat prompts -> token ids, loaded offline from the model's own files.

A GGUF file carries its vocabulary, merges and chat template in metadata; transformers
rebuilds a fast tokenizer from them (``gguf_file=``). A Hugging Face folder carries
tokenizer.json / tokenizer_config.json. Nothing is ever fetched from a hub: every load passes
``local_files_only=True`` (the process's HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are left as they are).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from nanoserve.engine.model.file_cache import cache_dir
from nanoserve.engine.text.saved_tokenizer import GENERIC_FAST_TOKENIZERS, load_saved_tokenizer
from nanoserve.engine.text.transformers_import import transformers_exclusive, transformers_name


class Tokenizer:
    """A fast tokenizer plus what generation needs from the model's metadata.

    eos_token_ids: every id that ends generation (the tokenizer's EOS, GGUF's EOT/EOM,
    and a Hugging Face generation_config.json's ``eos_token_id``).
    """

    def __init__(self, hf_tokenizer: Any, eos_token_ids: set[int], name: str) -> None:
        self._tok = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.name = name
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_path(cls, path: Path, eos_token_ids: set[int] | None = None, hf_tokenizer: Any | None = None) -> Tokenizer:
        """Load from a ``.gguf`` file or a Hugging Face folder, offline.

        eos_token_ids: the stop ids when the caller already read them (parsing a
        GGUF's metadata again costs seconds); otherwise read from the files.
        hf_tokenizer: ``load_hf_tokenizer(path)`` when the caller loaded it already
        (the model runner does so on a thread while the weights load).

        Raises FileNotFoundError / OSError when the files hold no tokenizer.
        """
        path = Path(path)
        tok = hf_tokenizer if hf_tokenizer is not None else load_hf_tokenizer(path)
        if path.suffix == ".gguf":
            eos = set(eos_token_ids) if eos_token_ids is not None else _gguf_eos_ids(path)
            name = path.name.removesuffix(".gguf")
        else:
            eos = set(eos_token_ids) if eos_token_ids is not None else _generation_config_eos_ids(path)
            name = path.name
        if tok.eos_token_id is not None:
            eos.add(int(tok.eos_token_id))
        return cls(tok, eos, name)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of input text one token stands for, added tokens included.

        A byte-level BPE entry spells each byte of text with one character, so
        its length in characters is the bytes it covers. For other tokenizers
        the UTF-8 length of an entry bounds it (SentencePiece spells a space as
        the 3-byte "▁", byte fallback one byte as "<0xNN>"). A normalizer may
        shrink text before it is split (NFKC composes characters), so with one
        the bound is taken four times over.
        """
        backend = self._tok.backend_tokenizer
        added = {token.content for token in self._tok.added_tokens_decoder.values()}
        byte_level = type(backend.decoder).__name__ == "ByteLevel"
        longest = 1
        for token in self._tok.get_vocab():
            if token in added:
                num_bytes = len(token.encode("utf-8", "surrogatepass"))
            else:
                num_bytes = len(token) if byte_level else len(token.encode("utf-8", "surrogatepass"))
            longest = max(longest, num_bytes)
        return longest if backend.normalizer is None else 4 * longest

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each token id stands for: ``vocab_size`` entries, id order (grammar masks read it).

        A byte-level BPE entry spells each byte with one printable character
        (GPT-2's byte-to-unicode table, ``byte_level_alphabet``); SentencePiece
        spells a space as "▁" and a byte-fallback token as "<0xNN>". Added
        (special) tokens stand for their UTF-8 text. An id the vocabulary skips
        is b"".
        """
        backend = self._tok.backend_tokenizer
        byte_level = type(backend.decoder).__name__ == "ByteLevel"
        added = {token.content for token in self._tok.added_tokens_decoder.values()}
        to_byte = {char: byte for byte, char in byte_level_alphabet().items()}
        result = [b""] * self.vocab_size
        for token, token_id in self._tok.get_vocab().items():
            if not 0 <= token_id < self.vocab_size:
                continue
            if token in added:
                result[token_id] = token.encode("utf-8")
            elif byte_level:
                result[token_id] = bytes(to_byte[char] for char in token if char in to_byte)
            elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                result[token_id] = bytes([int(token[3:5], 16)])
            else:
                result[token_id] = token.replace("\u2581", " ").encode("utf-8")
        return result

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of the added tokens marked special (grammars never emit them as text)."""
        return sorted(i for i, token in self._tok.added_tokens_decoder.items() if getattr(token, "special", False))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def bos_token_id(self) -> int | None:
        """The id of the tokenizer's BOS token; None where it defines none."""
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    def export_files(self) -> dict[str, bytes]:
        """The files another program needs to rebuild this tokenizer, file name -> content.

        Whatever the model came as (a GGUF's metadata or a Hugging Face folder), the
        loaded tokenizer is written out in the Hugging Face layout by transformers'
        ``save_pretrained``: ``tokenizer.json`` (vocabulary, merges, added tokens),
        ``tokenizer_config.json`` (special tokens) and the chat template (in
        ``chat_template.jinja`` or inside ``tokenizer_config.json``, as the installed
        transformers writes it); plus ``generation_config.json`` whose
        ``eos_token_id`` lists ``eos_token_ids``, so a client stops where the engine
        does. Takes tens of milliseconds (the vocabulary is serialized): call it off
        the event loop. Raises OSError when the temporary folder cannot be written.
        """
        with tempfile.TemporaryDirectory(prefix="nanoserve-tokenizer-") as folder:
            with transformers_exclusive():  # transformers' tokenizer (or SavedTokenizer's) imports lazily
                self._tok.save_pretrained(folder)
            files = {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}
        generation_config: dict[str, object] = {"eos_token_id": sorted(self.eos_token_ids)}
        if self.bos_token_id is not None:
            generation_config["bos_token_id"] = self.bos_token_id
        files["generation_config.json"] = json.dumps(generation_config, indent=2).encode()
        return files

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids; ``add_special_tokens`` adds BOS where the tokenizer defines one."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(token_ids))

    def prepare_chat_template(self) -> None:
        """Gets the chat template renderer ready ahead of the first chat (a no-op where it is ready at load)."""
        prepare = getattr(self._tok, "prepare_chat_template", None)
        if prepare is not None:
            prepare()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``[{"role": ..., "content": ...}]`` with the model's template -> token ids.

        Raises ValueError when the model has no chat template or a message lacks
        ``role`` / ``content``.
        """
        if not self.has_chat_template:
            raise ValueError(f"messages: model {self.name!r} has no chat template; send a plain prompt")
        for i, message in enumerate(messages):
            if "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must have 'role' and 'content', got keys {sorted(message)}")
        ids = self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]


def load_hf_tokenizer(path: Path) -> Any:
    """The fast tokenizer of a ``.gguf`` file (through the cache: a ``SavedTokenizer`` once converted) or of a
    Hugging Face folder (transformers'), offline."""
    if path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    with transformers_exclusive():
        auto = transformers_name("transformers", "AutoTokenizer")
        return auto.from_pretrained(str(path), local_files_only=True)


def tokenizer_cache_dir() -> Path:
    """Where tokenizers converted from GGUF metadata are kept: ``cache_dir("tokenizers")``."""
    return cache_dir("tokenizers")


def _gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer rebuilt from a GGUF's metadata, through a cache.

    transformers reads the GGUF metadata again and converts its vocabulary and
    merges, seconds of start-up on every start. The converted tokenizer is saved
    (``save_pretrained``) under ``tokenizer_cache_dir()`` in a folder named by the
    file's path, size, modification time and the transformers version, and read
    from there next time (a fraction of a second). A cache that cannot be written
    is skipped.
    """
    stat = path.resolve().stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{importlib.metadata.version('transformers')}"
    folder = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if (folder / "tokenizer.json").is_file():
        try:
            return _cached_tokenizer(folder)
        except (OSError, ValueError):
            shutil.rmtree(folder, ignore_errors=True)  # a damaged entry: convert again below
    with transformers_exclusive():
        auto = transformers_name("transformers", "AutoTokenizer")
        tok = auto.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
        with transformers_exclusive():
            tok.save_pretrained(str(staging))
        try:
            staging.rename(folder)  # atomic: a reader sees the whole folder or none
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        pass
    return tok


def _cached_tokenizer(folder: Path) -> Any:
    """A tokenizer saved in the cache, by the class it was saved as.

    The generic fast tokenizer (what a GGUF converts to) is read without transformers
    (``SavedTokenizer``: ``tokenizers`` and jinja2; transformers' import alone takes over a
    second of CPU), or, when its config sets what that does not know, by transformers' own
    class: ``AutoTokenizer`` would first import transformers' registry of every model
    (~0.4 s of start-up) only to pick that class. Other classes go through it.
    Raises OSError / ValueError for a damaged entry.
    """
    saved = load_saved_tokenizer(folder)
    if saved is not None:
        return saved
    saved_as = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    name = "PreTrainedTokenizerFast" if saved_as in GENERIC_FAST_TOKENIZERS else "AutoTokenizer"
    with transformers_exclusive():
        return transformers_name("transformers", name).from_pretrained(str(folder), local_files_only=True)


def _gguf_eos_ids(path: Path) -> set[int]:
    from nanoserve.engine.model.gguf_header import gguf_header

    return gguf_header(path).eos_token_ids


def _generation_config_eos_ids(folder: Path) -> set[int]:
    config = folder / "generation_config.json"
    if not config.is_file():
        return set()
    eos = json.loads(config.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}


@functools.cache
def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's byte -> character table (Radford et al. 2019, GPT-2).

    Printable Latin-1 bytes ("!".."~", "¡".."¬", "®".."ÿ") stand for
    themselves; every other byte, in increasing order, takes the next code
    point from 256 up, so that no byte is spelled by whitespace or a control.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    next_code = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_code)
            next_code += 1
    return table
