"""Rotary embedding: the flip-based half swap against Hugging Face's ``rotate_half`` form."""

from __future__ import annotations

import torch

from nanoserve.engine.model.layers.rope import RotaryEmbedding, apply_rope


def test_apply_rope_equals_the_roll_form_bit_for_bit_and_rotate_half_within_an_ulp():
    rope = RotaryEmbedding(8, 32, 10000.0, None, torch.float32, torch.device("cpu"))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))  # [T, H, D]
    cos, sin_signed = rope.lookup(torch.tensor([0, 7, 31]))
    rotated = apply_rope(x, cos, sin_signed)
    assert torch.equal(rotated, torch.addcmul(x * cos, x.roll(4, dims=-1), sin_signed))  # the former form
    sin = sin_signed[..., 4:].repeat(1, 1, 2)  # +sin on both halves, as Hugging Face keeps it
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    # addcmul fuses the multiply-add: one rounding fewer than Hugging Face's x * cos + rotate_half(x) * sin
    torch.testing.assert_close(rotated, x * cos + rotate_half * sin, rtol=0, atol=1e-6)


def test_apply_rope_rotates_strided_heads_of_a_fused_projection():
    rope = RotaryEmbedding(4, 8, 10000.0, None, torch.float32, torch.device("cpu"))
    qkv = torch.randn(2, 5 * 4, generator=torch.Generator().manual_seed(1))  # 3 query + 1 key + 1 value head
    cos, sin = rope.lookup(torch.tensor([2, 5]))
    both = apply_rope(qkv[:, :16].view(2, 4, 4), cos, sin)
    assert torch.equal(both[:, :3], apply_rope(qkv[:, :12].reshape(2, 3, 4), cos, sin))
    assert torch.equal(both[:, 3:], apply_rope(qkv[:, 12:16].reshape(2, 1, 4), cos, sin))
