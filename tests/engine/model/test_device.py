"""dtype and device resolution."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.model import device as device_module
from nanoserve.engine.model.device import resolve_device, resolve_dtype


def test_auto_dtype_is_bfloat16_on_bf16_cpu(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_auto_dtype_is_float32_on_other_cpu(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_auto_dtype_is_float32_on_a_cpu_whose_weights_run_on_the_gguf_kernels(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu"), cpu_quantized_kernels=True) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), cpu_quantized_kernels=True) == torch.bfloat16


def test_auto_dtype_is_bfloat16_on_cuda():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_explicit_dtype_overrides_auto(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_supports_bf16", lambda: True)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32


def test_unknown_dtype_raises():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_raises():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
