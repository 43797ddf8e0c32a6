"""The bounds of a request's sampling fields, as plain numbers: no torch, so the CLI checks its flags
against the same limits the engine enforces (``SamplingParams``) before it connects."""

from __future__ import annotations

MAX_LOGPROBS = 20  # most top alternatives returned per generated token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound on one request's logit_bias map
MAX_LOGIT_BIAS = 100.0  # a bias is in [-100, 100] (OpenAI): -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2] (OpenAI)
