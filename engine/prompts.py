"""The prompt forms a request may carry besides plain text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokensPrompt:
    """A prompt given as token ids (no tokenization on the engine's side)."""

    prompt_token_ids: list[int]


@dataclass
class ChatPrompt:
    """A conversation rendered with the model's chat template.

    messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``;
    the template adds the generation prompt for the assistant's turn.
    """

    messages: list[dict[str, str]] = field(default_factory=list)


Prompt = str | TokensPrompt | ChatPrompt
