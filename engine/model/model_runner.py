"""ModelRunner: the model, its tokenizer and its paged KV cache, behind one ``forward(batch)``.

Start-up resolves device and dtype, loads the checkpoint (GGUF or Hugging Face
folder), sizes the KV cache from ``num_kv_blocks`` or the ``kv_cache_memory``
budget, and picks the attention backend. Each step the scheduler hands over a
``ForwardBatch`` and gets back the logits of the sequences that asked for them.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.model.attention import select_backend
from nanoserve.engine.model.batch_invariance import batch_invariance, linears_of, wants_batch_invariance
from nanoserve.engine.model.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from nanoserve.engine.model.forward_batch import ForwardBatch
from nanoserve.engine.model.kv_cache import KVCache, KVCacheSpec
from nanoserve.engine.model.layers.quantized_linear import GGUFLinear, gguf_kernels_take
from nanoserve.engine.model.llama import LlamaForCausalLM
from nanoserve.engine.model.process_memory import process_memory, release_free_heap
from nanoserve.engine.model.threads import ThreadTuner, configure_threads
from nanoserve.engine.model.weights import load_checkpoint, resolve_model_path
from nanoserve.engine.text.tokenizer import Tokenizer, load_hf_tokenizer

log = structlog.get_logger(__name__)


class ModelRunner:
    """Owns the weights and the KV cache tensors; the block ids are the allocator's.

    Raises ValueError at start-up when ``max_model_len`` exceeds the model's context
    length or the cache budget holds no block, FileNotFoundError for a missing model.
    """

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        memory_before = process_memory()
        self.config = config
        threads = configure_threads(config.model.num_threads)
        log.info(
            "model_runner.threads",
            num_threads=threads.num_threads,
            available_cpus=threads.available_cpus,
            wait_policy=threads.wait_policy,
            source=threads.source,
            tuned=config.model.num_threads is None,
        )
        # the thread count adapts per step size unless the setting fixed it
        self.thread_tuner = ThreadTuner(threads.num_threads) if config.model.num_threads is None else None
        self._num_threads = threads.num_threads
        self.device = resolve_device(config.model.device)
        self.quantization = config.model.quantization
        path = resolve_model_path(config.model.model)
        # transformers' import and the tokenizer's files load on a thread while the weights convert
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenizer-load")
        hf_tokenizer = loader.submit(_load_hf_tokenizer_and_trim, path)
        loader.shutdown(wait=False)
        checkpoint = load_checkpoint(path, self.quantization)
        on_gguf_kernels = gguf_kernels_take(checkpoint.quant_types, self.quantization, self.device)
        invariant = wants_batch_invariance(config.model.batch_invariant, on_gguf_kernels)
        self.dtype = resolve_dtype(config.model.dtype, self.device, cpu_quantized_kernels=on_gguf_kernels)
        arch = checkpoint.config
        self.model_name = checkpoint.name
        eos_token_ids = checkpoint.eos_token_ids
        self.vocab_size = arch.vocab_size
        if config.model.max_model_len is not None and config.model.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's context length {arch.max_position_embeddings}, "
                f"got {config.model.max_model_len}"
            )
        self.max_model_len = config.model.max_model_len or arch.max_position_embeddings
        self.model = LlamaForCausalLM(arch, self.dtype, self.device, checkpoint.rope_freq_factors)
        self.model.load_weights(
            checkpoint.weights,
            self.quantization,
            config.model.dense_large_steps,
            config.model.matmul_precision,
            invariant,
        )
        del checkpoint
        release_free_heap()  # the conversion's freed buffers
        weights_s = time.perf_counter() - started
        self.tokenizer = Tokenizer.from_path(path, eos_token_ids, hf_tokenizer.result())
        tokenizer_wait_s = time.perf_counter() - started - weights_s

        self.block_size = config.cache.block_size
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, on_gguf_kernels)
        spec = KVCacheSpec(arch.num_layers, self.block_size, arch.num_kv_heads, arch.head_dim, self.kv_cache_dtype)
        self.num_kv_blocks = config.cache.num_kv_blocks or spec.num_blocks_for(config.cache.kv_cache_memory)
        self.kv_cache = KVCache(spec, self.num_kv_blocks, self.device)
        self.attention, backend_reason = select_backend(
            self.device, self.dtype, self.kv_cache_dtype, self.block_size, invariant
        )
        self.batch_invariance = batch_invariance(self.model, self.attention)
        # every linear on nanoserve's GGUF kernel: steps of up to 8 rows run its decode tiles, row by row
        self.on_gguf_kernels = all(isinstance(linear, GGUFLinear) for linear in linears_of(self.model))
        memory_after = process_memory()
        log.info(
            "model_runner.ready",
            model=self.model_name,
            architecture=arch.architecture,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            quantization=self.quantization,
            matmul_precision=config.model.matmul_precision,
            batch_invariant=config.model.batch_invariant,
            batch_invariance=self.batch_invariance,  # which guarantee holds here
            bf16_large_steps=getattr(self.model.lm_head, "isa", "best")
            in ("avx512_bf16", "amx_bf16"),  # GGUFLinear chose
            large_step_isa=getattr(self.model.lm_head, "isa", None),
            attention_backend=self.attention.name,
            attention_backend_reason=backend_reason,
            kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            num_kv_tokens=self.kv_cache.num_tokens,
            kv_cache_bytes=self.kv_cache.num_bytes,
            bytes_per_block=spec.bytes_per_block,
            max_model_len=self.max_model_len,
            weight_bytes=self.weight_bytes,
            load_s=round(time.perf_counter() - started, 2),
            weights_s=round(weights_s, 2),  # threads, file, weights: from the start of load_s
            tokenizer_wait_s=round(tokenizer_wait_s, 2),  # then waited for the tokenizer's thread
            # resident bytes before the load (interpreter, imports), after it, and the peak so far (VmHWM)
            rss_before_load_bytes=memory_before.rss_bytes if memory_before else None,
            rss_after_load_bytes=memory_after.rss_bytes if memory_after else None,
            peak_rss_bytes=memory_after.peak_rss_bytes if memory_after else None,
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights take in memory (not the KV cache)."""
        return self.model.num_weight_bytes()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One step: write the batch's K/V into its slots, return logits.

        Returns [num_logits, vocab_size] float32, one row per ``logits_indices`` entry,
        in batch order.
        """
        num_tokens = int(batch.input_ids.shape[0])
        if self.thread_tuner is None or self.device.type != "cpu":
            return self._forward(batch)
        num_threads = self.thread_tuner.choose(num_tokens)
        if num_threads != self._num_threads:
            torch.set_num_threads(num_threads)
            self._num_threads = num_threads
        started = time.perf_counter()
        logits = self._forward(batch)
        self.thread_tuner.record(num_tokens, num_threads, time.perf_counter() - started)
        return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the K/V rows of each (source, destination) block pair (copy on write of a forked block)."""
        with torch.inference_mode():
            self.kv_cache.copy_blocks(pairs)

    def close(self) -> None:
        """Nothing to end in this process (``RunnerProcess.close`` ends its child); the weights and the
        KV cache go with the runner."""

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            metadata = self.attention.prepare(batch, self.block_size)
            logits = self.model(
                batch.input_ids, batch.positions, batch.logits_indices, self.kv_cache, self.attention, metadata
            )
            return logits.float()


def _load_hf_tokenizer_and_trim(path: Path) -> Any:
    """``load_hf_tokenizer``, then the C heap's freed pages back to the kernel.

    Reading the tokenizer's files frees ~45 MiB of parse buffers; trimmed now, they are
    not still resident under the weights when those reach their peak.
    """
    tokenizer = load_hf_tokenizer(path)
    release_free_heap()
    return tokenizer
