"""Model implementations (our own torch code) for the architectures nanoserve serves."""

from nanoserve.engine.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
