"""The real SmolLM2 through our paged runner against Hugging Face transformers (float32).

Both load the same GGUF. Greedy continuations must match token for token and the
prompt's last-position logits must agree within ``LOGITS_ATOL``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real_model

MAX_NEW_TOKENS = 64
# float32 through 30 layers with different matmul blockings and attention kernels:
# observed differences are ~1e-4 on logits of magnitude ~20.
LOGITS_ATOL = 2e-3

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press adapted from wine making. "
) * 10 + "Summarise the passage above in one sentence:"

PLAIN_PROMPTS = [
    "The quick brown fox",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "Le café coûte 3 € à Zürich ; 東京は日本の首都です。Übersetze:",
    "1, 2, 3, 5, 8, 13,",
    LONG_TEXT,
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write a haiku about autumn leaves."},
    ],
]


@pytest.fixture(scope="module")
def prompts(real_runner) -> list[list[int]]:
    tok = real_runner.tokenizer
    ids = [tok.encode(text) for text in PLAIN_PROMPTS] + [tok.apply_chat_template(chat) for chat in CHATS]
    assert max(len(p) for p in ids) > 300, "one prompt must be over 300 tokens"
    return ids


@pytest.fixture(scope="module")
def reference(prompts, real_hf_tokenizer) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy tokens and first-step logits for every prompt, in one padded batch."""
    pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate (dev extra)")
    from transformers import AutoModelForCausalLM

    from nanoserve.engine.model.weights import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    width = max(len(p) for p in prompts)
    pad = real_hf_tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tokens: list[torch.Tensor] = []
    with torch.inference_mode():  # a plain greedy loop: no logits processors, no stop at EOS
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        first_logits = out.logits[:, -1].float()
        for _ in range(MAX_NEW_TOKENS):
            tokens.append(out.logits[:, -1].argmax(-1))
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids[:, -1:] + 1
            out = model(
                input_ids=tokens[-1][:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=out.past_key_values,
                use_cache=True,
            )
    return torch.stack(tokens, dim=1).tolist(), first_logits


@pytest.fixture(scope="module")
def ours(real_runner, prompts, greedy) -> tuple[list[list[int]], torch.Tensor]:
    """Our greedy tokens and prefill last-position logits, all prompts batched."""
    return greedy(real_runner, prompts, MAX_NEW_TOKENS)


def test_greedy_tokens_match_transformers(ours, reference):
    ours, _ = ours
    theirs, _ = reference
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, (
            f"prompt {i} diverges at token {next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)}"
        )


def test_last_position_logits_match_transformers(ours, reference):
    _, logits = ours
    _, ref_logits = reference
    diff = (logits - ref_logits).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logit difference| {diff:.2e} >= {LOGITS_ATOL}"
