"""Linear: the packed (oneDNN) and plain layouts compute the same product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine.model.layers.linear import Linear


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_packed_linear_matches_plain(num_tokens):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(num_tokens, 64, generator=generator)
    torch.testing.assert_close(Linear(weight, bias)(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_plain_linear_keeps_weight_when_not_packing():
    weight = torch.randn(8, 4)
    linear = Linear(weight, pack=False)
    assert linear.packed is None
    assert linear.weight is weight


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN absent: nothing is packed")
def test_packed_linear_drops_the_plain_weight():
    linear = Linear(torch.randn(8, 4))
    assert linear.packed is not None
    assert linear.weight is None


def test_a_weight_onednn_refuses_stays_plain_and_multiplies_right():
    # bfloat16 packs only on CPUs with native bf16 (AVX-512 BF16, AMX); elsewhere oneDNN refuses it
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    linear = Linear(weight)
    assert (linear.packed is None) != (linear.weight is None), "exactly one layout is held"
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x), F.linear(x, weight))
