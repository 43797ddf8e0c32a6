"""The benchmark workload: chat requests of mixed prompt and output lengths.

Shared by bench/engine_throughput.py and the gRPC load generator, so both
measure the same thing. Deterministic for a given seed and tokenizer.

    from bench.workload import build_workload
    requests = build_workload(tokenizer, num_requests=256, seed=0)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

# Plain words; prompts are random sentences of them, asking for a continuation.
WORDS = [
    "the",
    "a",
    "model",
    "cache",
    "block",
    "token",
    "stream",
    "server",
    "request",
    "engine",
    "paper",
    "river",
    "mountain",
    "city",
    "garden",
    "music",
    "history",
    "science",
    "ocean",
    "forest",
    "winter",
    "summer",
    "light",
    "shadow",
    "story",
    "question",
    "answer",
    "number",
    "window",
    "table",
    "kitchen",
    "market",
    "train",
    "bridge",
    "library",
    "teacher",
    "student",
    "planet",
    "energy",
    "signal",
    "memory",
    "quickly",
    "slowly",
    "carefully",
    "brightly",
    "quietly",
    "always",
    "never",
    "often",
    "because",
    "while",
    "after",
    "before",
    "under",
    "explain",
    "describe",
    "compare",
    "imagine",
    "write",
    "list",
    "summarize",
    "translate",
    "consider",
    "remember",
    "build",
    "open",
]


# A short system turn: the default one of some templates is longer than the shortest prompts.
SYSTEM_PROMPT = "Continue the text."


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    """messages: the chat; prompt_token_ids: it rendered by the chat template;
    max_tokens: tokens to generate (greedy, ignore_eos in the benchmark)."""

    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    max_tokens: int


def build_workload(
    tokenizer: ChatTokenizer,
    num_requests: int = 256,
    *,
    min_prompt_tokens: int = 20,
    max_prompt_tokens: int = 200,
    min_max_tokens: int = 16,
    max_max_tokens: int = 256,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """``num_requests`` chat requests, prompt lengths and max_tokens uniform in their ranges.

    Prompt lengths are hit to within a few tokens (words are whole), always
    inside [min_prompt_tokens, max_prompt_tokens].
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        target = rng.randint(min_prompt_tokens, max_prompt_tokens)
        messages, token_ids = _chat_of_length(tokenizer, rng, target, min_prompt_tokens, max_prompt_tokens)
        requests.append(WorkloadRequest(messages, token_ids, rng.randint(min_max_tokens, max_max_tokens)))
    return requests


def _chat_of_length(
    tokenizer: ChatTokenizer, rng: random.Random, target: int, low: int, high: int
) -> tuple[list[dict[str, str]], list[int]]:
    words = [rng.choice(WORDS) for _ in range(high)]
    num_words = max(1, target // 2)
    for _ in range(8):  # adjust the word count until the rendered length lands in range
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": " ".join(words[:num_words])},
        ]
        token_ids = list(tokenizer.apply_chat_template(messages))
        error = len(token_ids) - target
        if abs(error) <= 2 and low <= len(token_ids) <= high:
            break
        num_words = min(len(words), max(1, num_words - error))
    if not low <= len(token_ids) <= high:
        raise ValueError(f"could not build a prompt of {target} tokens in [{low}, {high}]; got {len(token_ids)}")
    return messages, token_ids
