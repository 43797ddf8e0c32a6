"""GGUF loading without the real model: the tiny Llama written as GGUF by ``gguf.GGUFWriter``.

The writer gets what llama.cpp's converter produces: Q/K rows permuted, tensor
names and metadata keys of the ``llama`` architecture, some tensors quantized.
Loaded back through our GGUF path, the model must give transformers' logits for
the same (dequantized) weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.engine.model.attention import TorchAttentionBackend
from nanoserve.engine.model.forward_batch import ForwardBatch, SeqSlice
from nanoserve.engine.model.kv_cache import KVCache, KVCacheSpec
from nanoserve.engine.model.llama import LlamaForCausalLM
from nanoserve.engine.model.weights import load_checkpoint

TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308]
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(path, hf_config, weights: dict[str, torch.Tensor], quantized: dict[str, object]) -> None:
    """Write ``weights`` (HF names) as a llama-architecture GGUF; names in ``quantized`` get that type."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(hf_config["num_hidden_layers"])
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(hf_config["num_attention_heads"])
    writer.add_head_count_kv(hf_config["num_key_value_heads"])
    writer.add_rope_freq_base(
        float(hf_config.get("rope_theta", hf_config.get("rope_parameters", {}).get("rope_theta")))
    )
    writer.add_layer_norm_rms_eps(hf_config["rms_norm_eps"])
    writer.add_vocab_size(hf_config["vocab_size"])
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, hf_config["num_attention_heads"])
            elif rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, hf_config["num_key_value_heads"])
            gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        qtype = quantized.get(name)
        if qtype is None:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits_of(checkpoint, tokens: list[int]) -> torch.Tensor:
    """Prefill logits at the last position through our model, float32."""
    model = LlamaForCausalLM(checkpoint.config, torch.float32, torch.device("cpu"))
    model.load_weights(checkpoint.weights)
    c = checkpoint.config
    cache = KVCache(KVCacheSpec(c.num_layers, 4, c.num_kv_heads, c.head_dim, torch.float32), 8, torch.device("cpu"))
    batch = ForwardBatch.build([SeqSlice(tokens, 0, list(range(4)))], 4)
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        return model(batch.input_ids, batch.positions, batch.logits_indices, cache, backend, backend.prepare(batch, 4))


@pytest.fixture(scope="module")
def tiny_weights(tiny_model_dir):
    import json

    from safetensors.torch import load_file

    return json.loads((tiny_model_dir / "config.json").read_text()), load_file(tiny_model_dir / "model.safetensors")


def test_gguf_f32_loads_exactly_like_the_hf_folder(tiny_model_dir, tiny_weights, tmp_path):
    config, weights = tiny_weights
    write_gguf(tmp_path / "tiny.gguf", config, weights, quantized={})
    from_gguf = load_checkpoint(tmp_path / "tiny.gguf")
    assert from_gguf.config.num_layers == 2
    assert from_gguf.config.num_kv_heads == 2
    assert not from_gguf.config.tie_word_embeddings  # output.weight present
    for name, tensor in weights.items():  # un-permuted back to the Hugging Face layout
        assert torch.equal(from_gguf.weights[name], tensor.float()), name
    torch.testing.assert_close(logits_of(from_gguf, TOKENS), logits_of(load_checkpoint(tiny_model_dir), TOKENS))


def test_gguf_quantized_tensors_are_dequantized(tiny_weights, tmp_path):
    import gguf

    config, weights = tiny_weights
    quantized = {
        "model.layers.0.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q8_0,
        "model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q4_1,
        "model.layers.1.self_attn.k_proj.weight": gguf.GGMLQuantizationType.Q4_0,
        "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.F16,
    }
    write_gguf(tmp_path / "quant.gguf", config, weights, quantized)
    loaded = load_checkpoint(tmp_path / "quant.gguf").weights
    # relative to each tensor's largest weight: Q4 keeps ~4 bits per weight, Q8 ~8, F16 ~11
    limits = {"Q8_0": 0.01, "Q4_1": 0.1, "Q4_0": 0.15, "F16": 1e-3}
    for name, qtype in quantized.items():
        assert loaded[name].shape == weights[name].shape, name
        relative_error = (loaded[name] - weights[name].float()).abs().max().item() / weights[name].abs().max().item()
        assert relative_error < limits[qtype.name], f"{name} ({qtype.name}): {relative_error:.4f}"
        if qtype.name != "F16":
            assert relative_error > 0, f"{name} was not quantized at all"


def test_a_checkpoint_names_the_block_types_it_keeps_quantized(tiny_weights, tmp_path):
    import gguf

    config, weights = tiny_weights
    quantized = {
        "model.layers.0.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q8_0,
        "model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q4_1,
        "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.F16,  # dequantized: not a block type
    }
    write_gguf(tmp_path / "quant.gguf", config, weights, quantized)
    assert load_checkpoint(tmp_path / "quant.gguf", "auto").quant_types == {"Q8_0", "Q4_1"}
    assert load_checkpoint(tmp_path / "quant.gguf", "none").quant_types == set()
    write_gguf(tmp_path / "f32.gguf", config, weights, {})
    assert load_checkpoint(tmp_path / "f32.gguf", "auto").quant_types == set()


def test_gguf_weights_are_read_on_lookup_into_memory_of_their_own(tiny_weights, tmp_path):
    import gguf

    from nanoserve.engine.model.layers.quantized_linear import QuantizedWeight

    config, weights = tiny_weights
    name = "model.layers.0.mlp.up_proj.weight"
    write_gguf(tmp_path / "quant.gguf", config, weights, {name: gguf.GGMLQuantizationType.Q4_1})
    loaded = load_checkpoint(tmp_path / "quant.gguf", "auto").weights
    assert sorted(loaded) == sorted(weights)
    assert len(loaded) == len(weights)
    assert name in loaded
    assert "model.layers.9.mlp.up_proj.weight" not in loaded
    first, second = loaded[name], loaded[name]
    assert isinstance(first, QuantizedWeight)
    assert isinstance(second, QuantizedWeight)
    assert torch.equal(first.blocks, second.blocks)
    assert first.blocks.data_ptr() != second.blocks.data_ptr()  # each lookup reads: nobody keeps it
    in_file = next(t for t in gguf.GGUFReader(tmp_path / "quant.gguf").tensors if t.name == "blk.0.ffn_up.weight")
    assert not np.shares_memory(first.blocks.numpy(), in_file.data)
    assert first.blocks.numpy().tobytes() == in_file.data.tobytes()
    assert dict(loaded.items()).keys() == set(weights)


def test_a_gguf_cut_inside_a_tensor_is_refused_naming_it(tiny_weights, tmp_path):
    config, weights = tiny_weights
    path = tmp_path / "cut.gguf"
    write_gguf(path, config, weights, {})
    loaded = load_checkpoint(path, "auto").weights
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 64)
    with pytest.raises(ValueError, match=r"ends inside tensor"):
        for hf_name in loaded:
            loaded[hf_name]


def test_a_changed_gguf_misses_the_header_cache(tiny_weights, tmp_path, monkeypatch):
    from nanoserve.engine.model.gguf_header import gguf_header

    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config, weights = tiny_weights
    path = tmp_path / "model.gguf"
    write_gguf(path, config, weights, {})
    first = gguf_header(path)
    with path.open("ab") as f:
        f.write(b"\0" * 32)  # another size: another entry, parsed again
    assert gguf_header(path) == first
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
