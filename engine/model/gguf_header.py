"""The header of a GGUF file: its architecture, tensor table and EOS ids, parsed once and cached.

Spec: github.com/ggml-org/ggml/blob/master/docs/gguf.md. Parsing goes through ``gguf.GGUFReader``
(``gguf_reader``); the loader (``weights.py``) and the tokenizer's EOS ids read ``gguf_header``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.engine.model.file_cache import cache_dir, write_atomically
from nanoserve.engine.model.llama import LlamaConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def check_architecture(architecture: str, source: Path) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} of {source} is not one of {SUPPORTED_ARCHITECTURES}")


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_reader(path: Path) -> Any:
    """``gguf.GGUFReader`` over a copy-on-write map of the file (writable tensors, nothing copied until written).

    The reader slices its map once per metadata value; slices of an ``np.memmap``
    run a Python hook each (``__array_finalize__``), which made parsing the ~100k
    strings of a vocabulary take seconds. The reader here holds the same map as a
    plain ndarray view, whose slices are C-only: same fields and tensors, a third
    of the time.
    """
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)  # the view's base keeps the map alive

    return PlainArrayReader(path, "c")


@dataclass(frozen=True)
class GGUFTensorEntry:
    """Where one tensor lies in a GGUF file and what it is.

    type_id / type_name: ggml's type (``gguf.GGMLQuantizationType``: its value and name, so a load
    from the cached header needs no ``gguf`` import, a tenth of a second); shape: in torch's order
    (GGUF lists dims fastest-first); offset: of its first byte in the file;
    data_dtype / data_shape: the numpy array ``gguf`` reads its bytes as (blocks of
    a quantized type: uint8 [rows, row bytes]).
    """

    type_id: int
    type_name: str
    shape: tuple[int, ...]
    offset: int
    data_dtype: str
    data_shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFHeader:
    """What the loader needs of a GGUF's metadata: the architecture, the tensor table, the EOS ids."""

    config: LlamaConfig
    tensors: dict[str, GGUFTensorEntry]
    eos_token_ids: set[int]


HEADER_CACHE_VERSION = 2  # bump when GGUFHeader's fields change


def gguf_header(path: Path) -> GGUFHeader:
    """The header of a GGUF file, parsed by ``gguf.GGUFReader`` once and then kept in a cache.

    The reader walks every metadata value, the ~100k strings of a vocabulary
    included: about a second of every start for a model whose loader needs a few
    numbers and the tensor table. The header is kept as JSON under
    ``cache_dir("gguf")``, named by the file's path, size and modification time,
    the gguf version and ``HEADER_CACHE_VERSION``; a cache that cannot be written is
    skipped, and a damaged entry is parsed again.

    Raises ValueError for an architecture nanoserve does not run.
    """
    from importlib.metadata import version

    stat = path.resolve().stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('gguf')}|{HEADER_CACHE_VERSION}"
    entry = cache_dir("gguf") / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        header = _header_from_json(json.loads(entry.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        header = _parse_gguf_header(path)
        write_atomically(entry, json.dumps(_header_to_json(header)))
    check_architecture(header.config.architecture, path)
    return header


def _parse_gguf_header(path: Path) -> GGUFHeader:
    reader = gguf_reader(path)
    arch = _gguf_field(reader, "general.architecture")
    check_architecture(arch, path)
    tensors = {
        t.name: GGUFTensorEntry(
            type_id=int(t.tensor_type),
            type_name=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape)),
            offset=int(t.data_offset),
            data_dtype=t.data.dtype.str,
            data_shape=tuple(int(d) for d in t.data.shape),
        )
        for t in reader.tensors
    }
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    hidden_size = int(_gguf_field(reader, f"{arch}.embedding_length"))
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = _gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(_gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    config = LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_gguf_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(_gguf_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length")),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        architecture=arch,
    )
    eos_ids = {int(_gguf_field(reader, key)) for key in GGUF_EOS_KEYS if key in reader.fields}
    return GGUFHeader(config, tensors, eos_ids)


def _header_to_json(header: GGUFHeader) -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(header.config),
        "tensors": {name: dataclasses.asdict(entry) for name, entry in header.tensors.items()},
        "eos_token_ids": sorted(header.eos_token_ids),
    }


def _header_from_json(data: dict[str, Any]) -> GGUFHeader:
    tensors = {
        name: GGUFTensorEntry(**{**entry, "shape": tuple(entry["shape"]), "data_shape": tuple(entry["data_shape"])})
        for name, entry in data["tensors"].items()
    }
    return GGUFHeader(LlamaConfig(**data["config"]), tensors, {int(i) for i in data["eos_token_ids"]})
